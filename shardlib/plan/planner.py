"""Choose a layout: enumerate the ways to split a training job over N GPUs, predict each with the
cost model (shardlib/plan/cost.py: formulas and sources), keep what fits, rank by step time.

    spec = ModelSpec.preset("llama-70b")                       # or ModelSpec.from_hf("config.json")
    cluster = Cluster(n_nodes=2, gpus_per_node=8, gpu_mem_gib=80)   # or Cluster.of(16, gpu="h100")
    result = plan(spec, cluster, global_batch=256)              # raises NoLayoutFits if nothing fits
    print(result.table(5)); print(result.explain())
    one = predict(spec, cluster, Layout(dp=16, zero=3, recompute="full"), global_batch=256)
    fixed = plan(spec, cluster, 256, tp=8, max_pp=4)             # filters narrow the search

`python -m shardlib plan --model llama-70b --gpus 16` prints the same; `--evaluate` with `--tp --pp ...`
prints one layout's breakdown. What can run is decided in shardlib/plan/rules.py.

What it predicts is what Megatron-LM, Megatron-Core and Llama 3's training code reach: its constants are fitted
on such runs and held against others (`--validate`). Another engine can be slower at the same layout: MT-NLG on
DeepSpeed's pipeline engine was predicted 18-22% fast (published.MT_NLG_MISS). On PyTorch FSDP as MosaicML
ran it (shardlib/plan/mosaic.py, with its Triton attention kernel: attention="flash-triton") the error leans by
recomputation: runs without it mostly take longer than predicted, runs with it mostly less (validate.lean_lines),
and where the same model ran on the same GPUs with and without it, dropping it bought less than predicted in every
pair (validate.checkpointing_pairs): there the planner overrates dropping activation checkpointing. Rank layouts
with it, and measure a step before trusting its seconds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from shardlib import memory
from shardlib.plan.cost import DEFAULT_ATTENTION, FITTED, Costs, Layouts, Options, costs
from shardlib.plan.inputs import CP_METHODS, RECOMPUTE, Cluster, GiB, Layout
from shardlib.plan.model import ModelSpec, count_text
from shardlib.plan.report import explain, format_table
from shardlib.plan.rules import check_batch, check_options, check_layout


# The share of a GPU's memory a recommended layout leaves free: in 454 runs of 4D-parallel training on A100s and
# H100s, none ran out of memory where the estimate (model states, activations, temporary buffers and NCCL's, as
# cost.py counts them) was below 80% of the GPU (Fujii, Watanabe and Yokota, arXiv 2411.06465, abstract): what
# the estimate leaves out (the allocator's fragmentation, transient copies) lives in the last fifth.
HEADROOM = 0.2


@dataclass
class Estimate:
    """What a layout costs on one GPU (its busiest, or the stage asked for): `costs.memory` (bytes),
    `costs.sent` (bytes per step by group), `costs.time` (seconds per step by part), MFU. `tight`: it fits, but
    only in the headroom (HEADROOM) a recommended layout leaves free."""

    layout: Layout
    costs: Costs
    fits: bool
    reason: str = ""
    tight: bool = False

    @property
    def memory_bytes(self) -> float:
        return self.costs.memory.total

    @property
    def step_s(self) -> float:
        return self.costs.time.total

    @property
    def sent_bytes(self) -> float:
        return self.costs.sent.total

    @property
    def mfu(self) -> float:
        return self.costs.mfu

    @property
    def n_micro(self) -> int:
        return int(round(self.costs.n_micro))

    # the flat names lessons and labs read
    model_state_bytes = property(lambda self: self.costs.memory.model_states)
    activation_bytes = property(lambda self: self.costs.memory.activations)
    buffer_bytes = property(lambda self: self.costs.memory.buffers)
    dp_sent_bytes = property(lambda self: self.costs.sent.dp)
    tp_sent_bytes = property(lambda self: self.costs.sent.tp)
    pp_sent_bytes = property(lambda self: self.costs.sent.pp)
    compute_s = property(lambda self: self.costs.time.compute)
    tp_s = property(lambda self: self.costs.time.tp)
    bubble_s = property(lambda self: self.costs.time.bubble)
    dp_s = property(lambda self: self.costs.time.dp)
    pp_s = property(lambda self: self.costs.time.pp)


class NoLayoutFits(ValueError):
    """No layout fits in memory; `smallest` is the estimate that comes closest."""

    def __init__(self, message: str, smallest: Estimate):
        super().__init__(message)
        self.smallest = smallest


# ---------------------------------------------------------------------------------
# one layout


def _row(lay: Layout) -> tuple:
    return (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, lay.micro_batch, RECOMPUTE.index(lay.recompute),
            float(lay.sequence_parallel and lay.tp > 1), float(CP_METHODS.index(lay.cp_method)), lay.virtual_stages,
            float(lay.offload), float(lay.tp_overlap))


def _layout(row: tuple) -> Layout:
    d, t, p, c, e, z, b, r, sp, method, v, off, ovl = row
    return Layout(dp=int(d), tp=int(t), pp=int(p), zero=int(z), micro_batch=int(b), recompute=RECOMPUTE[int(r)],
                  sequence_parallel=bool(sp), cp=int(c), cp_method=CP_METHODS[int(method)], ep=int(e),
                  virtual_stages=int(v), offload=bool(off), tp_overlap=bool(ovl))


def predict(spec: ModelSpec, cluster: Cluster, layout: Layout, global_batch: int, *, recipe="mixed_adam",
            efficiency: float | None = None, overlap: bool = True, attention: str = DEFAULT_ATTENTION,
            stage: int | None = None, reserve_gib: float = 0.0, headroom: float = HEADROOM,
            link_efficiency: tuple = (FITTED["nvlink"], FITTED["network"]),
            hbm_efficiency: float = FITTED["hbm"], scatter_gather: bool = True,
            overlap_with_pipeline: bool = True, async_tp_backward: bool = True,
            checkpoint_early_stop: bool = False) -> Estimate:
    """The costs of one layout: on its busiest GPU, or (stage=k) on a GPU of pipeline stage k.
    Options as plan's; recipe: a name of memory.TRAINING_RECIPES or a memory.Recipe."""
    check_options(cluster, efficiency, overlap, reserve_gib, attention, scatter_gather, overlap_with_pipeline,
                  headroom, async_tp_backward, checkpoint_early_stop)
    check_layout(spec, cluster, layout, global_batch)
    if stage is not None and not 0 <= stage < layout.pp:
        raise ValueError(f"stage must be in 0..{layout.pp - 1}, got {stage}")
    options = Options(recipe, efficiency, overlap, attention, link_efficiency, hbm_efficiency, scatter_gather,
                      overlap_with_pipeline, async_tp_backward, checkpoint_early_stop)
    out = costs(spec, cluster, Layouts.from_rows([_row(layout)]), global_batch, options, stage)
    return _Estimates(out, [_row(layout)], cluster, reserve_gib, headroom)[0]


def _limits(cluster: Cluster, reserve_gib: float, headroom: float) -> tuple[float, float]:
    """(bytes a layout may use, bytes it may use and still leave the headroom free) per GPU."""
    usable = (cluster.gpu_mem_gib - reserve_gib) * GiB
    return usable, (1 - headroom) * usable


class _Estimates(Sequence):
    """Estimates of many layouts, built when read (a search evaluates tens of thousands)."""

    def __init__(self, out: Costs, rows: list, cluster: Cluster, reserve_gib: float, headroom: float, order=None):
        self.out, self.rows = out, rows
        self.usable, self.roomy = _limits(cluster, reserve_gib, headroom)
        self.order = list(range(len(rows))) if order is None else order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.order[i]
        x = self.out.row(row)
        total = x.memory.total
        fits = total <= self.usable
        reason = "" if fits else (
            f"needs {total / GiB:.1f} GiB > {self.usable / GiB:.1f} GiB: "
            f"model states {x.memory.model_states / GiB:.1f}, "
            f"activations {x.memory.activations / GiB:.1f}, buffers {x.memory.buffers / GiB:.1f}, "
            f"CUDA context and NCCL {x.memory.runtime / GiB:.1f}")
        return Estimate(_layout(self.rows[row]), x, fits, reason, fits and total > self.roomy)


# ---------------------------------------------------------------------------------
# all of them


# all-gather context parallelism exposes what ring attention hides, so it never wins on time here: asked for by name
SEARCHED_CP_METHODS = ("ring", "ulysses")
# ZeRO stages searched inside a pipeline: DeepSpeed refuses 2 and 3 there ("ZeRO-2 and ZeRO-3 are incompatible with
# pipeline parallelism", deepspeed/runtime/pipe/engine.py), Megatron-Core pairs pipelines with its distributed
# optimizer (ZeRO-1), and PyTorch's pipeline stages keep FSDP's gradients unsharded until the last micro-batch
# (torch.distributed.pipelining: set_requires_gradient_sync). Layout.caveats() says why; zero_in_pipeline=(0, 1, 2, 3)
# costs them, once per micro-batch
PIPELINE_ZERO_STAGES = (0, 1)


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def _candidate_rows(spec: ModelSpec, cluster: Cluster, global_batch: int, *, dp=None, tp=None, pp=None, cp=None,
                    ep=None, max_tp=None, max_pp=None, max_cp=16, zero_stages=(0, 1, 2, 3), recompute=RECOMPUTE,
                    sequence_parallel=(False, True), micro_batches=None, max_micro_batch=16,
                    virtual_stages=None, cp_methods=SEARCHED_CP_METHODS, offload=(False,), tp_overlap=(False, True),
                    tp_within_node: bool = False, even_stages: bool = False, min_interleaved_pp: int = 2,
                    zero_in_pipeline=PIPELINE_ZERO_STAGES, attention: str = DEFAULT_ATTENTION) -> list[tuple]:
    check_batch(global_batch)
    n, g, L, s = cluster.n_gpus, cluster.gpus_per_node, spec.n_layer, spec.seq_len
    fixed = lambda value, size: value is None or value == size  # noqa: E731
    if attention != "unfused" and None in recompute:  # FlashAttention keeps no scores: selective is no recomputation
        recompute = [r for r in recompute if r != "selective"]
    rows = []
    for t in _divisors(n):
        if (spec.n_head % t or spec.kv_heads % t or spec.ffn % t or not fixed(tp, t) or (max_tp and t > max_tp)
                or (tp_within_node and (t > g or g % t))):
            continue
        for c in _divisors(n // t):
            methods = [0] if c == 1 else [CP_METHODS.index(x) for x in cp_methods if _cp_method_fits(spec, t, c, x)]
            if not fixed(cp, c) or (cp is None and c > max_cp) or not methods:
                continue
            for p in _divisors(n // (t * c)):
                d = n // (t * c * p)
                if (p > L or not fixed(pp, p) or not fixed(dp, d) or (max_pp and p > max_pp) or global_batch % d
                        or (even_stages and L % p)):
                    continue
                experts = [e for e in _divisors(d) if spec.moe and spec.n_experts % e == 0] or [1]
                sizes = [b for b in _divisors(global_batch // d) if (micro_batches is None and b <= max_micro_batch)
                         or (micro_batches is not None and b in micro_batches)]
                sps = [float(x) for x in sequence_parallel] if t > 1 and (s // c) % t == 0 else [0.0]
                zeros = [z for z in zero_stages if p == 1 or z in zero_in_pipeline] if d * c > 1 else (0,)
                for b in sizes:
                    m = global_batch // (d * b)
                    most = -(-L // p)  # layers of the fullest stage
                    vs = [v for v in (virtual_stages or _divisors(most)) if v == 1 or (
                        p >= min_interleaved_pp and v * p <= L + 2 and m % p == 0
                        and (virtual_stages or most % v == 0))]
                    for e, u, v in itertools.product(experts, methods, vs):
                        if not fixed(ep, e):
                            continue
                        for z, r, sp, off in itertools.product(zeros, recompute, sps, offload):
                            for ovl in ([float(x) for x in tp_overlap] if sp else [0.0]):
                                rows.append((d, t, p, c, e, z, b, RECOMPUTE.index(r), sp, u, v, float(off), ovl))
    return rows


def _cp_method_fits(spec: ModelSpec, t: int, c: int, method: str) -> bool:
    if method in ("ring", "allgather"):
        return spec.seq_len % (2 * c) == 0
    return (spec.n_head // t) % c == 0 and (spec.kv_heads // t) % c == 0


def candidate_layouts(spec: ModelSpec, cluster: Cluster, global_batch: int, **choices) -> list[Layout]:
    """Every layout that can run (check_layout's rules), narrowed by `choices`: fixed sizes dp, tp, pp,
    cp, ep; bounds max_tp, max_pp, max_cp (default 16), max_micro_batch (default 16); the options to try:
    zero_stages, recompute, sequence_parallel, micro_batches, virtual_stages (default: every count that divides
    the layers of a stage), cp_methods, offload (default (False,)), tp_overlap (default both, with sequence
    parallelism); tp_within_node; even_stages (pp must divide the layers) and min_interleaved_pp (the fewest
    stages an interleaved schedule runs on, default 2), for software that needs them; zero_in_pipeline (the ZeRO
    stages tried with pp > 1, default PIPELINE_ZERO_STAGES). ZeRO only when dp*cp > 1, sequence parallelism only
    with tp > 1."""
    return [_layout(row) for row in _candidate_rows(spec, cluster, global_batch, **choices)]


@dataclass
class Plan:
    """Layouts that fit, fastest first (`ranked`): those that leave the headroom free (HEADROOM) before those
    that fit only in it (`tight`); and those that do not fit, each with its `reason`."""

    spec: ModelSpec
    cluster: Cluster
    global_batch: int
    ranked: Sequence[Estimate]
    rejected: Sequence[Estimate] = field(repr=False)
    n_roomy: int  # how many of `ranked`, the first, leave the headroom free
    options: Options = field(default_factory=Options)
    headroom: float = HEADROOM

    @property
    def best(self) -> Estimate:
        return self.ranked[0]

    def find(self, layout: Layout) -> tuple[int | None, Estimate | None]:
        """(rank, estimate) of `layout` in this plan: rank 1 is the best; (None, estimate) when it does not
        fit, (None, None) when it is outside the search. With FlashAttention, selective recomputation is none."""
        if self.options.attention != "unfused" and layout.recompute == "selective":
            layout = replace(layout, recompute=None)
        for i, e in enumerate(self.ranked):
            if e.layout == layout:
                return i + 1, e
        return None, next((e for e in self.rejected if e.layout == layout), None)

    def runner_up(self) -> Estimate | None:
        """The fastest layout with another mesh (dp, cp, tp, pp) than the best."""
        shape = lambda e: (e.layout.dp, e.layout.cp, e.layout.tp, e.layout.pp)  # noqa: E731
        return next((e for e in self.ranked[1:50] if shape(e) != shape(self.best)), None)

    def table(self, k: int = 10) -> str:
        return format_table(self.ranked[:k], self.cluster)

    def explain(self, against: Layout | None = None) -> str:
        """Why the best layout wins; with `against`, what decides it over that layout (the single assumption)."""
        return explain(self, against)


def plan(spec: ModelSpec, cluster: Cluster, global_batch: int, *, recipe="mixed_adam",
         efficiency: float | None = None, overlap: bool = True, attention: str = DEFAULT_ATTENTION,
         reserve_gib: float = 0.0, headroom: float = HEADROOM,
         link_efficiency: tuple = (FITTED["nvlink"], FITTED["network"]),
         hbm_efficiency: float = FITTED["hbm"], scatter_gather: bool = True, overlap_with_pipeline: bool = True,
         async_tp_backward: bool = True, checkpoint_early_stop: bool = False, **choices) -> Plan:
    """Enumerate the layouts, predict each, rank those that fit by step time (then memory): first those whose
    estimate leaves `headroom` of the GPU free, then those that fit only in it (Estimate.tight).

    recipe: bytes per parameter of the model states (memory.TRAINING_RECIPES); efficiency: the
    fraction of the GPU's measured matmul ceiling its products reach (default: the cluster's fitted
    matmul_fraction); overlap: overlap data-parallel communication with compute, as PyTorch's DDP and FSDP
    and Megatron's --overlap-grad-reduce do (default), paying the overlap rule of shardlib/plan/links.py;
    attention: "fused" (default: Transformer Engine's fused attention, cuDNN's kernel on Hopper and FlashAttention-2
    elsewhere), "flash" (FlashAttention-2), "flash-triton" (FlashAttention's Triton kernel, as MosaicML's benchmarks
    ran it: shardlib/plan/mosaic.py), each at its published benchmark speed (shardlib/plan/attention.py), or
    "unfused" (the scores written out, as Megatron-LM in 2021-22);
    reserve_gib: memory per GPU kept free; headroom: the share of the rest a recommended layout leaves
    free (default 0.2: no out-of-memory error below 80% in arXiv 2411.06465's 454 runs; 0 ranks every layout
    that fits by time alone); link_efficiency (inside a node, across),
    hbm_efficiency: the fractions of the links' and of HBM's bandwidth reached (fitted,
    shardlib/plan/fitted.py); scatter_gather: pipeline messages split over the tensor-parallel ranks and
    all-gathered by the receivers (arXiv 2104.04473, Sec. 4.1; False: each rank sends the whole activation, as
    Megatron-LM did before February 2021); overlap_with_pipeline: False where the framework overlaps
    data-parallel traffic only without a pipeline (Megatron-LM in 2021); async_tp_backward: each column-parallel
    layer's input-gradient collective runs beside its weight-gradient product (Megatron-LM's default since
    September 2021; False: on the critical path, as in Megatron-LM before it and Megatron-DeepSpeed's forks of
    it; shardlib/plan/cost_comm.py); checkpoint_early_stop: full recomputation stops at each layer's last saved
    tensor, so the MLP's down projection and the add after it are not run again (PyTorch's non-reentrant
    checkpoint, by default since 2.1: FSDP's checkpoint_wrapper, torchtitan; False: the whole layer again, as
    Megatron-LM's and DeepSpeed's checkpoints and PyTorch's before 2.1 do). `choices` narrow the enumeration
    (candidate_layouts). Raises NoLayoutFits, naming the smallest memory any layout needs, when none fits.
    """
    check_options(cluster, efficiency, overlap, reserve_gib, attention, scatter_gather, overlap_with_pipeline,
                  headroom, async_tp_backward, checkpoint_early_stop)
    rows = _candidate_rows(spec, cluster, global_batch, attention=attention, **choices)
    if not rows:
        raise ValueError(f"no layout of {cluster.n_gpus} GPUs can run {spec.name} with a global batch of "
                         f"{global_batch} and these choices: tp must divide {spec.n_head} heads, pp be at most the "
                         f"{spec.n_layer} layers, dp divide the batch. Change the number of GPUs, the global batch "
                         "or the filters.")
    options = Options(recipe, efficiency, overlap, attention, link_efficiency, hbm_efficiency, scatter_gather,
                      overlap_with_pipeline, async_tp_backward, checkpoint_early_stop)
    out = costs(spec, cluster, Layouts.from_rows(rows), global_batch, options)
    usable, roomy_bytes = _limits(cluster, reserve_gib, headroom)
    total, step = out.memory.total, out.time.total
    fits, roomy = total <= usable, total <= roomy_bytes
    by_memory = torch.sort(total, stable=True).indices
    ranking = by_memory[torch.sort(step[by_memory], stable=True).indices]  # by step time, then memory
    order = torch.cat([ranking[roomy[ranking]], ranking[(fits & ~roomy)[ranking]]])  # the tight ones after
    ranked = _Estimates(out, rows, cluster, reserve_gib, headroom, order.tolist())
    rejected = _Estimates(out, rows, cluster, reserve_gib, headroom, by_memory[~fits[by_memory]].tolist())
    if not len(ranked):
        raise NoLayoutFits(_no_fit_message(spec, cluster, recipe, reserve_gib, rejected[0]), rejected[0])
    return Plan(spec, cluster, global_batch, ranked, rejected, int(roomy.sum()), options, headroom)


def _no_fit_message(spec, cluster, recipe, reserve_gib, smallest: Estimate) -> str:
    states = memory.training_bytes(float(spec.psi), recipe)["total"]
    usable = cluster.gpu_mem_gib - reserve_gib
    return (f"no layout of {spec.name} ({count_text(spec.psi)} parameters) fits {cluster.n_gpus} x "
            f"{usable:g} GiB: the smallest needs {smallest.memory_bytes / GiB:.1f} GiB per GPU "
            f"({smallest.layout}: model states {smallest.model_state_bytes / GiB:.1f}, activations "
            f"{smallest.activation_bytes / GiB:.1f}, CUDA context and NCCL {smallest.costs.memory.runtime / GiB:.1f})."
            f" The model states alone are {states / GiB:.0f} GiB with "
            f"{memory.get_recipe(recipe).total:g} bytes per parameter ({getattr(recipe, 'copies', recipe)}), "
            f"at least {math.ceil(states / (usable * GiB))} GPUs of {usable:g} GiB. Add GPUs, use fewer bytes per "
            f"parameter (recipes: {', '.join(memory.TRAINING_RECIPES)}), offload the optimizer to the CPU "
            "(offload=(False, True), --offload), or shorter sequences.")
