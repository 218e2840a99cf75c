"""Context parallelism: the sequence split over N ranks; ring attention, Ulysses, all-gather (lesson 11).

Every per-token operation of a transformer (embeddings, LayerNorm, the MLP, the loss) needs only its
own token, so N ranks can each hold s/N of the sequence. Attention is the one place where tokens
meet; two ways to run it on a split sequence:

- ring attention (Liu, Zaharia and Abbeel, arXiv 2310.01889; shardlib/parallel/ring_attention.py):
  each rank keeps its query block; the key/value blocks travel around the ring, one hop per step,
  and each rank merges the partial softmax of every block with the online-softmax rescaling. The
  sends of step i overlap the compute of step i.
- Ulysses (Jacobs et al., DeepSpeed-Ulysses, arXiv 2309.14509; shardlib/parallel/ulysses.py): an
  all-to-all turns q, k, v from (s/N tokens, all heads) into (all s tokens, heads/N); attention runs
  on whole sequences of a rank's heads; a fourth all-to-all turns the output back. Needs heads
  divisible by N.
- all-gather (Llama 3, arXiv 2407.21783, Section 3.3.2; shardlib/parallel/allgather_attention.py):
  every rank gathers all the K, V blocks, on the critical path, and attends with its own queries;
  the gradients of K, V are reduce-scattered back. Small with grouped-query attention's few kv heads.

This file: which tokens a rank holds (SequenceLayout) and the costs as formulas. The course GPT on a
split sequence: shardlib/parallel/context_gpt.py.

Causal load balance: with a contiguous split the last rank's queries see every key and the first
rank's see only their own. The zigzag split cuts the sequence into 2N chunks and gives rank i
chunks i and 2N-1-i (Llama 3, arXiv 2407.21783, Section 3.3.2), so every rank computes the same
number of scores. Chunks may differ by one token: any s >= 2N works (s >= N without zigzag).

Per rank (N ranks, b batch, s sequence, h hidden, h_kv = kv heads * head size, e bytes per value):
    weights, gradients, optimizer state: all Psi, replicated (gradients all-reduced over the N
        ranks once per step, as data parallelism does: 2(N-1)/N Psi elements)
    activations: every per-token tensor holds s/N tokens, so 1/N of one device's; attention keeps
        only (out, logsumexp) for backward, never the scores (ring: one chunk pair of scores live)
    ring, per layer:   forward  (N-1) K,V blocks          = (N-1)/N * 2 b s h_kv e sent
                       backward (N-1) K,V + N dK,dV blocks = (2N-1)/N * 2 b s h_kv e sent
    Ulysses, per layer: forward 4 all-to-alls (q, k, v, out), each sending (N-1)/N of the local
                       activation b (s/N) h (k and v: h_kv); backward the same 4 reversed
    all-gather, per layer: forward one all-gather of K,V  = (N-1)/N * 2 b s h_kv e sent (even blocks)
                       backward one reduce-scatter of dK,dV, the same; the gathered K,V kept (N x ring's)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["SequenceLayout", "check_context_parallel", "METHODS", "ring_attention_sent_bytes", "ulysses_sent_bytes",
           "context_parallel_activation_bytes_per_layer"]

METHODS = ("ring", "ulysses", "allgather")


# ---------------------------------------------------------------------------------
# which tokens a rank holds


@dataclass(frozen=True)
class SequenceLayout:
    """Positions 0..seq_len-1 split over world_size ranks: contiguous, or zigzag (2N chunks, rank i
    holding chunks i and 2N-1-i). Chunks follow torch.tensor_split: the first seq_len % chunks are one longer."""

    seq_len: int
    world_size: int
    zigzag: bool = True

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.seq_len < self.n_chunks:
            raise ValueError(f"a sequence of {self.seq_len} tokens cannot give each of {self.n_chunks} chunks a token "
                             f"({'zigzag: 2N' if self.zigzag else 'N'} chunks for N={self.world_size}): "
                             f"use seq_len >= {self.n_chunks}, fewer ranks, or zigzag=False")

    @property
    def n_chunks(self) -> int:
        return 2 * self.world_size if self.zigzag else self.world_size

    def chunks(self, rank: int) -> list[tuple[int, int]]:
        """[(start, end)] of the global positions rank holds, in the order it holds them."""
        base, extra = divmod(self.seq_len, self.n_chunks)
        starts = [i * base + min(i, extra) for i in range(self.n_chunks + 1)]
        mine = [rank, 2 * self.world_size - 1 - rank] if self.zigzag else [rank]
        return [(starts[i], starts[i + 1]) for i in mine]

    def positions(self, rank: int) -> torch.Tensor:
        return torch.cat([torch.arange(a, b) for a, b in self.chunks(rank)])  # (s_r,)

    def length(self, rank: int) -> int:
        return sum(b - a for a, b in self.chunks(rank))

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank's tokens of x along `dim`: (B, s, ...) -> (B, s_r, ...)."""
        return x.index_select(dim, self.positions(rank).to(x.device))

    def order(self) -> torch.Tensor:
        """The global position of each token when the ranks' blocks are stacked in rank order: (s,)."""
        return torch.cat([self.positions(r) for r in range(self.world_size)])

    def check_group(self, group) -> None:
        """A ValueError unless `group` has the layout's world_size ranks."""
        if dist.get_world_size(group) != self.world_size:
            raise ValueError(f"layout for {self.world_size} ranks used on a group of {dist.get_world_size(group)}")


class LayoutCollective(torch.autograd.Function):
    """A collective over a sequence layout whose backward is another one: forward `there(x, layout,
    group)`, backward `back(grad, layout, group)` (an all-to-all and its inverse, an all-gather and
    its reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, layout: SequenceLayout, group, there, back):
        ctx.layout, ctx.group, ctx.back = layout, group, back
        return there(x, layout, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.layout, ctx.group), None, None, None, None


def check_context_parallel(seq_len: int, world_size: int, method: str, n_head: int, n_kv_head: int | None = None,
                           zigzag: bool = True) -> SequenceLayout:
    """The layout for these sizes, or a ValueError saying what to change (call it before launching)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for what, heads in (("n_head", n_head), ("n_kv_head", n_kv_head or n_head)):
        if method == "ulysses" and heads % world_size:
            raise ValueError(f"Ulysses gives each rank {what}/N whole heads: {what}={heads} is not divisible by "
                             f"N={world_size}; use N in {[d for d in range(1, heads + 1) if heads % d == 0]} "
                             "or method='ring', which splits no heads")
    return SequenceLayout(seq_len, world_size, zigzag)


# ---------------------------------------------------------------------------------
# the formulas (for the planner and the lesson)


def ring_attention_sent_bytes(batch: int, seq_len: int, kv_hidden: int, world_size: int, *, element_size: int = 4,
                              rank: int = 0, zigzag: bool = True) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per layer. Forward: every K,V block but the next rank's
    ((N-1)/N * 2 b s h_kv e for even blocks); backward: those again, plus one hop of each dK,dV block."""
    layout = SequenceLayout(seq_len, world_size, zigzag)
    if world_size == 1:
        return 0, 0
    per_token = 2 * batch * kv_hidden * element_size  # K and V of one token
    forward = per_token * (seq_len - layout.length((rank + 1) % world_size))
    return forward, forward + per_token * seq_len


def ulysses_sent_bytes(batch: int, seq_len: int, hidden: int, kv_hidden: int, world_size: int, *,
                       element_size: int = 4, rank: int = 0, zigzag: bool = True) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per layer. Into head groups, a tensor of width w sends
    (N-1)/N of its b s_r w; out of them, the other ranks' s - s_r tokens of w/N. Forward: q, k, v in
    (widths h, h_kv, h_kv), the output out (h); backward: the output's gradient in, dq, dk, dv out.
    For equal blocks both are 4 all-to-alls of (N-1)/N * b (s/N) h each when h_kv = h."""
    layout = SequenceLayout(seq_len, world_size, zigzag)
    n, s_r = world_size, layout.length(rank)

    def into_heads(width):
        return batch * s_r * width * (n - 1) // n

    def out_of_heads(width):
        return batch * (width // n) * (seq_len - s_r)

    forward = sum(into_heads(w) for w in (hidden, kv_hidden, kv_hidden)) + out_of_heads(hidden)
    backward = into_heads(hidden) + sum(out_of_heads(w) for w in (hidden, kv_hidden, kv_hidden))
    return forward * element_size, backward * element_size


def context_parallel_activation_bytes_per_layer(seq_len: int, batch: int, hidden: int, world_size: int) -> float:
    """Bytes one rank keeps for backward per layer, 16-bit, attention without stored scores (as ring
    attention and Ulysses' flash kernels run): 34 s b h / N (Korthikanti et al., arXiv 2205.05198,
    Section 4.1, without the 5 a s^2 b of the scores)."""
    return 34 * seq_len * batch * hidden / world_size
