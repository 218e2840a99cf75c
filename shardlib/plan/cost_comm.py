"""The communication of one pipeline stage: every collective one GPU takes part in per step (group, kind,
bytes of the tensor, calls), the bytes it sends, and the seconds each group adds to the step after what
overlap hides (shardlib/plan/links.py). The formulas are in shardlib/plan/cost.py's docstring; this file
lists the collectives once, so that the bytes the planner reports and the calls it times are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardlib.plan.compute import vocab_rows
from shardlib.plan.links import Ring, exposed, in_node, link_bandwidth


@dataclass
class Collective:
    """One kind of collective of one group: `calls` per step on tensors of `nbytes` (columns)."""

    group: str  # "tp", "cp", "ep", "dp", "pp"
    kind: str  # "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"
    nbytes: torch.Tensor
    calls: torch.Tensor
    ring: Ring | None = None  # None for point-to-point sends

    @property
    def sent(self):
        per_call = self.nbytes if self.ring is None else self.ring.sent(self.kind, self.nbytes)
        return self.calls * per_call


@dataclass
class StageComm:
    """Per micro-batch exposed seconds (tp, cp, ep), per step (pp, dp), and every collective of the step."""

    tp: torch.Tensor
    cp: torch.Tensor
    ep: torch.Tensor
    pp: torch.Tensor
    dp: torch.Tensor
    collectives: list = field(default_factory=list)

    def sent(self, group: str):
        return sum((x.sent for x in self.collectives if x.group == group), torch.zeros_like(self.tp))

    tp_sent = property(lambda self: self.sent("tp"))
    cp_sent = property(lambda self: self.sent("cp"))
    ep_sent = property(lambda self: self.sent("ep"))
    pp_sent = property(lambda self: self.sent("pp"))
    dp_sent = property(lambda self: self.sent("dp"))


def stage_communication(spec, cluster, c, m, first, last, layers, one, recipe, dp_overlap, link: tuple,
                        scatter_gather: bool, psi_dense, psi_expert, forward_s, backward_s,
                        async_tp_backward: bool = True, head_wgrad=0.0) -> StageComm:
    """Collectives and exposed seconds of stage k's GPUs; `one`: compute.layer_seconds of one layer; dp_overlap: a
    column, whether each layout's data-parallel traffic overlaps compute; link: the fractions of the links'
    bandwidth collectives reach (inside a node, across); scatter_gather: pipeline messages split over the
    tensor-parallel ranks and gathered by the receivers (else each rank sends all of it); async_tp_backward: each
    column-parallel layer's input-gradient all-reduce (reduce-scatter with sequence parallelism) runs beside its
    weight-gradient product (else on the critical path); head_wgrad: the output layer's weight-gradient seconds."""
    d, t, p, cp, ep, v = c.dp, c.tp, c.pp, c.cp, c.ep, c.virtual
    e, eg = recipe.params, recipe.grads
    alpha = cluster.alpha_us * 1e-6
    ring = lambda n, span, nics=1: Ring(n, link_bandwidth(cluster, span, link, nics), alpha)  # noqa: E731
    # tensor, context and expert groups cross nodes on each GPU's own link: ring attention's sends and the
    # all-to-alls go GPU to GPU, and Megatron-LM found tensor parallelism best within a node "due to its expensive
    # all-reduce communication" (arXiv 2104.04473, 5.4.1), so it is not credited with the node's other NICs
    tp_ring, cp_ring, ep_ring = ring(t, t), ring(cp, t * cp), ring(ep, t * cp * ep)
    # the data-parallel groups: their g / t GPUs in each node carry a ring each over the node's NICs (links.py)
    per_node = lambda stride: torch.clamp(torch.floor(cluster.gpus_per_node / stride), min=1.0)  # noqa: E731
    dp_ring, expert_ring = ring(d * cp, t * cp * d, per_node(t)), ring(d * cp / ep, t * cp * d, per_node(t * ep))
    tokens = c.micro_batch * spec.seq_len / cp
    full = (c.recompute == 2).double()
    out = []

    # -- tensor parallelism: per micro-batch ---------------------------------------------------
    bsh = tokens * spec.hidden * e
    per_pass = layers * 2  # all-reduces (or all-gather + reduce-scatter pairs) per pass over the stage
    tp_calls = layers * (4 + 2 * full) + first + last
    out.append(Collective("tp", "all_reduce", bsh, m * tp_calls * (1 - c.sp), tp_ring))
    for kind in ("all_gather", "reduce_scatter"):  # sequence parallelism: each all-reduce is one of each
        out.append(Collective("tp", kind, bsh, m * tp_calls * c.sp, tp_ring))
    out.append(Collective("tp", "all_reduce", tokens * 4.0, m * 3 * last, tp_ring))  # the loss, fp32
    replicated = spec.stage_params(first, last, layers)[1] * eg
    out.append(Collective("tp", "all_reduce", replicated, c.sp, tp_ring))  # SP: replicated weights' gradients
    # SP keeps each column layer's input as its sequence shard and all-gathers it again in backward, beside the
    # data-gradient product (Megatron-LM; shardlib/parallel/sequence.py): 2 per layer, 1 for the output head
    regathers = c.sp * (2 * layers + last)
    out.append(Collective("tp", "all_gather", bsh, m * regathers, tp_ring))
    regather_s = exposed(regathers * tp_ring.time("all_gather", bsh), layers * one["gemm_bwd"] / 2)
    tp_pass = per_pass * tp_ring.time("all_reduce", bsh)
    # the backward's collectives at the column layers' inputs, each beside its layer's dW (async_tp_backward)
    hidden = _hidden_input_gradients(c, tp_ring, bsh, one["wgrad_columns"], async_tp_backward)
    head_hidden = _hidden_input_gradients(c, tp_ring, bsh, [head_wgrad], async_tp_backward)  # the output layer's
    tp_ends = ((first + last) * tp_ring.time("all_reduce", bsh) - last * head_hidden
               + last * 3 * tp_ring.time("all_reduce", tokens * 4.0))
    overlapped = c.tp_overlap > 0
    fwd_hidden = exposed(tp_pass, layers * one["gemm_fwd"])
    bwd_hidden = exposed(tp_pass, layers * one["gemm_bwd"])
    tp_s = torch.where(overlapped, fwd_hidden * (1 + full) + bwd_hidden, tp_pass * (2 + full) - layers * hidden)
    tp_s = tp_s + tp_ends + regather_s + c.sp * tp_ring.time("all_reduce", replicated) / m  # that last once a step
    tp_busy = torch.where(overlapped, tp_pass - fwd_hidden, 0.0)  # NVLink time hidden behind each pass
    async_busy = torch.where(overlapped, 0.0, layers * hidden)  # ... and behind the backward's weight gradients

    # -- context parallelism ---------------------------------------------------------------------
    kv = tokens * 2 * spec.hidden * spec.kv_heads / spec.n_head / t * e  # this rank's K and V block
    ring, ulysses, gathered = c.cp_method == 0, c.cp_method == 1, c.cp_method == 2  # inputs.CP_METHODS
    forward_blocks, backward_blocks = cp - 1, (cp - 1) + cp * (cp > 1)
    block_s = alpha + kv / cp_ring.bandwidth
    ring_fwd = layers * forward_blocks * block_s
    ring_bwd = layers * backward_blocks * block_s
    ring_s = (exposed(ring_fwd, layers * one["attn_fwd"]) * (1 + full)
              + exposed(ring_bwd, layers * one["attn_bwd"]))
    ring_busy = torch.where(ring, torch.minimum(ring_fwd, layers * one["attn_fwd"]), 0.0)
    a2a = tokens * (2 * spec.hidden + 2 * spec.hidden * spec.kv_heads / spec.n_head) / t * e / 4
    a2a_calls = layers * 4 * (2 + full)  # 4 all-to-alls per pass, a quarter of q, k, v, out each on average
    out.append(Collective("cp", "send", kv, torch.where(ring, m * layers * (
        forward_blocks * (1 + full) + backward_blocks), 0.0)))
    out.append(Collective("cp", "all_to_all", a2a, torch.where(ulysses, m * a2a_calls, 0.0), cp_ring))
    # all-gather (Llama 3's, arXiv 2407.21783, Sec. 3.3.2; shardlib/parallel/allgather_attention.py): every rank's
    # K, V block gathered before attention, dK, dV reduce-scattered after its backward, both on the critical path
    gather_calls = layers * (1 + full)
    out.append(Collective("cp", "all_gather", kv * cp, torch.where(gathered, m * gather_calls, 0.0), cp_ring))
    out.append(Collective("cp", "reduce_scatter", kv * cp, torch.where(gathered, m * layers, 0.0), cp_ring))
    gather_s = gather_calls * cp_ring.time("all_gather", kv * cp) + layers * cp_ring.time("reduce_scatter", kv * cp)
    cp_s = torch.where(ulysses, a2a_calls * cp_ring.time("all_to_all", a2a), torch.where(gathered, gather_s, ring_s))

    # -- expert parallelism ------------------------------------------------------------------------
    places = spec.n_experts * torch.ceil(spec.capacity_factor * spec.top_k * (spec.seq_len / cp)
                                         / max(spec.n_experts, 1))
    routed = c.micro_batch * places * spec.hidden * e / torch.where(c.sp > 0, t, 1.0)  # (E, b capacity, h)
    ep_calls = layers * (4 + 2 * full) * float(spec.moe)
    out.append(Collective("ep", "all_to_all", routed, m * ep_calls, ep_ring))
    ep_s = ep_calls * ep_ring.time("all_to_all", routed)

    # -- pipeline: scatter/gather of the boundary activation ---------------------------------------
    split = (c.sp > 0) | scatter_gather  # sequence parallelism holds the activation split already
    boundary = tokens * spec.hidden * e / torch.where(split, t, 1.0)  # each tensor-parallel rank sends its 1/t
    sends = (p > 1) * m * (2 * v - first - last)  # as many received: activations forward, gradients backward
    out.append(Collective("pp", "send", boundary, sends))
    gathered = (1 - c.sp) * (t > 1) * float(scatter_gather)  # the receivers all-gather what was scattered
    out.append(Collective("tp", "all_gather", bsh, sends * gathered, tp_ring))
    gather = gathered * tp_ring.time("all_gather", tokens * spec.hidden * e)
    pp_link = link_bandwidth(cluster, t * cp * d * p, link)
    pp_s = (p > 1) * 2 * (m * v + p - 2) * (alpha + boundary / pp_link + gather)
    # tied embeddings on two stages: their gradients all-reduced between the first and the last once a step, after
    # the pipeline drains (Megatron-LM's embedding group)
    tied = float(spec.tied_embeddings) * (p > 1) * torch.maximum(first, last)
    embedding = vocab_rows(spec, t) * spec.hidden * eg
    embedding_ring = Ring(2 * torch.ones_like(p), pp_link, alpha)
    out.append(Collective("pp", "all_reduce", embedding, tied, embedding_ring))
    pp_s = pp_s + tied * embedding_ring.time("all_reduce", embedding)

    # -- data parallelism: per step -----------------------------------------------------------------
    busy = torch.where(in_node(cluster, t * cp * d), tp_busy + torch.where(in_node(cluster, t * cp), ring_busy, 0.0),
                       torch.where(in_node(cluster, t * cp), 0.0, ring_busy))
    busy_bwd = busy + torch.where(in_node(cluster, t * cp * d), async_busy, 0.0)
    windows = (torch.clamp(forward_s - busy, min=0.0), torch.clamp(backward_s - busy_bwd, min=0.0))
    dense_s, dense = _data_parallel(c, m, layers, psi_dense * e, psi_dense * eg, dp_ring, windows, dp_overlap)
    expert_s, experts = _data_parallel(c, m, layers, psi_expert * e, psi_expert * eg, expert_ring, windows,
                                       dp_overlap)
    out += dense + experts
    return StageComm(tp_s, cp_s, ep_s, pp_s, dense_s + expert_s, out)


def _hidden_input_gradients(c, ring: Ring, bsh, wgrads, on: bool):
    """Seconds of the input-gradient collectives of column-parallel layers (all-reduces, reduce-scatters with
    sequence parallelism) that hide, one per layer, behind that layer's weight-gradient product of `wgrads` seconds,
    by the overlap rule, when `on` (else none): Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication, on by
    default since 2021-09-07 (merge b462d2545d, "--no-async-tensor-model-parallel-allreduce"), which its
    parallel_lm_logits runs for the output layer too. A layer without a product in `wgrads` (an MoE layer's experts)
    hides nothing; sequence parallelism's other backward collective, the all-gather of each row-parallel layer's
    output gradient, stays on the critical path."""
    if not on:
        return torch.zeros_like(c.sp)
    column = torch.where(c.sp > 0, ring.time("reduce_scatter", bsh), ring.time("all_reduce", bsh))
    return sum(column - exposed(column, wgrad) for wgrad in wgrads)


def _data_parallel(c, m, layers, param_bytes, grad_bytes, ring: Ring, windows, overlap):
    """Exposed seconds and collectives of one step's data-parallel traffic (ZeRO stage c.zero)."""
    z = c.zero
    forward, backward = windows
    units = torch.where(z >= 2, layers + 1, 1.0)  # ZeRO-2 and -3 (FSDP) gather and reduce layer by layer
    reductions = torch.where(z == 1, 1.0, m)  # ZeRO-1 reduce-scatters once a step, ZeRO-2 and -3 every micro-batch
    all_reduce = ring.time("all_reduce", grad_bytes)
    rs_units = units * ring.time("reduce_scatter", grad_bytes / units)  # with the alphas of layer by layer
    ag_units = units * ring.time("all_gather", param_bytes / units)
    hide = lambda x, under: torch.where(overlap, exposed(x, under), x)  # noqa: E731 - overlap: a column
    seconds = torch.where(z == 0, hide(all_reduce, backward),
              torch.where(z <= 2, reductions * hide(rs_units, backward) + hide(ag_units, forward),
                          m * (hide(ag_units, forward) + hide(ag_units + rs_units, backward))))
    zero = torch.zeros_like(m * z)
    gathers = torch.where(z == 3, 2 * m, 1.0) * units  # ZeRO-3 gathers again in every backward
    collectives = [
        Collective("dp", "all_reduce", grad_bytes, torch.where(z == 0, 1.0 + zero, zero), ring),
        Collective("dp", "all_gather", param_bytes / units, torch.where(z >= 1, gathers + zero, zero), ring),
        Collective("dp", "reduce_scatter", grad_bytes / units, torch.where(z >= 1, reductions * units + zero, zero),
                   ring),
    ]
    return seconds, collectives
