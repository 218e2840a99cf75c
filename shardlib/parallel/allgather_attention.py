"""All-gather context parallelism: each rank gathers every K, V block, then attends with its own queries.

Llama 3's context parallelism (Dubey et al., "The Llama 3 Herd of Models", arXiv 2407.21783, Section
3.3.2). Rather than pass the K, V blocks round a ring behind the attention (ring_attention.py), gather
them all first, on the critical path, and run one causal attention of the rank's queries over all s
keys. The paper's reasons: any mask is easy (the rank sees every key), and with grouped-query
attention K and V are small next to Q, so the exposed all-gather is small against the O(s^2) attention.
The token layout (zigzag, for the causal load balance) is context.py's.

Backward is the all-gather's own: the gradients of the gathered K, V are summed over the ranks and
each keeps its block's, one reduce-scatter. Blocks may differ by a token: each is padded to the
longest for the collectives and trimmed after.

Per rank and layer (N ranks, b batch, h_kv = kv heads x head size, e bytes per value, blocks of
ceil(s/N) tokens):
    forward   one all-gather of the K, V blocks:  (N-1) * 2 b ceil(s/N) h_kv e sent
    backward  one reduce-scatter of dK, dV:       the same
    memory    the gathered K, V of all s tokens, kept for backward: N times ring attention's
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlib.comm import ops
from shardlib.parallel.context import LayoutCollective, SequenceLayout

__all__ = ["allgather_attention", "allgather_sent_bytes"]


def allgather_sent_bytes(batch: int, seq_len: int, kv_hidden: int, world_size: int, *,
                                  element_size: int = 4, zigzag: bool = True) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per layer: (N-1) padded K, V blocks each way."""
    layout = SequenceLayout(seq_len, world_size, zigzag)
    longest = max(layout.length(r) for r in range(world_size))
    block = 2 * batch * longest * kv_hidden * element_size  # K and V of one rank's (padded) tokens
    return (world_size - 1) * block, (world_size - 1) * block


def _lengths(layout: SequenceLayout) -> list[int]:
    return [layout.length(r) for r in range(layout.world_size)]


def _gather(kv: torch.Tensor, layout: SequenceLayout, group) -> torch.Tensor:
    """(2, B, n_kv, s_r, d) this rank's K, V -> (2, B, n_kv, s, d) every rank's, in layout order."""
    lengths = _lengths(layout)
    longest = max(lengths)
    padded = F.pad(kv, (0, 0, 0, longest - kv.shape[3])).contiguous()  # (2, B, n_kv, longest, d)
    out = padded.new_empty(layout.world_size * padded.numel())
    ops.all_gather_into_tensor(out, padded.reshape(-1), group=group)
    blocks = out.view(layout.world_size, *padded.shape)  # (N, 2, B, n_kv, longest, d)
    return torch.cat([blocks[r, :, :, :, :n] for r, n in enumerate(lengths)], dim=3)


def _scatter_sum(grad: torch.Tensor, layout: SequenceLayout, group) -> torch.Tensor:
    """The inverse: (2, B, n_kv, s, d) in layout order, summed over the ranks -> (2, B, n_kv, s_r, d) mine."""
    lengths = _lengths(layout)
    longest = max(lengths)
    blocks = [F.pad(x, (0, 0, 0, longest - x.shape[3])) for x in grad.split(lengths, dim=3)]
    stacked = torch.stack(blocks).contiguous()  # (N, 2, B, n_kv, longest, d)
    out = stacked.new_empty(stacked[0].shape)
    ops.reduce_scatter_tensor(out.view(-1), stacked.view(-1), group=group)
    return out[:, :, :, :lengths[dist.get_rank(group)]]


def allgather_attention(q, k, v, layout: SequenceLayout, *, group):
    """Causal attention of this rank's queries on the gathered keys: one all-gather in, one reduce-scatter back.
    q: (B, nh, s_r, d), k, v: (B, n_kv, s_r, d) at layout.positions(rank) -> (B, nh, s_r, d)."""
    layout.check_group(group)
    order = layout.order().to(q.device)  # layout -> global
    kv = torch.stack([k, v])  # (2, B, n_kv, s_r, d)
    k_all, v_all = LayoutCollective.apply(kv, layout, group, _gather, _scatter_sum)  # (B, n_kv, s, d), layout order
    mine = layout.positions(dist.get_rank(group)).to(q.device)  # (s_r,)
    causal = mine[:, None] >= order[None, :]  # (s_r, s): a query sees the keys at or before its position
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=causal, enable_gqa=k.shape[1] != q.shape[1])
