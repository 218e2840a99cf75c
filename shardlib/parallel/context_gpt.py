"""The course GPT on a sequence split over N ranks: context parallelism end to end (lesson 11).

Every per-token operation (embeddings, LayerNorm, the MLP, the output head, the loss) runs on the
rank's own s/N tokens; attention runs as ring attention (shardlib/parallel/ring_attention.py),
Ulysses (shardlib/parallel/ulysses.py) or all-gather (shardlib/parallel/allgather_attention.py).
The weights are replicated and each rank's gradients cover its tokens only, so they are summed
over the group once per step (one all-reduce of Psi values, as data parallelism does). Costs:
shardlib/parallel/context.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlib.comm import ops
from shardlib.parallel.allgather_attention import allgather_attention
from shardlib.parallel.context import METHODS, SequenceLayout, check_context_parallel
from shardlib.parallel.ring_attention import ring_attention
from shardlib.parallel.ulysses import ulysses_attention

__all__ = ["context_parallel_attention", "context_parallel_loss", "sync_context_parallel_grads"]


def context_parallel_attention(attn, x, layout: SequenceLayout, *, group, method: str = "ring",
                               overlap: bool = True):
    """The course GPT's CausalSelfAttention `attn` (its own q/k/v/o weights) on this rank's tokens.
    x: (B, s_r, C) at layout.positions(rank) -> (B, s_r, C)."""
    B, s_r, _ = x.shape
    d = attn.head_dim
    q = attn.q_proj(x).view(B, s_r, -1, d).transpose(1, 2)  # (B, nh, s_r, d)
    k = attn.k_proj(x).view(B, s_r, -1, d).transpose(1, 2)  # (B, n_kv, s_r, d)
    v = attn.v_proj(x).view(B, s_r, -1, d).transpose(1, 2)  # (B, n_kv, s_r, d)
    if method == "ring":
        y = ring_attention(q, k, v, layout, group=group, overlap=overlap)
    elif method == "ulysses":
        y = ulysses_attention(q, k, v, layout, group=group)
    elif method == "allgather":
        y = allgather_attention(q, k, v, layout, group=group)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return attn.o_proj(y.transpose(1, 2).reshape(B, s_r, -1))  # (B, s_r, C)


def context_parallel_loss(gpt, batch, *, group, method: str = "ring", zigzag: bool = True) -> torch.Tensor:
    """This rank's share of the course GPT's mean cross-entropy on `batch` (the whole (B, s) batch,
    the same on every rank): the sum of its tokens' losses / (B s). The shares of the N ranks add up
    to the single-device loss; gradients are summed by sync_context_parallel_grads."""
    inputs, targets = batch  # (B, s) each
    if gpt.training and gpt.config.dropout > 0:
        raise ValueError("context-parallel attention here has no dropout: use a GPTConfig with dropout=0.0")
    layout = check_context_parallel(inputs.shape[1], dist.get_world_size(group), method, gpt.config.n_head,
                                    gpt.config.kv_heads, zigzag)
    me = dist.get_rank(group)
    positions = layout.positions(me).to(inputs.device)  # (s_r,)
    x = gpt.tok_emb(layout.shard(inputs, me)) + gpt.pos_emb(positions)  # (B, s_r, C)
    for block in gpt.blocks:  # Block.forward, with the attention on a split sequence
        x = x + context_parallel_attention(block.attn, block.ln_1(x), layout, group=group, method=method)
        x = x + block.mlp(block.ln_2(x))
    logits = gpt.lm_head(gpt.ln_f(x))  # (B, s_r, V)
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), layout.shard(targets, me).reshape(-1),
                             reduction="sum")
    return losses / targets.numel()


def sync_context_parallel_grads(model, *, group) -> None:
    """Sum every gradient over the group (each rank's covers its tokens): one all-reduce of Psi values."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if dist.get_world_size(group) == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # (Psi,)
    ops.all_reduce(flat, group=group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))
