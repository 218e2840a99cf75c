"""Ring attention: causal attention on a sequence split over N ranks, K,V blocks passed around a ring.

Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
arXiv 2310.01889. The layout of the tokens (contiguous or zigzag), the costs and the other method
(Ulysses) are in shardlib/parallel/context.py; the course GPT on a split sequence in context_gpt.py.

Each rank keeps its queries (B, nh, s/N, d). For N steps it computes the attention of its queries
on one key/value block (its own first) while sending that block on to the next rank and receiving
the next one from the previous rank (`ring_pass`: isend/irecv, so the transfer overlaps the
compute). Partial results over disjoint key sets are merged exactly with the online-softmax
rescaling (Milakov and Gimelshein, arXiv 1805.02867; FlashAttention, arXiv 2205.14135):

    lse = log(e^lse_a + e^lse_b),   out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)

Only (out, lse) are kept for backward; the scores of a block are recomputed there. Backward passes
K,V around the ring again, and with them, one hop behind, the running sums of dK and dV: after N
hops each block's sums reach the rank that owns it.

Per rank and layer (b batch, s sequence, h_kv = kv heads * head size, e bytes per value):
    forward   N-1 sends of a K,V block:                    (N-1)/N * 2 b s h_kv e
    backward  N-1 sends of a K,V block + N of a dK,dV one: (2N-1)/N * 2 b s h_kv e
    memory    q, k, v, out, lse of s/N tokens; one chunk pair of scores at a time
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from shardlib.comm import ops
from shardlib.comm.ledger import group_ranks
from shardlib.parallel.context import SequenceLayout

__all__ = ["merge_attention", "block_attention", "scores_computed", "ring_pass", "ring_attention"]


# ---------------------------------------------------------------------------------
# attention of a query block on one key/value block, and the online-softmax merge


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Two partial attention results over disjoint key sets -> the result over their union.

    out: (..., tq, d) softmax-weighted values over each key set; lse: (..., tq) log-sum-exp of its scores.
    lse = log(e^lse_a + e^lse_b) and out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)."""
    lse = torch.logaddexp(lse_a, lse_b)  # (..., tq)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


def _expand_kv(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, n_kv, t, d) -> (B, n_head, t, d): each kv head serves n_head/n_kv query heads."""
    return x if x.shape[1] == n_head else x.repeat_interleave(n_head // x.shape[1], dim=1)


def _scores(q, k, q_pos, k_pos, causal: bool):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, nh, tq, tk)
    if causal:
        s = s.masked_fill(k_pos.unsqueeze(0) > q_pos.unsqueeze(1), float("-inf"))
    return s


def block_attention(q, k, v, q_pos, k_pos, causal: bool):
    """Attention of queries at positions q_pos on keys at k_pos: (out (B, nh, tq, d), lse (B, nh, tq)).
    causal: mask keys after the query. Every query must see at least one key."""
    s = _scores(q, _expand_kv(k, q.shape[1]), q_pos, k_pos, causal)
    lse = torch.logsumexp(s, dim=-1)  # (B, nh, tq)
    return torch.exp(s - lse.unsqueeze(-1)) @ _expand_kv(v, q.shape[1]), lse


def _chunk_pairs(layout: SequenceLayout, q_rank: int, kv_rank: int):
    """(q rows, kv rows, causal) of the chunk pairs with a visible score; rows index the local blocks.
    A key chunk wholly before a query chunk is seen in full, the same chunk is causal, a later one skipped."""
    def with_rows(chunks):
        rows, offset = [], 0
        for a, b in chunks:
            rows.append((a, b, slice(offset, offset + b - a)))
            offset += b - a
        return rows

    for qa, qb, q_rows in with_rows(layout.chunks(q_rank)):
        for ka, kb, kv_rows in with_rows(layout.chunks(kv_rank)):
            if ka >= qb:
                continue  # every key after every query: masked out entirely
            yield q_rows, kv_rows, kb > qa + 1  # causal mask needed only where the chunks overlap


def scores_computed(layout: SequenceLayout, rank: int) -> int:
    """Scores (query, key pairs) rank computes in ring attention, per sequence and head: every chunk
    pair it does not skip, in full (the causal mask of a diagonal pair is applied after computing it)."""
    return sum((q_rows.stop - q_rows.start) * (kv_rows.stop - kv_rows.start)
               for source in range(layout.world_size) for q_rows, kv_rows, _ in _chunk_pairs(layout, rank, source))


# ---------------------------------------------------------------------------------
# the ring


def _exchange(send: torch.Tensor, recv_numel: int, group, tag: int):
    """Send `send` to the next rank of the ring and receive recv_numel values from the previous one."""
    ranks, me = group_ranks(group), dist.get_rank(group)
    n = len(ranks)
    received = send.new_empty(recv_numel)
    requests = ops.batch_isend_irecv([dist.P2POp(dist.isend, send, ranks[(me + 1) % n], group, tag),
                                      dist.P2POp(dist.irecv, received, ranks[(me - 1) % n], group, tag)])
    return received, requests


def _wait(pending):
    received, requests = pending
    for request in requests:
        request.wait()
    return received


def ring_pass(block: torch.Tensor, numel_of, *, group, overlap: bool = True, timeline: list | None = None):
    """Yield (source rank, that rank's block) N times: this rank's own block, then each block received
    from the previous rank, while the current one is sent on to the next (N-1 sends per rank).

    block: this rank's flat tensor; numel_of(rank): how many values rank's block holds.
    overlap: start each transfer before the caller computes on the current block (False: finish it first).
    timeline: a list that gets ("start", "compute" or "wait", start, end) in perf_counter seconds: starting
    the transfer, the caller's computation, waiting for the transfer to end."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    for step in range(n):
        source = (me - step) % n
        start = time.perf_counter()
        pending = _exchange(block, numel_of((source - 1) % n), group, tag=0) if step < n - 1 else None
        if timeline is not None and pending is not None:
            timeline.append(("start", start, time.perf_counter()))
        if pending is not None and not overlap:
            block_next = _timed_wait(pending, timeline)
        start = time.perf_counter()
        yield source, block  # the caller computes on this block now, while the transfer runs
        if timeline is not None:
            timeline.append(("compute", start, time.perf_counter()))
        if pending is not None:
            block = _timed_wait(pending, timeline) if overlap else block_next


def _timed_wait(pending, timeline):
    start = time.perf_counter()
    received = _wait(pending)
    if timeline is not None:
        timeline.append(("wait", start, time.perf_counter()))
    return received


class _RingAttention(torch.autograd.Function):
    """Causal ring attention on this rank's block; backward sends K,V around again with dK,dV behind."""

    @staticmethod
    def forward(ctx, q, k, v, layout, group, overlap, timeline):
        me = dist.get_rank(group)
        B, n_kv, _, d = k.shape  # k, v: (B, n_kv, s_r, d); q: (B, nh, s_r, d)
        out = torch.zeros_like(q)  # (B, nh, s_r, d)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (B, nh, s_r)
        q_pos = layout.positions(me).to(q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])  # (2 B n_kv s_r d,): one message per step
        for source, kv_block in ring_pass(kv, lambda r: 2 * B * n_kv * layout.length(r) * d, group=group,
                                          overlap=overlap, timeline=timeline):
            k_s, v_s = kv_block.view(2, B, n_kv, -1, d)  # (B, n_kv, s_source, d) each
            k_pos = layout.positions(source).to(q.device)
            for q_rows, kv_rows, causal in _chunk_pairs(layout, me, source):
                o, l = block_attention(q[:, :, q_rows], k_s[:, :, kv_rows], v_s[:, :, kv_rows], q_pos[q_rows],
                                       k_pos[kv_rows], causal)
                out[:, :, q_rows], lse[:, :, q_rows] = merge_attention(out[:, :, q_rows], lse[:, :, q_rows], o, l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.overlap = layout, group, overlap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group = ctx.layout, ctx.group
        me, n = dist.get_rank(group), dist.get_world_size(group)
        B, n_kv, _, d = k.shape
        nh = q.shape[1]
        numel_of = lambda r: 2 * B * n_kv * layout.length(r) * d
        grad_q = torch.zeros_like(q)
        delta = (grad_out * out).sum(-1)  # (B, nh, s_r): rowsum(dO * O), FlashAttention-2's D
        q_pos = layout.positions(me).to(q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        pending_grads = None
        for source, kv_block in ring_pass(kv, numel_of, group=group, overlap=ctx.overlap):
            k_s, v_s = (_expand_kv(t, nh) for t in kv_block.view(2, B, n_kv, -1, d))  # (B, nh, s_source, d)
            grad_k, grad_v = torch.zeros_like(k_s), torch.zeros_like(v_s)
            k_pos = layout.positions(source).to(q.device)
            for q_rows, kv_rows, causal in _chunk_pairs(layout, me, source):
                qc, kc, vc, go = q[:, :, q_rows], k_s[:, :, kv_rows], v_s[:, :, kv_rows], grad_out[:, :, q_rows]
                p = torch.exp(_scores(qc, kc, q_pos[q_rows], k_pos[kv_rows], causal)
                              - lse[:, :, q_rows].unsqueeze(-1))  # (B, nh, tq, tk)
                grad_v[:, :, kv_rows] += p.transpose(-2, -1) @ go
                grad_s = p * (go @ vc.transpose(-2, -1) - delta[:, :, q_rows].unsqueeze(-1)) / math.sqrt(d)
                grad_q[:, :, q_rows] += grad_s @ kc
                grad_k[:, :, kv_rows] += grad_s.transpose(-2, -1) @ qc
            grads = torch.cat([_sum_kv_groups(grad_k, n_kv).reshape(-1), _sum_kv_groups(grad_v, n_kv).reshape(-1)])
            if pending_grads is not None:  # the sums for this block from the ranks it visited before
                grads += _wait(pending_grads)
            if n > 1:  # pass the running sums on, one hop behind K,V; after N hops they are home
                pending_grads = _exchange(grads, numel_of((source - 1) % n), group, tag=1)
        if n > 1:
            grads = _wait(pending_grads)  # this rank's own dK, dV, summed over every rank
        grads = grads.view(2, B, n_kv, -1, d)
        return grad_q, grads[0], grads[1], None, None, None, None


def _sum_kv_groups(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, nh, t, d) -> (B, n_kv, t, d): the query heads that shared a kv head add their gradients."""
    B, nh, t, d = grad.shape
    return grad if nh == n_kv else grad.view(B, n_kv, nh // n_kv, t, d).sum(2)


def ring_attention(q, k, v, layout: SequenceLayout, *, group, overlap: bool = True, timeline: list | None = None):
    """Causal attention of this rank's tokens on the whole sequence, K,V blocks passed around the ring.
    q: (B, nh, s_r, d), k, v: (B, n_kv, s_r, d), tokens at layout.positions(rank) -> (B, nh, s_r, d)."""
    layout.check_group(group)
    return _RingAttention.apply(q, k, v, layout, group, overlap, timeline)
