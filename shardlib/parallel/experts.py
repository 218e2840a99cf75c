"""Mixture of experts and expert parallelism (lesson 12).

The MoE layer replaces a transformer block's MLP by E expert MLPs and a router (GShard, Lepikhin
et al., arXiv 2006.16668; Switch Transformer, Fedus, Zoph and Shazeer, arXiv 2101.03961):

- router: logits = x W_r (h -> E), probabilities p = softmax(logits); each token picks its top-k
  experts. Gates: k = 1, the chosen probability (Switch); k > 1, the k probabilities renormalised.
- capacity: each expert takes at most c = ceil(capacity_factor * s * k / E) tokens of a group
  (GShard splits the tokens into groups, each with its own capacity; here a group is one sequence
  of s tokens, so a batch split by whole sequences over ranks routes and drops exactly as on one
  device). Places are given first choices first, then second choices, each in token order (GShard,
  Algorithm 1); an assignment past capacity is dropped: its output is 0 and the token goes on
  through the residual connection alone.
- load-balancing loss (Switch, Section 2.2, eq. 4): E * sum_e f_e P_e per group, f_e the fraction
  of assignments routed to expert e (before dropping), P_e its mean router probability; averaged
  over groups and added to the loss with a coefficient (Switch: 1e-2). It is E * (1/E) = 1 when
  the load is uniform, and reaches E when one expert takes every token.

Experts work on a buffer of fixed shape (E, b c, h): every expert gets c places per sequence,
filled or not (GShard's dispatch tensor), so the shapes, the bytes and the memory depend on the
capacity factor, not on the routing.

Expert parallelism: N ranks, each holding E/N experts (and the router, attention and the rest
replicated, each rank with its own b sequences, as data parallelism). Per MoE layer:

    dispatch all-to-all   (E, b c, h) -> the (N, E/N, b c, h) places every rank filled for my experts
    experts               E/N expert MLPs on N b c places each
    combine all-to-all    the outputs back to the ranks their tokens came from

Per rank (Psi_e = one expert's parameters, Psi_rest = everything else, L_moe MoE layers, e bytes):
    parameters            Psi_rest + (E/N) Psi_e per MoE layer (dense model of equal compute: an
                          MLP k times wider, Psi_rest + k Psi_e per layer)
    expert buffers        E b c h values per MoE layer, 2 of them (dispatched and returned)
    communication         forward 2 all-to-alls per MoE layer, each sending (N-1)/N * E b c h e bytes;
                          backward 2 more of the same; gradients: Psi_rest all-reduced over every
                          rank, expert gradients over the ranks holding the same experts (EP x DP)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib.comm import ops

__all__ = ["Routing", "route", "expert_capacity", "load_balancing_loss", "dispatch", "combine", "expert_mlp", "swiglu",
           "MoE", "ExpertParallelMoE", "parallelize_gpt_experts", "sync_expert_parallel_grads",
           "gather_experts", "expert_parallel_sent_bytes", "moe_parameters_per_rank"]


# ---------------------------------------------------------------------------------
# routing


@dataclass
class Routing:
    """Where each token goes: tensors of shape (B, s, k), the k choices of each token."""

    experts: torch.Tensor  # expert index
    gates: torch.Tensor  # weight of that expert's output (differentiable: the router learns from it)
    slots: torch.Tensor  # place in the expert's buffer for the token's sequence, 0..c-1 when kept
    kept: torch.Tensor  # False: past capacity, dropped
    probs: torch.Tensor  # (B, s, E) router probabilities
    capacity: int  # c, places per expert per sequence


def expert_capacity(seq_len: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """c = ceil(capacity_factor * s * k / E) places per expert per sequence (at most s: an expert is
    chosen at most once per token)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    return max(1, min(seq_len, math.ceil(capacity_factor * seq_len * top_k / n_experts)))


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """logits: (B, s, E) -> the routing, with places given first choices first, each in token order."""
    B, s, E = logits.shape
    probs = logits.softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32)).to(logits.dtype)  # (B, s, E)
    top_probs, experts = probs.topk(top_k, dim=-1)  # (B, s, k)
    gates = top_probs if top_k == 1 else top_probs / top_probs.sum(-1, keepdim=True)
    capacity = expert_capacity(s, E, top_k, capacity_factor)
    choice_major = F.one_hot(experts, E).transpose(1, 2).reshape(B, top_k * s, E)  # (B, k s, E): 1st choices first
    place = (choice_major.cumsum(1) - 1) * choice_major  # (B, k s, E): arrival order at each expert
    slots = place.sum(-1).view(B, top_k, s).transpose(1, 2)  # (B, s, k)
    return Routing(experts, gates, slots, slots < capacity, probs, capacity)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch's auxiliary loss, E * sum_e f_e P_e per sequence, averaged over the sequences."""
    E = routing.probs.shape[-1]
    counts = F.one_hot(routing.experts, E).sum(dim=(1, 2)).to(routing.probs.dtype)  # (B, E)
    f = counts / counts.sum(-1, keepdim=True)  # (B, E): fraction of assignments, before dropping
    P = routing.probs.mean(dim=1)  # (B, E): mean router probability
    return E * (f * P).sum(-1).mean()


# ---------------------------------------------------------------------------------
# dispatch and combine: tokens into expert buffers and back


def _buffer_index(routing: Routing) -> torch.Tensor:
    """(B, s, k) row of each assignment in the flat (E * B * c) buffer: expert-major, then sequence, place."""
    B, c = routing.experts.shape[0], routing.capacity
    sequence = torch.arange(B, device=routing.experts.device).view(B, 1, 1)
    index = routing.experts * (B * c) + sequence * c + routing.slots
    return torch.where(routing.kept, index, 0)  # dropped: any valid row, weighted 0 in combine


class _IntoBuffer(torch.autograd.Function):
    """Token copies added into buffer rows by index; backward gathers each copy's gradient back from its row.
    Only the index is kept for backward (autograd's index_add keeps the copies too, (B s k, h) of them, though
    its gradient needs none of their values), as Megatron-Core's token permutation keeps its indices."""

    @staticmethod
    def forward(ctx, tokens, index, rows: int):  # (n, h), (n,) -> (rows, h)
        ctx.save_for_backward(index)
        return tokens.new_zeros(rows, tokens.shape[1]).index_add_(0, index, tokens)

    @staticmethod
    def backward(ctx, grad):  # (rows, h) -> (n, h)
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def dispatch(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Group tokens by expert: x (B, s, h) -> buffer (E, B c, h), zero where a place stays empty."""
    B, s, h = x.shape
    E, c = routing.probs.shape[-1], routing.capacity
    k = routing.experts.shape[-1]
    kept = routing.kept.reshape(-1)  # (B s k,)
    tokens = x.unsqueeze(2).expand(B, s, k, h).reshape(-1, h).masked_fill(~kept.unsqueeze(1), 0.0)  # (B s k, h)
    # a dropped assignment adds zeros (to row 0, its index): no shape depends on the routing, so meta tensors run
    buffer = _IntoBuffer.apply(tokens, _buffer_index(routing).reshape(-1), E * B * c)  # (E B c, h)
    return buffer.view(E, B * c, h)


def combine(buffer: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Restore token order: buffer (E, B c, h) -> (B, s, h), each token the gated sum of its kept choices."""
    B, s, k = routing.experts.shape
    h = buffer.shape[-1]
    picked = buffer.reshape(-1, h).index_select(0, _buffer_index(routing).reshape(-1)).view(B, s, k, h)
    weights = (routing.gates * routing.kept).unsqueeze(-1)  # (B, s, k, 1): 0 for dropped assignments
    return (picked * weights).sum(2)  # (B, s, h)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up for backward, silu recomputed there (Megatron-LM's fused
    SwiGLU does the same): 4 bytes per 16-bit hidden value where the separate ops keep 6."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        return grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig  # d silu(g)/dg = s (1 + g (1 - s))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated linear unit of Llama and Mixtral (Shazeer, arXiv 2002.05202): silu(gate) * up, (.., f) each."""
    return _SwiGLU.apply(gate, up)


def expert_mlp(buffer, w1, b1, w2, b2, w3=None) -> torch.Tensor:
    """Expert e's MLP on its rows: (E', n, h) -> GELU((E', n, h) @ (E', h, f)) @ (E', f, h) -> (E', n, h);
    with w3, gated as Mixtral's experts (arXiv 2401.04088, SwiGLU, no biases): swiglu(x w1, x w3) w2."""
    if w3 is None:
        return torch.baddbmm(b2.unsqueeze(1), F.gelu(torch.baddbmm(b1.unsqueeze(1), buffer, w1)), w2)
    return torch.bmm(swiglu(torch.bmm(buffer, w1), torch.bmm(buffer, w3)), w2)  # (E', n, f) -> (E', n, h)


# ---------------------------------------------------------------------------------
# the layer, on one device and split over ranks


EXPERT_WEIGHTS = ("w1", "b1", "w2", "b2", "w3")  # (E, ...) each; b1, b2 None when gated, w3 None when not


class MoE(nn.Module):
    """E expert MLPs (h -> f -> h, f = 4h by default; gated: SwiGLU without biases) behind a top-k router,
    with capacity."""

    def __init__(self, hidden: int, n_experts: int, top_k: int = 1, capacity_factor: float = 1.25,
                 ffn_hidden: int | None = None, init_std: float = 0.02, out_init_std: float = 0.02,
                 gated: bool = False):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        f = ffn_hidden or 4 * hidden
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, f) * init_std)  # (E, h, f)
        self.b1 = None if gated else nn.Parameter(torch.zeros(n_experts, f))
        self.w2 = nn.Parameter(torch.randn(n_experts, f, hidden) * out_init_std)  # (E, f, h)
        self.b2 = None if gated else nn.Parameter(torch.zeros(n_experts, hidden))
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, f) * init_std) if gated else None  # (E, h, f): "up"
        nn.init.normal_(self.router.weight, std=init_std)
        self.aux_loss, self.routing = None, None  # of the last forward

    def route(self, x: torch.Tensor) -> Routing:
        self.routing = route(self.router(x), self.top_k, self.capacity_factor)  # x: (B, s, h)
        self.aux_loss = load_balancing_loss(self.routing)
        return self.routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, s, h)
        routing = self.route(x)
        buffer = dispatch(x, routing)  # (E, B c, h)
        return combine(expert_mlp(buffer, self.w1, self.b1, self.w2, self.b2, self.w3), routing)  # (B, s, h)


class _AllToAll(torch.autograd.Function):
    """Equal chunks of dim 0 to each rank of the group; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        ops.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.forward(ctx, grad, ctx.group), None


class ExpertParallelMoE(MoE):
    """Experts [r E/N, (r+1) E/N) of a MoE on rank r of `group`; the router replicated.
    Every rank of the group must pass the same number of sequences."""

    @classmethod
    def from_moe(cls, moe: MoE, *, group) -> "ExpertParallelMoE":
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        if moe.n_experts % n:
            raise ValueError(f"n_experts={moe.n_experts} is not divisible by the expert-parallel size {n}: "
                             f"use a size in {[d for d in range(1, moe.n_experts + 1) if moe.n_experts % d == 0]}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.n_experts, layer.top_k, layer.capacity_factor = moe.n_experts, moe.top_k, moe.capacity_factor
        layer.group, layer.aux_loss, layer.routing = group, None, None
        layer.router = copy.deepcopy(moe.router)  # (h -> E), replicated
        mine = slice(rank * moe.n_experts // n, (rank + 1) * moe.n_experts // n)
        for name in EXPERT_WEIGHTS:
            full = getattr(moe, name)
            setattr(layer, name, None if full is None else nn.Parameter(full.detach()[mine].clone()))  # (E/N, ...)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, s, h), this rank's sequences
        n, local = dist.get_world_size(self.group), self.w1.shape[0]
        routing = self.route(x)
        buffer = dispatch(x, routing)  # (E, B c, h): chunk j = the places for rank j's experts
        places, h = buffer.shape[1], buffer.shape[2]
        received = _AllToAll.apply(buffer, self.group)  # (N E/N, B c, h): from each rank, its places
        mine = received.view(n, local, places, h).transpose(0, 1).reshape(local, n * places, h)  # (E/N, N B c, h)
        out = expert_mlp(mine, self.w1, self.b1, self.w2, self.b2, self.w3)  # (E/N, N B c, h)
        out = out.view(local, n, places, h).transpose(0, 1).reshape(n * local, places, h)  # by source rank
        returned = _AllToAll.apply(out, self.group)  # (E, B c, h): my tokens' outputs, from every expert
        return combine(returned, routing)  # (B, s, h)


def parallelize_gpt_experts(gpt: nn.Module, *, group) -> nn.Module:
    """The course GPT with every MoE layer's experts split over `group` (in place; returns it)."""
    for block in gpt.blocks:
        if type(block.mlp) is MoE:  # not already split
            block.mlp = ExpertParallelMoE.from_moe(block.mlp, group=group)
    return gpt


def _is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def sync_expert_parallel_grads(model: nn.Module, *, group, data_group=None) -> None:
    """Average gradients as one device's mean loss over every rank's sequences would give them.

    group: every rank that trains this model on its own data (EP x DP; all replicated weights are
    summed over it); data_group: the ranks holding the same experts (None: no data parallelism).
    The expert gradients already hold the sum over the expert-parallel group (the combine
    all-to-all's backward brought them), so they are summed over data_group only."""
    world = dist.get_world_size(group)
    for experts, summed_over in ((False, group), (True, data_group)):
        grads = [p.grad for name, p in model.named_parameters() if p.grad is not None and _is_expert(name) == experts]
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        if not (experts and data_group is None) and dist.get_world_size(summed_over) > 1:
            ops.all_reduce(flat, group=summed_over)
        flat /= world
        for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(mean.view_as(g))


def gather_experts(state: dict[str, torch.Tensor], *, group) -> dict[str, torch.Tensor]:
    """{name: tensor} of an expert-parallel model (its state_dict, or its gradients by name) with every
    expert: the experts' slices all-gathered over `group`, (E/N, ...) -> (E, ...); the rest as it is."""
    full = {}
    for name, tensor in state.items():
        if _is_expert(name) and dist.get_world_size(group) > 1:
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            ops.all_gather(parts, tensor.contiguous(), group=group)
            tensor = torch.cat(parts)  # (E, ...)
        full[name] = tensor
    return full


# ---------------------------------------------------------------------------------
# the formulas (for the planner and the lesson)


def expert_parallel_sent_bytes(batch: int, seq_len: int, hidden: int, n_experts: int, top_k: int,
                               capacity_factor: float, world_size: int, *, element_size: int = 4) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per MoE layer, batch = its own sequences:
    2 all-to-alls each way of the (E, b c, h) buffer, each sending (N-1)/N of it."""
    c = expert_capacity(seq_len, n_experts, top_k, capacity_factor)
    one = n_experts * batch * c * hidden * element_size * (world_size - 1) // world_size
    return 2 * one, 2 * one


def moe_parameters_per_rank(hidden: int, n_experts: int, world_size: int, ffn_hidden: int | None = None) -> dict:
    """Parameters of one MoE layer's MLP part on one rank: the router (replicated) and E/N experts."""
    f = ffn_hidden or 4 * hidden
    expert = 2 * hidden * f + f + hidden  # w1, b1, w2, b2
    return {"router": hidden * n_experts, "experts": n_experts // world_size * expert, "per_expert": expert}
