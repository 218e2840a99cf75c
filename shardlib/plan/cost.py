"""The planner's cost model: memory, bytes sent and seconds per step of a layout, on each GPU.

Notation (the course's): Psi parameters, L layers, h hidden size, a heads, V vocabulary, s sequence
length, B global batch (sequences), b micro-batch, m = B / (d b) micro-batches per step, d data-,
c context-, t tensor-, e expert-parallel sizes, p pipeline stages of v chunks each, N = d c t p.
Each function takes columns of layouts (float64 tensors, one row per layout) and returns named
dataclasses of such columns: the whole search is evaluated at once.

Stages. Stage k holds floor(L/p) or ceil(L/p) layers (the extra ones on the middle stages, as BLOOM
and Llama 3 balance the embedding and the output layer), the embedding on stage 0, the output layer
on stage p-1.

Memory of a GPU of stage k:
  model states  Psi_k = Psi_split/t + Psi_replicated (+ its E/e experts; the embedding and the output layer of
                ceil(V/t) rows each, V padded to a multiple of t as the tensor-parallel code pads it), under ZeRO
                stage z over the d c GPUs holding the same parameters: params, gradients and optimizer states of
                the recipe (shardlib.memory.TRAINING_RECIPES), the optimizer's sharded from z = 1, the gradients' from 2,
                the parameters' from 3 (ZeRO, arXiv 1910.02054, Fig. 1). Megatron's distributed optimizer is
                z = 1 with its own recipes (fp32 main gradients: "mixed_adam_fp32_main_grads").
  activations   per layer and micro-batch, shardlib/plan/compute.py (Korthikanti et al., arXiv 2205.05198),
                times the layer-micro-batches stage k holds: with 1F1B min(p - k, m) micro-batches of its
                L_k layers; interleaved, Megatron-Core's warm-up of 2 (p - k - 1) + (v - 1) p chunks plus
                the one running, of L_k / v layers each (megatron/core/pipeline_parallel/schedules.py). Full
                recomputation adds the layer being recomputed, less its input, already kept. The last stage adds its output layer's (arXiv
                2205.05198, Sec. 4.3): the final norm's and the output layer's inputs, 4 s b h (/ t with sequence
                parallelism), and the loss's fp32 softmax, 4 s b V / t; under full recomputation the larger of that
                and the layer being recomputed (the loss's backward frees the first before the second exists).
  buffers       ZeRO-3 gathers the 16-bit parameters of at most two layers at a time (FSDP's rate limiter).
  runtime       what no tensor of the model holds: the CUDA context and libraries' workspaces, 0.5 GiB, and each
                NCCL communicator the GPU joins (tensor, context, expert, data-parallel, pipeline, tied-embedding
                groups larger than one), 0.5 GiB each: Fujii, Watanabe and Yokota's estimator (arXiv 2411.06465;
                https://okoge-kaz.github.io/tools/memory-estimator: "CUDA context ~300-500 MB", "~0.5 GB per
                communicator"). Allocator fragmentation is not counted: the same paper finds no out-of-memory
                error below 80% of the GPU by its estimate, so the last fifth of a GPU is a risk the tables show.

Seconds per step = m T + (p-1)/v T + PP sends + exposed DP + optimizer step + offload, T the time of one
micro-batch (forward + backward + exposed TP, CP, EP) on the slowest stage:
  compute       shardlib/plan/compute.py: each matrix product by the GPU's shape-dependent curve
                (shardlib/plan/gemm.py), the attention core, memory-bound kernels at HBM bandwidth.
                Full recomputation runs the forward again (with checkpoint_early_stop, less the MLP's down
                projection and the add after it: PyTorch's non-reentrant checkpoint since 2.1 stops at the last
                saved tensor, pytorch/pytorch#96866); selective, the attention core (its products and
                its written-out scores). A recipe that adds each micro-batch's gradients into a separate sum
                after the backward (memory.Recipe.accumulate: DeepSpeed's BF16_Optimizer) moves its bytes per
                parameter of the stage at HBM bandwidth, once per micro-batch.
  TP            per micro-batch and layer 4 all-reduces of b (s/c) h (2 forward, 2 backward; arXiv
                1909.08053), 6 with full recomputation; one for the embedding, one for the output layer, 3
                of b s/c fp32 numbers for the vocabulary-parallel loss; with sequence parallelism the same
                bytes as all-gathers and reduce-scatters, one all-reduce of the replicated weights' gradients,
                and in backward 2 all-gathers per layer (1 for the output head) of the sequence shards the
                column layers kept, beside their data-gradient products (Megatron-LM's; shardlib/parallel/
                sequence.py). On the critical path, unless tp_overlap: then each pass's collectives hide
                behind that pass's products by the overlap rule (shardlib/plan/links.py). Without it, the
                backward's 2 per layer at the column-parallel layers' inputs (all-reduces, or reduce-scatters
                with sequence parallelism), and the output layer's, each run beside that layer's weight-gradient
                product and hide behind it by the same rule (at least kappa / (1 + kappa) of each stays), as
                Megatron-LM has run them by default since September 2021 (async_tp_backward; cost_comm.py); an
                MoE layer's experts give their up projection's collective no such product, so it stays whole.
  CP            ring attention: each layer forward sends the local K, V block c-1 times (arXiv 2310.01889),
                backward K, V again (c-1) and dK, dV round the whole ring (c); hidden behind the attention
                core by the overlap rule. Ulysses: 4 all-to-alls per pass of (c-1)/c of q, k, v, out
                (arXiv 2309.14509), on the critical path. All-gather (Llama 3, arXiv 2407.21783, Sec. 3.3.2):
                per layer an all-gather of the c K, V blocks each forward and a reduce-scatter of dK, dV in
                backward, on the critical path; the other ranks' c-1 blocks kept among the activations.
  EP            2 all-to-alls per MoE layer forward, 2 backward, of the (E, b C, h) expert buffer (GShard,
                arXiv 2006.16668), on the critical path.
  bubble        (p-1)/v micro-batch times: the idle fraction (p-1)/(v m) of interleaved 1F1B (arXiv 2104.04473).
  PP            2 (m v + p - 2) point-to-point messages on the critical path. Each tensor-parallel rank sends
                1/t of the b s h / c activation and the receivers all-gather it over NVLink, one all-gather of
                the tp group per message received (the scatter/gather optimisation, arXiv 2104.04473, Sec. 4.1;
                shardlib/parallel/pipeline.py); with sequence parallelism it is already split. Without the
                optimisation (scatter_gather=False: Megatron-LM before February 2021) every tensor-parallel rank
                sends the whole b s h / c activation, over its own link, and nothing is gathered.
                Tied embeddings: their gradients all-reduced between the first and the last stage once a step.
  DP            over the d c GPUs with the same parameters, Psi_k: ZeRO 0 an all-reduce of the gradients
                behind the last micro-batch's backward; 1 a reduce-scatter there and an all-gather behind the
                first forward; 2 a reduce-scatter behind every backward and an all-gather behind the first
                forward, layer by layer; 3 per micro-batch 2 all-gathers and 1 reduce-scatter, layer by layer,
                behind each pass. Layer by layer, as FSDP runs ZeRO-2 and -3 (SHARD_GRAD_OP, FULL_SHARD: one
                collective per wrapped block, so each pays its own n - 1 ring latencies; DeepSpeed's ZeRO-2
                reduces in buckets of 5e8 elements, fewer and larger: reduce_bucket_size,
                deepspeed/runtime/zero/config.py). With overlap (default) by the overlap rule,
                the links shared with overlapped TP and CP traffic; without, all of it on the critical path.
                ZeRO-2 and -3 inside a pipeline are refused (planner.check_layout): DeepSpeed's reason.
                overlap_with_pipeline=False: with pp > 1 none of it overlaps (Megatron-LM in 2021 ran pipelines
                only with its "local" DDP, which reduces after the backward: megatron/training.py, "We only
                support local DDP with multiple micro-batches").
  optimizer     the step reads and writes the optimizer states, reads the gradients and writes the 16-bit
                parameters of this GPU's shard, at HBM bandwidth.
  offload       per step the 16-bit gradients to the CPU and the parameters back over PCIe (ZeRO-Offload,
                arXiv 2101.06840, Sec. 4), and Adam on the CPU bound by its memory bandwidth.
MFU = (6 Psi_active + 12 L s h) B s / (step time * N * peak): model FLOPs as PaLM counts them (arXiv
2204.02311, App. B), attention counted whole, recomputation not counted as useful work.

The fractions of shardlib/plan/fitted.py (of the matmul ceiling per GPU, of the links' and of HBM's
bandwidth) are the model's only free constants, fitted on the training runs of shardlib/plan/published.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch

from shardlib import memory
from shardlib.plan.compute import OUTPUT_LAYER_INPUTS, layer_activations, layer_seconds, output_layer_seconds, \
    vocab_rows
from shardlib.plan.cost_comm import stage_communication
from shardlib.plan.fitted import FITTED
from shardlib.plan.inputs import Cluster
from shardlib.plan.links import exposed
from shardlib.plan.model import ModelSpec

ATTENTION = ("fused", "flash", "flash-triton", "unfused")  # Transformer Engine's fused attention (cuDNN's on
# Hopper, FlashAttention-2 elsewhere), FlashAttention-2, its Triton kernel, the scores written out (attention.py)
DEFAULT_ATTENTION = ATTENTION[0]  # what Megatron-Core and NeMo run


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
    cp_method: torch.Tensor  # 0 ring, 1 ulysses, 2 allgather (inputs.CP_METHODS)
    virtual: torch.Tensor
    offload: torch.Tensor
    tp_overlap: torch.Tensor

    @classmethod
    def from_rows(cls, rows) -> "Layouts":
        table = torch.tensor(rows, dtype=torch.float64).reshape(-1, len(fields(cls)))  # (layouts, 13)
        return cls(*table.unbind(1))


@dataclass
class Memory(_Columns):
    """Bytes on one GPU (host: CPU memory that offloading uses per GPU)."""

    params: torch.Tensor
    grads: torch.Tensor
    optimizer: torch.Tensor
    activations: torch.Tensor
    buffers: torch.Tensor
    runtime: torch.Tensor
    host: torch.Tensor

    @property
    def model_states(self):
        return self.params + self.grads + self.optimizer

    @property
    def total(self):
        return self.model_states + self.activations + self.buffers + self.runtime


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
    optimizer: torch.Tensor
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


@dataclass(frozen=True)
class Options:
    """What the model assumes beyond the layout: bytes per parameter (recipe), the fractions of the matmul
    ceiling, of the links' and of HBM's bandwidth reached, whether DP traffic overlaps compute, the
    attention kernel, whether pipeline messages are scattered over the tensor-parallel ranks and gathered."""

    recipe: object = "mixed_adam"
    efficiency: float | None = None  # None: the cluster's matmul_fraction
    overlap: bool = True
    attention: str = DEFAULT_ATTENTION
    link: tuple = (FITTED["nvlink"], FITTED["network"])
    hbm: float = FITTED["hbm"]
    scatter_gather: bool = True  # arXiv 2104.04473, Sec. 4.1
    overlap_with_pipeline: bool = True  # False: DP overlap only without a pipeline (Megatron-LM, 2021)
    async_tp_backward: bool = True  # False: the column layers' input-gradient collectives wait (before 2021-09)
    checkpoint_early_stop: bool = False  # full recomputation stops at the last saved tensor (PyTorch >= 2.1)


def layers_of_stage(n_layer: int, p, k):
    """Layers of stage k: floor(L/p), one more on the first L mod p middle stages (then stage 0)."""
    base = torch.floor(n_layer / p)
    extra = n_layer - p * base
    middle = (k > 0) & (k < p - 1) & (k - 1 < extra)
    first = (k == 0) & (extra > torch.clamp(p - 2, min=0))
    return base + middle.double() + first.double()


def in_flight(p, k, m, v):
    """Layer-micro-batches of activations stage k holds at once, per layer of the stage (1F1B or interleaved)."""
    warmup = 2 * (p - k - 1) + (v - 1) * p  # Megatron-Core's interleaved warm-up, in chunks of L_k / v layers
    interleaved = torch.minimum(warmup + 1, m * v) / v
    return torch.where(v > 1, interleaved, torch.minimum(p - k, m))


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


def costs(spec: ModelSpec, cluster: Cluster, c: Layouts, global_batch: int, options: Options, stage=None) -> Costs:
    """The costs of every layout of `c` on one GPU: of pipeline stage `stage` (an int), or, stage=None,
    memory of the stage that needs most, seconds and bytes of the slowest stage."""
    with _one_thread():
        if stage is not None:
            return _stage(spec, cluster, c, global_batch, options, torch.full_like(c.pp, stage))
        p = c.pp
        each = [_stage(spec, cluster, c, global_batch, options, k)
                for k in (torch.zeros_like(p), p - 1, torch.minimum(torch.ones_like(p), p - 1))]
        by_memory = torch.stack([x.memory.total for x in each]).argmax(0)  # (layouts,) which stage to report
        by_time = torch.stack([x.time.total for x in each]).argmax(0)
        pick = lambda which, name, part: torch.stack(  # noqa: E731
            [getattr(getattr(x, part), name) for x in each]).gather(0, which[None])[0]
        memory_ = Memory(*(pick(by_memory, f.name, "memory") for f in fields(Memory)))
        time = StepTime(*(pick(by_time, f.name, "time") for f in fields(StepTime)))
        sent = Traffic(*(torch.stack([getattr(x.sent, f.name) for x in each]).amax(0) for f in fields(Traffic)))
        return Costs(memory_, sent, time, each[0].n_micro, mfu(spec, cluster, c, global_batch, time.total))


def mfu(spec, cluster, c: Layouts, global_batch: int, step):
    """Model FLOPs utilization: (6 Psi_active + 12 L s h) B s / (step * N * peak)."""
    tokens = float(global_batch) * spec.seq_len
    model_flops = (6.0 * spec.matmul_params() + 12.0 * spec.n_layer * spec.seq_len * spec.hidden) * tokens
    return model_flops / (step * (c.dp * c.cp * c.tp * c.pp) * cluster.peak_tflops * 1e12)


CUDA_CONTEXT_BYTES = 0.5 * 2**30  # the CUDA context and libraries' workspaces (arXiv 2411.06465's estimator)
COMMUNICATOR_BYTES = 0.5 * 2**30  # buffers of one NCCL communicator (the same)


def runtime_bytes(spec, c: Layouts, first, last):
    """The CUDA context and the NCCL communicators a GPU of the stage (first, last: columns of 0/1) joins."""
    groups = [c.tp, c.cp, c.ep, c.dp * c.cp, c.pp]
    communicators = sum((g > 1).double() for g in groups)
    communicators = communicators + float(spec.moe) * ((c.dp * c.cp / c.ep > 1) & (c.ep > 1)).double()  # experts' DP
    communicators = communicators + float(spec.tied_embeddings) * (c.pp > 1) * torch.maximum(first, last)
    return CUDA_CONTEXT_BYTES + COMMUNICATOR_BYTES * communicators


def _stage_memory(spec, c: Layouts, m, k, first, last, layers, recipe, flash: bool) -> tuple:
    """Memory of stage k, and the per-GPU parameter counts (dense, experts) the rest needs."""
    t, p, z, v = c.tp, c.pp, c.zero, c.virtual
    e = recipe.params
    split, replicated = spec.stage_params(first, last, layers)
    padding = (vocab_rows(spec, t) * t - spec.vocab_size) * spec.hidden  # rows that pad V to a multiple of t
    split = split + padding * (first + last * (1 - spec.tied_embeddings * first))
    psi_dense = split / t + replicated
    mlp_split, mlp_replicated = spec.mlp_params()
    psi_expert = layers * spec.n_experts / c.ep * (mlp_split / t + mlp_replicated)
    keep = lambda n, z_min: torch.where(z >= z_min, 1.0 / n, 1.0)  # noqa: E731 - the share ZeRO leaves
    n_dense, n_expert = c.dp * c.cp, c.dp * c.cp / c.ep
    share = lambda z_min: psi_dense * keep(n_dense, z_min) + psi_expert * keep(n_expert, z_min)  # noqa: E731
    params, grads, optimizer = e * share(3), recipe.grads * share(2), recipe.optimizer * share(1)
    by_mode = [layer_activations(spec, c, mode, flash) for mode in range(3)]
    per_layer = torch.where(c.recompute == 0, by_mode[0], torch.where(c.recompute == 1, by_mode[1], by_mode[2]))
    # the layer being recomputed: all it keeps but its input, which is the kept one (its first norm reads it)
    recomputing = torch.where(c.recompute == 2, by_mode[0] - by_mode[2], 0.0) * e / 2
    tokens = c.micro_batch * spec.seq_len / c.cp
    # the final norm's and the output layer's inputs, and the loss's fp32 softmax: the loss's backward frees them
    # before the last layer is recomputed, so under full recomputation the two never add up
    head_inputs = OUTPUT_LAYER_INPUTS * tokens * spec.hidden / torch.where(c.sp > 0, t, 1.0) * e / 2
    output_layer = last * (head_inputs + 4 * tokens * vocab_rows(spec, t))
    activations = layers * per_layer * in_flight(p, k, m, v) * e / 2 + torch.maximum(recomputing, output_layer)
    layer_split, layer_replicated = spec.layer_params()
    layer_experts = spec.n_experts / c.ep * (mlp_split / t + mlp_replicated)
    buffers = ((z == 3) & (n_dense > 1)) * 2 * (layer_split / t + layer_replicated + layer_experts) * e
    offload = c.offload > 0
    mem = Memory(params, grads, torch.where(offload, 0.0, optimizer), activations, buffers,
                 runtime_bytes(spec, c, first, last), torch.where(offload, optimizer, 0.0))
    return mem, psi_dense, psi_expert, share(1)


def _stage(spec: ModelSpec, cluster: Cluster, c: Layouts, global_batch: int, options: Options, k,
           collectives: bool = False):
    """Memory, bytes sent and seconds of the GPUs of pipeline stage k (a column of stage indices); with
    collectives=True also the list of cost_comm.Collective that makes up the bytes sent."""
    recipe = memory.get_recipe(options.recipe)
    flash = options.attention != "unfused"  # no s x s scores kept or written
    d, t, p, v = c.dp, c.tp, c.pp, c.virtual
    e = recipe.params
    m = global_batch / (d * c.micro_batch)
    first, last = (k == 0).double(), (k == p - 1).double()
    layers = layers_of_stage(spec.n_layer, p, k)
    mem, psi_dense, psi_expert, sharded = _stage_memory(spec, c, m, k, first, last, layers, recipe, flash)

    # -- compute, per micro-batch --------------------------------------------------------
    fraction = cluster.matmul_fraction if options.efficiency is None else options.efficiency
    hbm = options.hbm
    one = layer_seconds(spec, cluster, c, fraction, hbm, options.attention, e / 2)
    out_fwd, out_bwd, out_wgrad = output_layer_seconds(spec, cluster, c, fraction, hbm)
    full, selective = (c.recompute == 2).double(), (c.recompute == 1).double() * (not flash)
    gemm_fwd = layers * (one["gemm_fwd"] + one["attn_fwd"]) + last * out_fwd
    # what recomputation runs again: under full, the layer's forward, less what follows its last saved tensor where
    # the checkpoint stops there (PyTorch's non-reentrant checkpoint since 2.1, pytorch/pytorch#96866)
    stop = float(options.checkpoint_early_stop)
    again = one["gemm_fwd"] + one["attn_fwd"] - stop * one["tail_gemm"]  # the products full recomputation runs
    redo = layers * (full * (again + one["elem_fwd"] - stop * one["tail_elem"])
                     + selective * (one["attn_fwd"] + one["scores_fwd"]))
    gemm_bwd = layers * (one["gemm_bwd"] + one["attn_bwd"]) + last * out_bwd
    elem_fwd, elem_bwd = layers * one["elem_fwd"], layers * one["elem_bwd"]
    hbm_rate = cluster.hbm_bw_gbps * 1e9 * hbm  # bytes/s of the memory-bound passes over the model states
    # gradients added into a separate sum after each backward (the recipe's `accumulate` bytes per parameter)
    accumulate_s = (psi_dense + psi_expert) * recipe.accumulate / hbm_rate
    forward_s, backward_s = gemm_fwd + elem_fwd, gemm_bwd + elem_bwd + redo + accumulate_s

    dp_overlap = torch.as_tensor(options.overlap) & ((p == 1) | options.overlap_with_pipeline)  # per layout
    comm = stage_communication(spec, cluster, c, m, first, last, layers, one, recipe, dp_overlap, options.link,
                               options.scatter_gather, psi_dense, psi_expert, forward_s, backward_s,
                               options.async_tp_backward, out_wgrad)
    micro = forward_s + backward_s + comm.tp + comm.cp + comm.ep  # one micro-batch on this stage
    bubble = (p - 1) / v * micro
    optimizer_s = sharded * (2 * recipe.optimizer + recipe.grads + e) / hbm_rate
    offloaded = sharded * (c.offload > 0)
    cpu_adam = offloaded * (2 * recipe.optimizer + recipe.grads + e) / (cluster.host_mem_bw_gbps * 1e9)
    grads_down = offloaded * recipe.grads / (cluster.pcie_bw_gbps * 1e9)
    offload_s = cpu_adam + offloaded * e / (cluster.pcie_bw_gbps * 1e9) + exposed(grads_down, backward_s,
                                                                                    options.overlap)
    compute = m * (gemm_fwd + gemm_bwd + layers * full * again + layers * selective * one["attn_fwd"])
    time = StepTime(compute, m * (forward_s + backward_s) - compute, m * comm.tp, m * comm.cp, m * comm.ep, bubble,
                    comm.pp, comm.dp, torch.where(c.offload > 0, 0.0, optimizer_s), offload_s)
    sent = Traffic(comm.dp_sent, comm.tp_sent, comm.pp_sent, comm.cp_sent, comm.ep_sent,
                   offloaded * (recipe.grads + e))
    out = Costs(mem, sent, time, m, mfu(spec, cluster, c, global_batch, time.total))
    return (out, comm.collectives) if collectives else out
