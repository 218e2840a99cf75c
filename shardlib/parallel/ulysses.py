"""Ulysses: attention on a sequence split over N ranks by switching to a split of the heads.

Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models", arXiv 2309.14509. The token layout and the costs are in
shardlib/parallel/context.py.

Attention mixes tokens but never heads. An all-to-all turns q, k, v from (B, H, s/N, d) on each
rank, every head of its tokens, into (B, H/N, s, d), every token of its H/N heads; each rank runs
ordinary causal attention on whole sequences; a fourth all-to-all turns the output back. The
inverse all-to-all is each one's backward. N must divide the heads (and the kv heads).

Per rank and layer: forward 4 all-to-alls, each sending (N-1)/N of the local b (s/N) h values
(k, v: h_kv); backward the same 4, reversed. The bytes per rank shrink as N grows, unlike ring
attention's, but N is capped by the number of heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlib.comm import ops
from shardlib.parallel.context import LayoutCollective, SequenceLayout

__all__ = ["ulysses_attention"]


def _seq_to_heads(x: torch.Tensor, layout: SequenceLayout, group) -> torch.Tensor:
    """(B, H, s_r, d) this rank's tokens, all heads -> (B, H/N, s, d) every token (layout order), H/N heads."""
    me, n = dist.get_rank(group), layout.world_size
    B, H, s_r, d = x.shape
    send = x.reshape(B, n, H // n, s_r, d).transpose(0, 1).reshape(-1)  # (N * B H/N s_r d,): chunk j to rank j
    sizes = [B * (H // n) * layout.length(r) * d for r in range(n)]
    received = x.new_empty(sum(sizes))
    ops.all_to_all_single(received, send, sizes, [sizes[me]] * n, group=group)
    pieces = [p.view(B, H // n, -1, d) for p in received.split(sizes)]  # from rank j: its s_j tokens
    return torch.cat(pieces, dim=2)  # (B, H/N, s, d)


def _heads_to_seq(x: torch.Tensor, layout: SequenceLayout, group) -> torch.Tensor:
    """The inverse: (B, H/N, s, d) in layout order -> (B, H, s_r, d)."""
    me, n = dist.get_rank(group), layout.world_size
    B, h_n, _, d = x.shape
    lengths = [layout.length(r) for r in range(n)]
    send = torch.cat([p.reshape(-1) for p in x.split(lengths, dim=2)])  # rank j's tokens to rank j
    sizes = [B * h_n * length * d for length in lengths]
    received = x.new_empty(n * sizes[me])
    ops.all_to_all_single(received, send, [sizes[me]] * n, sizes, group=group)
    return received.view(n, B, h_n, lengths[me], d).transpose(0, 1).reshape(B, n * h_n, lengths[me], d)


def ulysses_attention(q, k, v, layout: SequenceLayout, *, group):
    """Causal attention by head groups: 3 all-to-alls in, attention on all s tokens of H/N heads, 1 out.
    q: (B, nh, s_r, d), k, v: (B, n_kv, s_r, d) at layout.positions(rank) -> (B, nh, s_r, d)."""
    layout.check_group(group)
    if q.shape[1] % layout.world_size or k.shape[1] % layout.world_size:
        raise ValueError(f"Ulysses splits heads over N={layout.world_size} ranks: {q.shape[1]} query and {k.shape[1]} "
                         "key/value heads must both be divisible by N; use ring attention, or N dividing both")
    order = layout.order().to(q.device)  # layout -> global
    natural = torch.argsort(order)
    to_heads = lambda t: LayoutCollective.apply(t.contiguous(), layout, group, _seq_to_heads, _heads_to_seq)
    q, k, v = (to_heads(t).index_select(2, natural) for t in (q, k, v))  # (B, heads/N, s, d), positions 0..s-1
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    y = y.index_select(2, order).contiguous()  # (B, heads/N, s, d) in layout order
    return LayoutCollective.apply(y, layout, group, _heads_to_seq, _seq_to_heads)  # (B, nh, s_r, d)
