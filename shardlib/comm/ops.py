"""torch.distributed's calls, recorded: what every shardlib technique communicates with.

Each function has the name, arguments and result of the torch.distributed function it calls
(peers and `src` are global ranks, as there), and writes one record into every open ledger
(shardlib.comm.ledger) before calling it. The bytes each record counts are the ledger's table.

Two older names are smoothed over: PyTorch 2.14 calls the flat all-gather and reduce-scatter
`all_gather_single` and `reduce_scatter_single`; earlier releases `all_gather_into_tensor` and
`reduce_scatter_tensor`. Both spellings work here, under PyTorch's older (still valid) names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlib.comm.ledger import (
    CommRecord,
    collective_record,
    group_ranks,
    inside_recorded_call,
    nbytes_of,
    record,
    recording,
)

__all__ = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
           "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier"]


def _call(entry_fn, fn, *args, **kwargs):
    if recording():
        record(entry_fn())
    with inside_recorded_call():
        return fn(*args, **kwargs)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, *, group=None, async_op: bool = False):
    """Reduce `tensor` over the group, in place (sum by default)."""
    return _call(lambda: collective_record("all_reduce", tensor, group),
                 dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False):
    """Concatenate every rank's `input` (n,) into `output` (N*n,), in group order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _call(lambda: collective_record("all_gather", output, group),
                 gather, output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, *, group=None,
                          async_op: bool = False):
    """Sum `input` (N*n,) over the group; rank r keeps elements [r*n, (r+1)*n) in `output` (n,)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _call(lambda: collective_record("reduce_scatter", input, group),
                 scatter, output, input, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, *, group=None, async_op: bool = False):
    """Every rank's `tensor` into `tensor_list` (one tensor per rank, in group order)."""
    return _call(lambda: collective_record("all_gather", tensor_list, group),
                 dist.all_gather, tensor_list, tensor, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, *, group=None, async_op: bool = False):
    """Copy global rank `src`'s `tensor` to every rank of the group, in place."""
    return _call(lambda: collective_record("broadcast", tensor, group),
                 dist.broadcast, tensor, src=src, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None, *,
                      group=None, async_op: bool = False):
    """Split `input` along dim 0 (evenly, or by input_split_sizes): split j goes to group rank j, and
    output split j (by output_split_sizes) comes from group rank j."""
    def entry():
        ranks = group_ranks(group)
        n, size = len(ranks), nbytes_of(input)
        me = ranks.index(dist.get_rank())
        if input_split_sizes is None:
            kept = size // n
        else:
            kept = input_split_sizes[me] * (size // max(input.shape[0], 1)) if input.shape[0] else 0
        return CommRecord("all_to_all", size, size - kept, ranks)

    return _call(entry, dist.all_to_all_single, output, input, output_split_sizes, input_split_sizes,
                 group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, *, group=None) -> None:
    size = nbytes_of(tensor)
    return _call(lambda: CommRecord("send", size, size, (dst,)), dist.send, tensor, dst, group=group)


def recv(tensor: torch.Tensor, src: int, *, group=None):
    return _call(lambda: CommRecord("recv", nbytes_of(tensor), 0, (src,)), dist.recv, tensor, src, group=group)


def isend(tensor: torch.Tensor, dst: int, *, group=None):
    size = nbytes_of(tensor)
    return _call(lambda: CommRecord("send", size, size, (dst,)), dist.isend, tensor, dst, group=group)


def irecv(tensor: torch.Tensor, src: int, *, group=None):
    return _call(lambda: CommRecord("recv", nbytes_of(tensor), 0, (src,)), dist.irecv, tensor, src, group=group)


def batch_isend_irecv(p2p_op_list: list) -> list:
    """Start every dist.P2POp of the list together and return their requests (NCCL needs a ring's
    sends and receives started as one group); each op is recorded as a send or a recv."""
    if recording():
        isend = getattr(dist.isend, "_shardlib_original", dist.isend)
        for op in p2p_op_list:
            size = nbytes_of(op.tensor)
            sending = getattr(op.op, "_shardlib_original", op.op) is isend
            record(CommRecord("send" if sending else "recv", size, size if sending else 0, (op.peer,)))
    with inside_recorded_call():
        return dist.batch_isend_irecv(p2p_op_list)


def barrier(group=None) -> None:
    return _call(lambda: collective_record("barrier", None, group), dist.barrier, group=group)
