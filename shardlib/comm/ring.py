"""Collectives from scratch on send/recv: ring all-reduce, reduce-scatter, all-gather, and broadcast.

The ring algorithms (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009; the schedule NCCL and gloo use for large tensors). A tensor of S bytes is
cut into N chunks of c = ceil(numel/N) elements (the last chunks padded with zeros); at each step
every rank sends one chunk to its right neighbour and receives one from its left:

    reduce-scatter   N-1 steps; after them rank r holds the sum of every rank's chunk r
    all-gather       N-1 steps; each rank's chunk travels once around the ring
    all-reduce       a reduce-scatter, then an all-gather: 2(N-1) steps, 2(N-1)/N * S sent per rank
    broadcast        a chain src -> src+1 -> ... cut into k = N pieces, so that every link is busy at once

Costs per rank: shardlib.comm.cost (bytes and the alpha-beta time). The sends and receives go
through shardlib.comm.ops, so a ledger records each of them, exactly.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardlib.comm import ops
from shardlib.comm.ledger import group_ranks

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "ring_broadcast"]


def _ring(group) -> tuple[int, int, int, int]:
    """(my index in the group, group size, global rank on my left, global rank on my right)."""
    ranks = group_ranks(group)
    n, me = len(ranks), ranks.index(dist.get_rank())
    return me, n, ranks[(me - 1) % n], ranks[(me + 1) % n]


def _exchange(send_chunk: torch.Tensor, recv_chunk: torch.Tensor, left: int, right: int, group) -> None:
    """Send to the right neighbour while receiving from the left (isend first: no deadlock)."""
    request = ops.isend(send_chunk, right, group=group)
    ops.recv(recv_chunk, left, group=group)
    request.wait()


def _padded_chunks(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """Flatten and zero-pad to N equal chunks: (numel,) -> (N, c), c = ceil(numel/N)."""
    flat = tensor.reshape(-1)
    c = math.ceil(flat.numel() / n)
    padded = torch.zeros(n * c, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()] = flat
    return padded.view(n, c)  # (N, c)


def _reduce_scatter_chunks(chunks: torch.Tensor, me: int, n: int, left: int, right: int, group) -> None:
    """After N-1 steps, chunks[me] holds the sum over ranks of everyone's chunks[me]."""
    incoming = torch.empty_like(chunks[0])  # (c,)
    for step in range(n - 1):
        send_index, recv_index = (me - step - 1) % n, (me - step - 2) % n
        _exchange(chunks[send_index], incoming, left, right, group)
        chunks[recv_index] += incoming


def _all_gather_chunks(chunks: torch.Tensor, me: int, n: int, left: int, right: int, group) -> None:
    """Starting from chunks[me] complete on each rank, after N-1 steps every chunk is."""
    for step in range(n - 1):
        send_index, recv_index = (me - step) % n, (me - step - 1) % n
        _exchange(chunks[send_index], chunks[recv_index], left, right, group)


def ring_all_reduce(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum `tensor` over the group, in place: a ring reduce-scatter, then a ring all-gather."""
    me, n, left, right = _ring(group)
    if n == 1:
        return tensor
    in_place = tensor.is_contiguous() and tensor.numel() % n == 0
    chunks = tensor.view(n, -1) if in_place else _padded_chunks(tensor, n)  # (N, c): no copy when N divides
    _reduce_scatter_chunks(chunks, me, n, left, right, group)
    _all_gather_chunks(chunks, me, n, left, right, group)
    if not in_place:
        tensor.copy_(chunks.reshape(-1)[: tensor.numel()].view_as(tensor))
    return tensor


def ring_reduce_scatter(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum `tensor` over the group and return this rank's shard of the flattened result.

    Shard r is elements [r*c, (r+1)*c) of the flattened tensor, c = ceil(numel/N), cut
    at numel (so the last shards may be shorter, or empty), as FSDP shards a flat parameter.
    """
    me, n, left, right = _ring(group)
    chunks = _padded_chunks(tensor, n)  # (N, c)
    _reduce_scatter_chunks(chunks, me, n, left, right, group)
    start = me * chunks.shape[1]
    return chunks[me][: max(0, min(chunks.shape[1], tensor.numel() - start))].clone()  # (<= c,)


def ring_all_gather(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Concatenate every rank's `tensor` (same shape on all) along a new first dim: (N, *shape)."""
    me, n, left, right = _ring(group)
    chunks = torch.empty((n, tensor.numel()), dtype=tensor.dtype, device=tensor.device)  # (N, numel)
    chunks[me] = tensor.reshape(-1)
    _all_gather_chunks(chunks, me, n, left, right, group)
    return chunks.view(n, *tensor.shape)  # (N, *shape)


def ring_broadcast(tensor: torch.Tensor, src: int = 0, *, group=None) -> torch.Tensor:
    """Copy `tensor` from group rank `src` to all, in place: a chain src -> src+1 -> ... cut
    into N pieces so that every link is busy at once (pipelined), as NCCL's ring broadcast."""
    me, n, left, right = _ring(group)
    if n == 1:
        return tensor
    pieces = _padded_chunks(tensor, n)  # (k=N, c)
    position = (me - src) % n  # 0 at the source, n-1 at the end of the chain
    for piece in pieces:
        if position > 0:
            ops.recv(piece, left, group=group)
        if position < n - 1:
            ops.send(piece, right, group=group)
    tensor.copy_(pieces.reshape(-1)[: tensor.numel()].view_as(tensor))
    return tensor


