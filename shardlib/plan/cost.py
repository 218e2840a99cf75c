"""The planner's cost model: memory, bytes sent and seconds per step of a layout, on each GPU.

Notation (the course's): Psi parameters, L layers, h hidden size, a heads, V vocabulary, s sequence
length, B global batch (sequences), b micro-batch, m = B / (d b) micro-batches per step, d data-,
c context-, t tensor-, e expert-parallel sizes, p pipeline stages of v chunks each, N = d c t p.
Each function takes columns of layouts (float64 tensors, one row per layout) and returns named
dataclasses of such columns: the whole search is evaluated at once. Numbers stay floats throughout
(a 10T-parameter model's FLOPs, ~1e26, are past any integer tensor).

Stages. Stage k holds floor(L/p) or ceil(L/p) layers (the extra ones on the middle stages, as
BLOOM and Llama 3 balance the embedding and the output layer), the embedding on stage 0, the
output layer on stage p-1.

Memory of a GPU of stage k:
  model states  Psi_k = Psi_split/t + Psi_replicated (+ its E/e experts; the embedding and output layer
                of ceil(V/t) rows each, the vocabulary padded to a multiple of t), under ZeRO stage z over the
                d c GPUs holding the same parameters (d c / e for experts): 16 Psi_k, 4 Psi_k + 12 Psi_k/dc,
                2 Psi_k + 14 Psi_k/dc, 16 Psi_k/dc bytes with mixed-precision Adam (ZeRO, arXiv 1910.02054,
                Fig. 1). Offload keeps the optimizer's 12 Psi_k(/dc) bytes in CPU memory (arXiv 2101.06840).
  activations   per layer and micro-batch, 16-bit (Korthikanti et al., arXiv 2205.05198, Sec. 4):
                s b h (34 + 5 a s/h) at t = 1: 10 s b h outside the tensor-parallel regions (divided by
                t with sequence parallelism), 24 s b h + 5 a s^2 b inside (divided by t); with context
                parallelism all of it / c. Term by term: outside, the 2 LayerNorms' inputs 4, the q/k/v
                and MLP inputs 2 + 2, the 2 dropout masks 1 + 1; inside, q, k, v and the output
                projection's input 8, the MLP's GeLU input and output 2 s b f each (16 at f = 4h); gated
                (SwiGLU, fused as Megatron-LM's kernel and shardlib.models.swiglu: silu recomputed in
                backward) gate and up 4 s b f and their product 2 s b f; the scores' softmax 2 a s^2 b, its
                dropout mask and output 3 a s^2 b.
                Without dropout (Llama) the masks and the dropout output are not kept. A MoE layer
                (shardlib/parallel/experts.py) keeps per token choice its dispatched copy and its
                combined output (2 + 2 s b h) and per expert place (top_k x capacity factor per token)
                the expert's input 2 s b h and its MLP. Selective recomputation drops the scores, full
                recomputation keeps 2 s b h (the layer input), and holds, during backward, all the
                activations of the one layer it recomputes. FlashAttention (arXiv 2205.14135) never
                stores the scores and recomputes them in backward: count it as selective.
                Times the layers and the micro-batches stage k holds: min(p - k, m) with 1F1B;
                interleaved, min(2(p-k-1) + (v-1)p + 1, v m) chunk-micro-batches of 1/v of the stage each
                (Megatron-LM's warm-up, shardlib/parallel/schedules.py), p + (p-1)/v on the first stage
                (arXiv 2205.05198, Sec. 4.2.3). The last stage adds its output layer's (Sec. 4.3): the
                final norm's input and the output layer's input, 4 s b h (/ t with sequence
                parallelism), and the fp32 logits of the loss, 4 s b V / t; under full recomputation
                the larger of that and the layer being recomputed (the loss's backward frees its
                tensors before the last layer is recomputed).
  buffers       ZeRO-3 gathers the 16-bit parameters of at most two layers at a time (FSDP's rate
                limiter, arXiv 2304.11277).

Seconds per step = m T + (p-1)/v T + PP sends + exposed DP + offload, T being the time of one
micro-batch (forward + backward) on the slowest stage:
  compute       per micro-batch and layer forward 2 tokens W/t (W the layer's active weights) plus
                attention 4 b (s/c) s h / t (Q K^T and A V; Megatron-LM's count, arXiv 2104.04473,
                eq. 3), the output layer 2 tokens V h / t; backward twice that; full recomputation
                one more forward, selective one more attention core. At `efficiency` x peak FLOP/s.
  elementwise   the memory-bound kernels between the matrix products, at HBM bandwidth: per layer
                forward, 16-bit, 2 LayerNorms (read + write 2 s b h each: 8 s b h), bias + GeLU
                (16 s b h), 2 bias-dropout-adds (7 s b h each, masks 1 byte); and when the scores are
                materialized (no or full recomputation: attention that is not FlashAttention) the
                Q K^T output, softmax and dropout on a s^2 b scores: 2 + 4 + 5 + 2 (read by A V) = 13 a s^2 b.
                Backward moves twice the forward's bytes. Split by t, c as the activations are.
  TP            per micro-batch and layer 4 all-reduces of b (s/c) h elements (2 forward, 2 backward;
                arXiv 1909.08053), 6 with full recomputation; one for the embedding, one for the
                output layer and 3 of b s/c fp32 numbers for the vocabulary-parallel loss. Sequence
                parallelism sends the same bytes as all-gathers and reduce-scatters, and gathers each
                column layer's input again in backward, as Megatron-LM does (2 all-gathers a layer, 1 for
                the output layer), plus one all-reduce of the replicated gradients.
  CP            ring: each layer forward sends the local K, V block c-1 times to the next rank
                (arXiv 2310.01889), backward the K, V blocks again (c-1) and their gradients dK, dV
                around the whole ring (c hops, back to their owner: shardlib/parallel/context.py),
                full recomputation one more forward; hidden behind the attention computed meanwhile.
                Ulysses: 4 all-to-alls per layer forward (q, k, v in, the output back), 4 backward,
                each moving (c-1)/c of the local tensor (arXiv 2309.14509).
  EP            2 all-to-alls per MoE layer forward (dispatch, combine), 2 backward, each moving
                (e-1)/e of the (E, b C, h) expert buffer, C = ceil(capacity factor x top_k x s/c / E)
                places per expert and sequence (GShard, arXiv 2006.16668; shardlib/parallel/experts.py).
  bubble        (p-1)/v micro-batch times: the idle fraction (p-1)/(v m) of the interleaved 1F1B
                schedule (arXiv 2104.04473, Sec. 2.2); v = 1 is plain 1F1B (and GPipe).
  DP            per step, over the d c GPUs with the same parameters, Psi_k elements: ZeRO 0 an
                all-reduce of the gradients; 1 a reduce-scatter + an all-gather of the parameters;
                2 a reduce-scatter per micro-batch + one all-gather; 3 per micro-batch 2 all-gathers
                + 1 reduce-scatter, layer by layer. With overlap (the default, as PyTorch's DDP and
                FSDP do) a reduction hides behind the backward of its micro-batch, a gather behind
                the forward, whatever is longer than that compute stays exposed.
  PP            2 (m v + p - 2) point-to-point messages of b s h / c elements on the critical path.
  offload       per step the 16-bit gradients to the CPU and the parameters back over PCIe
                (2 + 2 bytes per offloaded parameter, ZeRO-Offload, arXiv 2101.06840, Sec. 4), and
                Adam on the CPU reading and writing master weights, m and v, bound by CPU memory.
  Collectives follow the ring alpha-beta model (comm.AlphaBeta): 2(n-1) or (n-1) steps of
  alpha + S/(n B), B the intra-node bandwidth when the group fits in one node, else the inter-node
  one (per GPU, one direction). Bytes sent per GPU: 2(n-1)/n S or (n-1)/n S.
MFU = (6 Psi_active + 12 L s h) B s / (step time * N * peak): model FLOPs as PaLM counts them
(arXiv 2204.02311, App. B); recomputation is not useful work.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch

from shardlib import memory
from shardlib.plan.inputs import Cluster
from shardlib.plan.model import ModelSpec

# The fraction of peak FLOP/s the matrix products reach (the memory-bound kernels are counted apart,
# and communication and bubble on top). 0.67 is fitted, one number by least squares on log step time,
# to the ten runs of Megatron-LM's Table 1 (arXiv 2104.04473; shardlib/lessons/planner_validation.py),
# where it leaves every run within 9%; BLOOM-176B and Llama 3 405B, not used in the fit, come out
# within 10% (tests/test_plan.py prints the table). The old default, 0.5, was the end-to-end 52%
# of that paper's abstract applied to the matrix products alone, so communication counted twice.
DEFAULT_EFFICIENCY = 0.67
OUTSIDE_TP = 8  # of the 34 s b h, kept whole on every TP rank unless sequence parallel (arXiv 2205.05198): the
# LayerNorms' inputs 4, the q/k/v and MLP inputs 2 + 2; and with dropout its two masks, DROPOUT_MASKS
DROPOUT_MASKS = 2
ATTENTION_INSIDE_TP = 8  # q, k, v and the output projection's input, inside the TP region
KEPT_FULL = 2  # full recomputation keeps the layer input, 2 s b h


class _Columns:
    """Dataclasses of columns: `row(i)` gives the same dataclass for one layout, with floats."""

    def row(self, i: int):
        return type(self)(**{f.name: _item(getattr(self, f.name), i) for f in fields(self)})


def _item(value, i):
    if isinstance(value, _Columns):
        return value.row(i)
    return value[i].item() if isinstance(value, torch.Tensor) and value.dim() else value


@dataclass
class Layouts(_Columns):
    """Layouts as columns (the fields of inputs.Layout; recompute as 0 none, 1 selective, 2 full)."""

    dp: torch.Tensor
    tp: torch.Tensor
    pp: torch.Tensor
    cp: torch.Tensor
    ep: torch.Tensor
    zero: torch.Tensor
    micro_batch: torch.Tensor
    recompute: torch.Tensor
    sp: torch.Tensor
    ulysses: torch.Tensor
    virtual: torch.Tensor
    offload: torch.Tensor

    @classmethod
    def from_rows(cls, rows) -> "Layouts":
        table = torch.tensor(rows, dtype=torch.float64).reshape(-1, len(fields(cls)))  # (layouts, 12)
        return cls(*table.unbind(1))


@dataclass
class Memory(_Columns):
    """Bytes on one GPU (host: CPU memory that offloading uses per GPU)."""

    model_states: torch.Tensor
    activations: torch.Tensor
    buffers: torch.Tensor
    host: torch.Tensor

    @property
    def total(self):
        return self.model_states + self.activations + self.buffers


@dataclass
class Traffic(_Columns):
    """Bytes one GPU sends per step, by group (pcie: to and from the CPU, offloading)."""

    dp: torch.Tensor
    tp: torch.Tensor
    pp: torch.Tensor
    cp: torch.Tensor
    ep: torch.Tensor
    pcie: torch.Tensor

    @property
    def total(self):
        return self.dp + self.tp + self.pp + self.cp + self.ep


@dataclass
class StepTime(_Columns):
    """Seconds of one step: compute and what communication and idling add to it (exposed parts)."""

    compute: torch.Tensor
    elementwise: torch.Tensor
    tp: torch.Tensor
    cp: torch.Tensor
    ep: torch.Tensor
    bubble: torch.Tensor
    pp: torch.Tensor
    dp: torch.Tensor
    offload: torch.Tensor

    @property
    def total(self):
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass
class Costs(_Columns):
    """Everything the planner predicts for a layout (or a column of layouts), on one GPU."""

    memory: Memory
    sent: Traffic
    time: StepTime
    n_micro: torch.Tensor  # m: micro-batches per step on each data-parallel rank
    mfu: torch.Tensor


def _layers_of_stage(n_layer: int, p, k):
    """Layers of stage k: floor(L/p), one more on the first L mod p middle stages (then stage 0)."""
    base = torch.floor(n_layer / p)
    extra = n_layer - p * base
    middle = (k > 0) & (k < p - 1) & (k - 1 < extra)
    first = (k == 0) & (extra > torch.clamp(p - 2, min=0))
    return base + middle.double() + first.double()


class _Ring:
    """Ring collectives on groups of n GPUs (a column), over links of `bandwidth` bytes/s (a column)."""

    def __init__(self, n, bandwidth, alpha: float):
        self.n, self.bandwidth, self.alpha = n, bandwidth, alpha

    def steps(self, kind: str):
        return (2 if kind == "all_reduce" else 1) * (self.n - 1)

    def time(self, kind: str, nbytes):
        """steps (alpha + S / (n B)) on a tensor of S = nbytes (comm.AlphaBeta.time, as a column).
        all_to_all: n-1 messages of S/n."""
        return self.steps(kind) * (self.alpha * (self.n > 1) + nbytes / (self.n * self.bandwidth))

    def sent(self, kind: str, nbytes):
        """Bytes one GPU sends: 2 (n-1)/n S (all-reduce) or (n-1)/n S (all-gather, reduce-scatter, all-to-all)."""
        return self.steps(kind) / self.n * nbytes


def _link(cluster: Cluster, span):
    """Bandwidth per GPU (bytes/s) of a group spanning `span` consecutive ranks: inside one node or across."""
    g = cluster.gpus_per_node
    inside = (span <= g) & (torch.remainder(g, span) == 0)
    return torch.where(inside, cluster.intra_bw_gbps, cluster.inter_bw_gbps) * 1e9


def _layer_activations(spec: ModelSpec, c: Layouts, mode: int):
    """16-bit bytes one layer keeps for backward, one micro-batch, on one GPU (see the module docstring)."""
    t, sp = c.tp, c.sp
    sbh = c.micro_batch * (spec.seq_len / c.cp) * spec.hidden  # local tokens x h
    if mode == 2:
        return KEPT_FULL * sbh / torch.where(sp > 0, t, 1.0)
    dropout = float(spec.dropout)
    inside = (ATTENTION_INSIDE_TP + _mlp_activations(spec)) * sbh
    scores = (2.0 + 3.0 * dropout) * spec.n_head * spec.seq_len * sbh / spec.hidden if mode == 0 else 0.0  # a s^2 b / c
    outside = (OUTSIDE_TP + DROPOUT_MASKS * dropout) * sbh
    return torch.where(sp > 0, outside / t, outside) + (inside + scores) / t


def _mlp_activations(spec: ModelSpec) -> float:
    """What one layer's MLP (or MoE) keeps inside the tensor-parallel region, in units of s b h bytes (16-bit)."""
    mlp = (6.0 if spec.gated_mlp else 4.0) * spec.ffn / spec.hidden  # 2 s b f GeLU in and out; gated 4 + 2
    if not spec.moe:
        return mlp
    return 4.0 * spec.top_k + spec.top_k * spec.capacity_factor * (2.0 + mlp)  # choices; expert places


def _layer_traffic(spec: ModelSpec, c: Layouts):
    """16-bit bytes the memory-bound kernels of one layer move in forward, one micro-batch, one GPU."""
    t = c.tp
    sbh = c.micro_batch * (spec.seq_len / c.cp) * spec.hidden
    outside = 22 * sbh  # 2 LayerNorms, 2 bias-dropout-adds: outside the TP regions
    mlp = 16 * sbh * (spec.top_k * spec.capacity_factor if spec.moe else 1.0)  # bias + GeLU, per routed copy
    scores = 13.0 * spec.n_head * spec.seq_len * sbh / spec.hidden * (c.recompute != 1).double()
    return torch.where(c.sp > 0, outside / t, outside) + (mlp + scores) / t


@contextmanager
def _one_thread():
    """Columns of ~1e5 numbers go through a few hundred elementwise operations: splitting each over
    threads costs more than it saves (10x more on a busy machine, measured), so use one, then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def costs(spec: ModelSpec, cluster: Cluster, c: Layouts, global_batch: int, recipe, efficiency: float,
          overlap: bool, stage=None) -> Costs:
    """The costs of every layout of `c` on one GPU: of pipeline stage `stage` (an int), or, stage=None,
    memory of the stage that needs most, seconds and bytes of the slowest stage."""
    with _one_thread():
        return _costs(spec, cluster, c, global_batch, recipe, efficiency, overlap, stage)


def _costs(spec: ModelSpec, cluster: Cluster, c: Layouts, global_batch: int, recipe, efficiency: float,
           overlap: bool, stage) -> Costs:
    recipe = memory.get_recipe(recipe)
    p = c.pp
    if stage is not None:
        return _stage(spec, cluster, c, global_batch, recipe, efficiency, overlap, torch.full_like(p, stage))
    k_middle = torch.minimum(torch.ones_like(p), p - 1)
    each = [_stage(spec, cluster, c, global_batch, recipe, efficiency, overlap, k)
            for k in (torch.zeros_like(p), p - 1, k_middle)]
    by_memory = torch.stack([x.memory.total for x in each]).argmax(0)  # (layouts,) which stage to report
    by_time = torch.stack([x.time.total for x in each]).argmax(0)
    pick = lambda which, name, part: torch.stack(  # noqa: E731
        [getattr(getattr(x, part), name) for x in each]).gather(0, which[None])[0]
    memory_ = Memory(*(pick(by_memory, f.name, "memory") for f in fields(Memory)))
    time = StepTime(*(pick(by_time, f.name, "time") for f in fields(StepTime)))
    sent = Traffic(*(torch.stack([getattr(x.sent, f.name) for x in each]).amax(0) for f in fields(Traffic)))
    return Costs(memory_, sent, time, each[0].n_micro, _mfu(spec, cluster, c, global_batch, time.total))


def _mfu(spec, cluster, c: Layouts, global_batch: int, step):
    tokens = float(global_batch) * spec.seq_len
    model_flops = (6.0 * spec.matmul_params() + 12.0 * spec.n_layer * spec.seq_len * spec.hidden) * tokens
    return model_flops / (step * (c.dp * c.cp * c.tp * c.pp) * cluster.peak_tflops * 1e12)


def _stage(spec: ModelSpec, cluster: Cluster, c: Layouts, global_batch: int, recipe, efficiency: float,
           overlap: bool, k) -> Costs:
    """Memory, bytes sent and seconds of the GPUs of pipeline stage k (a column of stage indices)."""
    d, t, p, cp, ep, z, b, v = c.dp, c.tp, c.pp, c.cp, c.ep, c.zero, c.micro_batch, c.virtual
    s, h, V, e, eg = spec.seq_len, spec.hidden, spec.vocab_size, recipe.params, recipe.grads
    m = global_batch / (d * b)
    first, last = (k == 0).double(), (k == p - 1).double()
    layers = _layers_of_stage(spec.n_layer, p, k)
    tokens = b * s / cp  # local tokens of one micro-batch
    alpha = cluster.alpha_us * 1e-6
    tp_ring = _Ring(t, _link(cluster, t), alpha)
    cp_ring = _Ring(cp, _link(cluster, t * cp), alpha)
    ep_ring = _Ring(ep, _link(cluster, t * cp * ep), alpha)
    dp_ring = _Ring(d * cp, _link(cluster, t * cp * d), alpha)
    expert_ring = _Ring(d * cp / ep, _link(cluster, t * cp * d), alpha)

    # -- memory ----------------------------------------------------------------------
    split, replicated = spec.stage_params(first, last, layers)
    V_t = torch.ceil(V / t)  # vocabulary rows per tensor-parallel rank: V padded to a multiple of t
    split = split + (V_t * t - V) * h * (first + last * (1 - spec.tied_embeddings * first))  # the padding rows
    psi_dense = split / t + replicated
    mlp_split, mlp_replicated = spec.mlp_params()
    psi_expert = layers * spec.n_experts / ep * (mlp_split / t + mlp_replicated)
    keep = lambda n, z_min: torch.where(z >= z_min, 1.0 / n, 1.0)  # noqa: E731 - the share ZeRO leaves
    n_dense, n_expert = d * cp, d * cp / ep
    params = e * (psi_dense * keep(n_dense, 3) + psi_expert * keep(n_expert, 3))
    grads = eg * (psi_dense * keep(n_dense, 2) + psi_expert * keep(n_expert, 2))
    optimizer = recipe.optimizer * (psi_dense * keep(n_dense, 1) + psi_expert * keep(n_expert, 1))
    offload = c.offload > 0
    by_mode = [_layer_activations(spec, c, mode) for mode in range(3)]
    per_layer = torch.where(c.recompute == 0, by_mode[0], torch.where(c.recompute == 1, by_mode[1], by_mode[2]))
    in_flight = torch.where(v > 1, torch.minimum(2 * (p - k - 1) + (v - 1) * p + 1, v * m) / v,
                            torch.minimum(p - k, m))  # micro-batches of activations stage k holds at most
    recomputing = torch.where(c.recompute == 2, by_mode[0], 0.0) * e / 2  # the layer being recomputed
    # the final norm's and the output layer's inputs, and the fp32 logits: freed by the loss's backward before
    # the last layer is recomputed, so the two never add up
    output_layer = last * (4 * tokens * h / torch.where(c.sp > 0, t, 1.0) * e / 2 + 4 * tokens * V_t)
    activations = layers * per_layer * in_flight * e / 2 + torch.maximum(recomputing, output_layer)
    layer_split, layer_replicated = spec.layer_params()
    layer_experts = spec.n_experts / ep * (mlp_split / t + mlp_replicated)
    buffers = ((z == 3) & (d * cp > 1)) * 2 * (layer_split / t + layer_replicated + layer_experts) * e
    mem = Memory(params + grads + torch.where(offload, 0.0, optimizer), activations, buffers,
                 torch.where(offload, optimizer, 0.0))

    # -- compute, per micro-batch ----------------------------------------------------
    flop_s = cluster.peak_tflops * 1e12 * efficiency
    attention = 4.0 * b * (s / cp) * s * h / t  # Q K^T and A V of one layer, forward
    layer_forward = 2.0 * tokens * spec.layer_matmul_params() / t + attention
    forward = layers * layer_forward + last * 2.0 * tokens * V * h / t
    recompute_flops = layers * torch.where(c.recompute == 2, layer_forward,
                                           torch.where(c.recompute == 1, attention, 0.0))
    elementwise = layers * _layer_traffic(spec, c) * e / 2 / (cluster.hbm_bw_gbps * 1e9)  # forward, seconds
    forward_s = forward / flop_s + elementwise
    backward_s = (2 * forward + recompute_flops) / flop_s + (2 + (c.recompute == 2).double()) * elementwise
    redo = (c.recompute == 2).double()  # a recomputed layer repeats its forward's communication; selective (or
    # FlashAttention) recomputes the scores from the K, V blocks its backward receives anyway

    # -- tensor, context and expert parallelism, per micro-batch ----------------------
    bsh = tokens * h * e
    # in all-reduces of b s h: 2 forward and 2 backward per layer (3 and 3 recomputing); sequence parallelism
    # gathers each column layer's input again in backward (2 all-gathers a layer, 1 for the output layer: half
    # an all-reduce each), as Megatron-LM keeps only the shard (shardlib/parallel/sequence.py): sent, but
    # started before the input gradient's product and hidden behind it, so not on the critical path
    tp_calls = layers * torch.where(c.recompute == 2, 6.0, 4.0) + first + last
    regathers = c.sp * (layers + last / 2)
    loss_bytes = 3 * tokens * 4  # the vocabulary-parallel cross-entropy's three fp32 all-reduces
    tp_sent = (tp_calls + regathers) * tp_ring.sent("all_reduce", bsh) + last * 3 * tp_ring.sent("all_reduce",
                                                                                                 loss_bytes / 3)
    tp_s = tp_calls * tp_ring.time("all_reduce", bsh) + last * 3 * tp_ring.time("all_reduce", loss_bytes / 3)
    sp_sent = c.sp * tp_ring.sent("all_reduce", replicated * eg)  # the replicated weights' gradients, once a step
    sp_s = c.sp * tp_ring.time("all_reduce", replicated * eg)

    kv = tokens * 2 * h * spec.kv_heads / spec.n_head / t * e  # this rank's K and V block
    ring_blocks = (cp - 1) * (2 + redo) + cp * (cp > 1)  # K, V forward, again backward (and recomputing); dK, dV
    ring_sent = layers * ring_blocks * kv
    ring_s = layers * torch.clamp(ring_blocks * (alpha + kv / cp_ring.bandwidth)
                                  - (3 + redo) * attention / flop_s, min=0.0)  # hidden behind attention
    a2a = tokens * (2 * h + 2 * h * spec.kv_heads / spec.n_head) / t * e  # q, k, v in; the output back
    ulysses_calls = layers * 4 * (2 + redo)  # 4 all-to-alls per pass, a quarter of a2a each on average
    ulysses_sent = ulysses_calls * cp_ring.sent("all_to_all", a2a / 4)
    ulysses_s = ulysses_calls * cp_ring.time("all_to_all", a2a / 4)
    ulysses = c.ulysses > 0
    cp_sent, cp_s = torch.where(ulysses, ulysses_sent, ring_sent), torch.where(ulysses, ulysses_s, ring_s)

    places = spec.n_experts * torch.ceil(spec.capacity_factor * spec.top_k * (s / cp) / max(spec.n_experts, 1))
    routed = b * places * h * e / torch.where(c.sp > 0, t, 1.0)  # the (E, b capacity, h) expert buffer
    ep_calls = layers * (4 + 2 * (c.recompute == 2).double()) * float(spec.moe)
    ep_sent, ep_s = ep_calls * ep_ring.sent("all_to_all", routed), ep_calls * ep_ring.time("all_to_all", routed)

    # -- the step ----------------------------------------------------------------------
    micro = forward_s + backward_s + tp_s + cp_s + ep_s  # one micro-batch on this stage
    bubble = (p - 1) / v * micro
    boundary = tokens * h * e / torch.where(c.sp > 0, t, 1.0)
    pp_s = (p > 1) * 2 * (m * v + p - 2) * (alpha + boundary / _link(cluster, t * cp * d * p))
    sends = 2 * v - first - last
    dp_sent, dp_s = _data_parallel(c, m, layers, psi_dense * e, psi_dense * eg, dp_ring, forward_s, backward_s,
                                   overlap)
    expert_sent, expert_s = _data_parallel(c, m, layers, psi_expert * e, psi_expert * eg, expert_ring, forward_s,
                                           backward_s, overlap)
    offloaded = (psi_dense * keep(n_dense, 1) + psi_expert * keep(n_expert, 1)) * offload
    pcie = offloaded * (eg + e)  # gradients down, parameters up
    cpu_adam = offloaded * (2 * recipe.optimizer + eg + e) / (cluster.host_mem_bw_gbps * 1e9)
    grads_down = offloaded * eg / (cluster.pcie_bw_gbps * 1e9)
    offload_s = cpu_adam + offloaded * e / (cluster.pcie_bw_gbps * 1e9) + (
        torch.clamp(grads_down - backward_s, min=0.0) if overlap else grads_down)
    elementwise_s = (3 + (c.recompute == 2).double()) * elementwise
    time = StepTime(m * (forward_s + backward_s - elementwise_s), m * elementwise_s, m * (tp_s + sp_s), m * cp_s,
                    m * ep_s, bubble, pp_s, dp_s + expert_s, offload_s)
    sent = Traffic(dp_sent + expert_sent, m * tp_sent + sp_sent, sends * m * boundary, m * cp_sent, m * ep_sent, pcie)
    return Costs(mem, sent, time, m, _mfu(spec, cluster, c, global_batch, time.total))


def _data_parallel(c: Layouts, m, layers, param_bytes, grad_bytes, ring: _Ring, forward_s, backward_s, overlap):
    """Bytes sent and exposed seconds of the data-parallel collectives of one step (ZeRO stage c.zero)."""
    z = c.zero
    units = torch.where(z == 3, layers + 1, 1.0)  # ZeRO-3 gathers and reduces layer by layer
    all_reduce = ring.time("all_reduce", grad_bytes)
    reduce_scatter, all_gather = ring.time("reduce_scatter", grad_bytes), ring.time("all_gather", param_bytes)
    rs_units = units * ring.time("reduce_scatter", grad_bytes / units) - reduce_scatter  # alphas of layer-by-layer
    ag_units = units * ring.time("all_gather", param_bytes / units) - all_gather
    hide = (lambda x, under: torch.clamp(x - under, min=0.0)) if overlap else (lambda x, under: x)
    seconds = torch.where(z == 0, hide(all_reduce, backward_s),
              torch.where(z == 1, hide(reduce_scatter, backward_s) + hide(all_gather, forward_s),
              torch.where(z == 2, m * hide(reduce_scatter, backward_s) + hide(all_gather, forward_s),
                          m * (hide(all_gather + ag_units, forward_s)
                               + hide(all_gather + reduce_scatter + ag_units + rs_units, backward_s)))))
    sent = torch.where(z == 0, ring.sent("all_reduce", grad_bytes),
           torch.where(z == 1, ring.sent("reduce_scatter", grad_bytes) + ring.sent("all_gather", param_bytes),
           torch.where(z == 2, m * ring.sent("reduce_scatter", grad_bytes) + ring.sent("all_gather", param_bytes),
                       m * (2 * ring.sent("all_gather", param_bytes) + ring.sent("reduce_scatter", grad_bytes)))))
    return sent, seconds
