"""Choose a layout: split a training job over d x t x p GPUs, with its cost predicted before it runs.

Notation (the course's): Psi parameters, L layers, h hidden size, a heads, V vocabulary, s sequence
length, B global batch (sequences), b micro-batch, m micro-batches per step on each data-parallel
rank (B = d b m), d data-parallel size, t tensor-parallel size, p pipeline stages, N = d t p GPUs.
Ranks are numbered tp fastest, then dp, then pp (Megatron-LM's order): a TP group is t neighbouring
GPUs, a DP group spans t*d of them, a PP group all N.

Memory of the busiest GPU (stage 0, or the last stage when the output layer weighs more):
  model states  Psi_r = Psi_split / t + Psi_replicated of its stage (L/p layers; the embedding on
                stage 0, the output layer on stage p-1), under ZeRO stage z over its DP group:
                16 Psi_r, 4 Psi_r + 12 Psi_r/d, 2 Psi_r + 14 Psi_r/d, 16 Psi_r/d bytes with
                mixed-precision Adam (memory.zero_model_state_bytes; ZeRO, arXiv 1910.02054, Fig. 1).
  activations   per layer and micro-batch (memory.activation_bytes_per_layer; Korthikanti et al.,
                arXiv 2205.05198, Sec. 4-5): s b h (34 + 5 a s/h) at t = 1; with TP
                s b h (10 + 24/t + 5 a s/(h t)), with sequence parallelism all of it / t;
                selective recomputation keeps 34 s b h (same scaling), full recomputation 2 s b h.
                FlashAttention (arXiv 2205.14135) never stores the s x s scores either: count it as selective.
                Times L/p layers and the micro-batches a stage holds: min(p, m) on stage 0 with 1F1B
                (Narayanan et al., arXiv 2104.04473). The last stage adds its fp32 logits, 4 s b V / t.
  buffers       ZeRO-3 gathers the 16-bit parameters of at most two layers at a time (FSDP's rate
                limiter, arXiv 2304.11277).
  Nothing is kept for the CUDA context or allocator fragmentation: ask with `reserve_gib`.

Step time = compute + TP + bubble + exposed DP + PP:
  compute       6 Psi B s FLOPs (2 forward + 4 backward per parameter and token; Kaplan et al.,
                arXiv 2001.08361), 8 Psi B s with full recomputation (one more forward, as counted
                in arXiv 2104.04473), selective recomputation adds the attention core 4 B s^2 h L;
                divided by N * peak * efficiency. Default efficiency 0.5: Megatron-LM reached 52% of
                peak on 3072 A100s (arXiv 2104.04473, abstract).
  TP            per micro-batch and layer 4 all-reduces of b s h elements (2 forward, 2 backward;
                Megatron, arXiv 1909.08053), 6 with full recomputation; one more for the embedding
                (stage 0) and one for the output layer (stage p-1), and 3 of b s fp32 numbers for the
                vocabulary-parallel loss. Sequence parallelism sends the same bytes (reduce-scatter +
                all-gather), plus one all-reduce of the replicated parameters' gradients per step.
  bubble        (compute + TP) (p-1)/m: the idle fraction (p-1)/(m+p-1) of 1F1B and GPipe.
  DP            per step over the DP group, Psi_r elements: ZeRO 0 all-reduce of gradients; 1
                reduce-scatter + all-gather of parameters; 2 a reduce-scatter per micro-batch + one
                all-gather; 3 per micro-batch 2 all-gathers + 1 reduce-scatter (layer by layer).
                (1 - overlap) of it is exposed (default: none hidden behind backward).
  PP            2 (m + p - 2) point-to-point messages of b s h elements on the critical path.
  Collectives follow the ring alpha-beta model (comm.AlphaBeta): 2(n-1) or (n-1) steps of
  alpha + S/(n B), B being the intra-node bandwidth when the group fits in one node, else the
  inter-node one (per GPU, one direction). Bytes sent per GPU: 2(n-1)/n S or (n-1)/n S.
MFU = 6 Psi B s / (step time * N * peak): recomputation is not useful work (MFU as PaLM defines it,
arXiv 2204.02311).

    spec = ModelSpec.preset("llama-70b")                       # or ModelSpec.from_hf("config.json")
    cluster = Cluster(n_nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    result = plan(spec, cluster, global_batch=256)              # raises NoLayoutFits if nothing fits
    print(result.table(5)); print(result.explain())
    one = predict(spec, cluster, Layout(dp=16, zero=3, recompute="full"), global_batch=256)

`python -m shardlib plan --model llama-70b --gpus 16 --gpu-mem 80` prints the same.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from shardlib import memory
from shardlib.comm import AlphaBeta
from shardlib.plan.inputs import PRESETS, Cluster, GiB, Layout, ModelSpec, count_text, load_model  # noqa: F401  (this module's API)
from shardlib.plan.report import explain, format_table

RECOMPUTE = (None, "selective", "full")
REPLICATED_ACTIVATIONS = 10  # the 10 of s b h (10 + 24/t + 5 a s/(h t)): outside the TP regions (arXiv 2205.05198)


@dataclass(slots=True)
class Estimate:
    """What a layout costs on its busiest GPU: bytes, bytes sent per step, seconds per step."""

    layout: Layout
    n_micro: int  # m: micro-batches per step on each data-parallel rank
    model_state_bytes: float
    activation_bytes: float
    buffer_bytes: float  # ZeRO-3's gathered layers
    dp_sent_bytes: float  # sent per GPU and step, over its DP group
    tp_sent_bytes: float
    pp_sent_bytes: float
    compute_s: float
    tp_s: float
    bubble_s: float
    dp_s: float  # exposed part
    pp_s: float
    mfu: float
    fits: bool
    reason: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes + self.buffer_bytes

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_s + self.bubble_s + self.dp_s + self.pp_s

    @property
    def sent_bytes(self) -> float:
        return self.dp_sent_bytes + self.tp_sent_bytes + self.pp_sent_bytes


class NoLayoutFits(ValueError):
    """No layout fits in memory; `smallest` is the estimate that comes closest."""

    def __init__(self, message: str, smallest: Estimate):
        super().__init__(message)
        self.smallest = smallest


# ---------------------------------------------------------------------------------
# the cost model, on columns of candidate layouts (float64 tensors: one row per layout)

COLUMNS = ("dp", "tp", "pp", "zero", "micro_batch", "recompute", "sp")  # recompute: index into RECOMPUTE
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
ZERO_DP_CALLS = (  # per ZeRO stage: (collective, S in bytes per parameter: "p"aram or "g"rad, calls per step)
    (("all_reduce", "g", "1"),),
    (("reduce_scatter", "g", "1"), ("all_gather", "p", "1")),
    (("reduce_scatter", "g", "m"), ("all_gather", "p", "1")),  # one reduce-scatter per micro-batch
    (("all_gather", "p", "2m"), ("reduce_scatter", "g", "m")),  # gather for forward and backward
)


def _per_value(fn, keys):
    """fn(key) for each row's key (a tensor of small non-negative integers), one call per distinct key."""
    distinct = keys.unique().long()
    table = torch.zeros(int(distinct.max()) + 1, dtype=torch.float64)
    table[distinct] = torch.tensor([float(fn(int(key))) for key in distinct], dtype=torch.float64)
    return table[keys.long()]


class _Ring:
    """comm.AlphaBeta for a column of group sizes n: per row, steps(n) and steps(n)/n of each
    collective, read from AlphaBeta once per distinct n; and the bytes a GPU sends."""

    def __init__(self, n, bandwidth, alpha: float):
        self.n, self.bandwidth, self.alpha = n, bandwidth, alpha
        self.steps = {kind: _per_value(lambda size: AlphaBeta(1.0, math.inf).time(kind, 0.0, size), n)
                      for kind in COLLECTIVES}
        self.per_byte = {kind: _per_value(lambda size: AlphaBeta(0.0, 1.0).time(kind, 1.0, size), n)
                         for kind in COLLECTIVES}

    def time(self, kind: str, nbytes):
        """Seconds of a ring collective on a tensor of S = nbytes: steps (alpha + S / (n B))."""
        return self.steps[kind] * self.alpha + self.per_byte[kind] * nbytes / self.bandwidth

    def sent(self, kind: str, nbytes):
        """Bytes one GPU sends: 2 (n-1)/n S (all-reduce) or (n-1)/n S (as comm.ring_sent_bytes, unpadded)."""
        return (2 if kind == "all_reduce" else 1) * (self.n - 1) / self.n * nbytes


def _shared_costs(spec: ModelSpec, cluster: Cluster, c: dict, global_batch: int, recipe, efficiency) -> dict:
    """What every pipeline stage of a layout has in common."""
    d, t, p, z, b, sp, rc = c["dp"], c["tp"], c["pp"], c["zero"], c["micro_batch"], c["sp"], c["recompute"]
    s, h, g = spec.seq_len, spec.hidden, cluster.gpus_per_node

    def link(span):  # bandwidth of a group of `span` consecutive ranks: inside one node, or across nodes
        return torch.where((span <= g) & (g % span == 0), cluster.intra_bw_gbps, cluster.inter_bw_gbps) * 1e9

    alpha = cluster.alpha_us * 1e-6
    tokens = global_batch * s
    model_flops = 6 * spec.psi * tokens
    flops = model_flops * torch.where(rc == 2, 8 / 6, 1.0) + (rc == 1) * 4 * tokens * s * h * spec.n_layer
    by_mode = []  # activations of one layer and micro-batch on one GPU, for each recompute mode
    for mode in RECOMPUTE:
        whole = memory.activation_bytes_per_layer(s, b, h, spec.n_head, mode)  # at t = 1
        if mode == "full":  # only the layer input is kept: split by sequence parallelism alone
            by_mode.append(whole / torch.where(sp > 0, t, 1.0))
        else:  # 10 s b h stay whole on every TP rank unless sequence parallel; the rest is / t
            kept = (1 - sp) * REPLICATED_ACTIVATIONS * s * b * h
            by_mode.append(kept + (whole - kept) / t)
    per_layer = torch.where(rc == 0, by_mode[0], torch.where(rc == 1, by_mode[1], by_mode[2]))
    return dict(
        m=global_batch / (d * b), bsh=b * s * h, model_flops=model_flops,
        compute_s=flops / (d * t * p * cluster.peak_tflops * 1e12 * efficiency),
        activations_per_layer=per_layer * recipe.params / 2,  # the formulas count 16-bit activations
        zero_bytes_per_param=_per_value(  # memory.zero_model_state_bytes is linear in Psi: read its slope
            lambda key: memory.zero_model_state_bytes(1.0, key // 4, key % 4, recipe)["total"], 4 * d + z),
        tp_ring=_Ring(t, link(t), alpha), dp_ring=_Ring(d, link(t * d), alpha),
        pp_link=link(t * d * p), alpha=alpha)


def _stage_costs(spec: ModelSpec, c: dict, x: dict, k, recipe, overlap: float) -> dict:
    """Memory, bytes sent and seconds of the GPUs of stage k (a tensor of stage indices, one per row)."""
    d, t, p, z, b, sp, rc = c["dp"], c["tp"], c["pp"], c["zero"], c["micro_batch"], c["sp"], c["recompute"]
    s, V, m, bsh = spec.seq_len, spec.vocab_size, x["m"], x["bsh"]
    e, eg = recipe.params, recipe.grads  # bytes per parameter (and activation element), per gradient
    first, last, layers = (k == 0).double(), (k == p - 1).double(), spec.n_layer / p
    split, replicated = spec.stage_params(first, last, layers)
    psi_r = split / t + replicated  # parameters one GPU of the stage keeps

    in_flight = torch.minimum(p - k, m)  # 1F1B: stage k holds p - k micro-batches
    activations = layers * x["activations_per_layer"] * in_flight + last * 4 * s * b * V / t  # + fp32 logits
    layer_split, layer_replicated = spec.layer_params()
    buffers = ((z == 3) & (d > 1)) * 2 * (layer_split / t + layer_replicated) * e  # two gathered layers

    tp_ring, dp_ring = x["tp_ring"], x["dp_ring"]
    tp_calls = layers * torch.where(rc == 2, 6.0, 4.0) + first + last  # b s h all-reduces per micro-batch
    tp_sent = m * (tp_calls * tp_ring.sent("all_reduce", bsh * e) + last * 3 * tp_ring.sent("all_reduce", b * s * 4))
    tp_sent = tp_sent + sp * tp_ring.sent("all_reduce", replicated * eg)  # sequence-parallel weights' grads
    tp_s = m * (tp_calls * tp_ring.time("all_reduce", bsh * e) + last * 3 * tp_ring.time("all_reduce", b * s * 4))
    tp_s = tp_s + sp * tp_ring.time("all_reduce", replicated * eg)

    units = torch.where(z == 3, layers + 1, 1.0)  # ZeRO-3 gathers and reduces layer by layer
    dp_sent, dp_s = torch.zeros_like(psi_r), torch.zeros_like(psi_r)
    for stage, calls_of_stage in enumerate(ZERO_DP_CALLS):
        for kind, dtype, calls in calls_of_stage:
            count = {"1": 1.0, "m": m, "2m": 2 * m}[calls] * (z == stage)
            nbytes = psi_r * (e if dtype == "p" else eg)
            dp_sent = dp_sent + count * dp_ring.sent(kind, nbytes)
            dp_s = dp_s + count * units * dp_ring.time(kind, nbytes / units)

    sends = (k < p - 1).double() + (k > 0).double()
    pp_s = (p > 1) * 2 * (m + p - 2) * (x["alpha"] + bsh * e / x["pp_link"])
    bubble = (x["compute_s"] + tp_s) * (p - 1) / m
    return dict(model_state_bytes=x["zero_bytes_per_param"] * psi_r, activation_bytes=activations,
                buffer_bytes=buffers, dp_sent_bytes=dp_sent, tp_sent_bytes=tp_sent, pp_sent_bytes=sends * m * bsh * e,
                compute_s=x["compute_s"], tp_s=tp_s, bubble_s=bubble, dp_s=dp_s * (1 - overlap), pp_s=pp_s)


def evaluate(spec: ModelSpec, cluster: Cluster, columns: dict, global_batch: int, recipe="mixed_adam",
             efficiency: float = 0.5, overlap: float = 0.0, stage: int | None = None) -> dict:
    """Every cost of every row of `columns` (dict of COLUMNS -> sequences), as float64 tensors.

    stage=None: the busiest GPU (the memory of the stage that needs most, the most bytes and
    seconds of any stage); stage=k: the GPUs of pipeline stage k.
    """
    recipe = memory.get_recipe(recipe)
    c = {key: torch.as_tensor(columns[key], dtype=torch.float64) for key in COLUMNS}
    x = _shared_costs(spec, cluster, c, global_batch, recipe, efficiency)
    p, ones = c["pp"], torch.ones_like(c["pp"])
    first, last, middle = 0 * ones, p - 1, torch.minimum(ones, p - 1)
    stages = [ones * stage] if stage is not None else [first, last, middle]
    costs = [_stage_costs(spec, c, x, k, recipe, overlap) for k in stages]
    totals = torch.stack([y["model_state_bytes"] + y["activation_bytes"] + y["buffer_bytes"] for y in costs])
    busiest = totals.argmax(0, keepdim=True)  # (1, rows): which stage's memory to report
    out = {key: torch.stack([y[key] for y in costs]).gather(0, busiest)[0]
           for key in ("model_state_bytes", "activation_bytes", "buffer_bytes")}
    for key in ("dp_sent_bytes", "tp_sent_bytes", "pp_sent_bytes", "compute_s", "tp_s", "bubble_s", "dp_s", "pp_s"):
        out[key] = torch.stack([y[key] for y in costs]).amax(0)
    step = sum(out[key] for key in ("compute_s", "tp_s", "bubble_s", "dp_s", "pp_s"))
    out["mfu"] = x["model_flops"] / (step * (c["dp"] * c["tp"] * p) * cluster.peak_tflops * 1e12)
    out["n_micro"] = x["m"]
    return out


# ---------------------------------------------------------------------------------
# one layout, or all of them


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _check_batch(global_batch) -> None:
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer (sequences per step), got {global_batch!r}")


def _check_options(cluster: Cluster, efficiency: float, overlap: float, reserve_gib: float) -> None:
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], the fraction of peak FLOP/s reached; got {efficiency!r}")
    if not 0 <= overlap < 1:
        raise ValueError(f"overlap must be in [0, 1), the fraction of DP communication hidden; got {overlap!r}")
    if not 0 <= reserve_gib < cluster.gpu_mem_gib:
        raise ValueError(f"reserve_gib must be in [0, {cluster.gpu_mem_gib:g}) GiB, got {reserve_gib!r}")


def check_layout(spec: ModelSpec, cluster: Cluster, layout: Layout, global_batch: int) -> None:
    """Raise ValueError, saying what to change, for a layout that cannot run."""
    _check_batch(global_batch)
    d, t, p, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    problems = []
    if min(d, t, p, b) < 1:
        problems.append(f"dp, tp, pp and micro_batch must be >= 1 (got {d}, {t}, {p}, {b})")
    elif d * t * p != cluster.n_gpus:
        problems.append(f"dp*tp*pp = {d * t * p} but the cluster has {cluster.n_gpus} GPUs")
    elif global_batch % (d * b):
        problems.append(f"global batch {global_batch} is not a multiple of dp*micro_batch = {d * b}")
    if t >= 1 and (spec.n_head % t or spec.kv_heads % t or spec.ffn % t):
        problems.append(f"tp={t} must divide the heads ({spec.n_head}, {spec.kv_heads} key/value) and "
                        f"the MLP size ({spec.ffn})")
    if p >= 1 and spec.n_layer % p:
        problems.append(f"pp={p} must divide the {spec.n_layer} layers")
    if layout.zero not in (0, 1, 2, 3) or layout.recompute not in RECOMPUTE:
        problems.append(f"zero must be 0..3 and recompute one of {RECOMPUTE}")
    if layout.sequence_parallel and t > 1 and spec.seq_len % t:
        problems.append(f"sequence parallelism needs tp={t} to divide the sequence length {spec.seq_len}")
    if problems:
        raise ValueError(f"layout {layout} cannot run: " + "; ".join(problems))


def predict(spec: ModelSpec, cluster: Cluster, layout: Layout, global_batch: int, *, recipe="mixed_adam",
            efficiency: float = 0.5, overlap: float = 0.0, stage: int | None = None,
            reserve_gib: float = 0.0) -> Estimate:
    """The costs of one layout: on its busiest GPU, or (stage=k) on a GPU of pipeline stage k.
    Options as plan's; recipe: a name of memory.TRAINING_RECIPES or a memory.Recipe."""
    _check_options(cluster, efficiency, overlap, reserve_gib)
    check_layout(spec, cluster, layout, global_batch)
    if stage is not None and not 0 <= stage < layout.pp:
        raise ValueError(f"stage must be in 0..{layout.pp - 1}, got {stage}")
    row = {"dp": [layout.dp], "tp": [layout.tp], "pp": [layout.pp], "zero": [layout.zero],
           "micro_batch": [layout.micro_batch], "recompute": [RECOMPUTE.index(layout.recompute)],
           "sp": [float(layout.sequence_parallel and layout.tp > 1)]}
    out = evaluate(spec, cluster, row, global_batch, recipe, efficiency, overlap, stage)
    return _estimates(out, [layout], cluster, reserve_gib)[0]


def _estimates(out: dict, layouts: list[Layout], cluster: Cluster, reserve_gib: float) -> list[Estimate]:
    usable = (cluster.gpu_mem_gib - reserve_gib) * GiB
    names = ("n_micro", "model_state_bytes", "activation_bytes", "buffer_bytes", "dp_sent_bytes", "tp_sent_bytes",
             "pp_sent_bytes", "compute_s", "tp_s", "bubble_s", "dp_s", "pp_s", "mfu")
    columns = [out[name].tolist() for name in names]
    estimates = []
    for layout, values in zip(layouts, zip(*columns)):
        x = dict(zip(names, values))
        x["n_micro"] = int(round(x["n_micro"]))
        total = x["model_state_bytes"] + x["activation_bytes"] + x["buffer_bytes"]
        fits = total <= usable
        reason = "" if fits else (
            f"needs {total / GiB:.1f} GiB > {usable / GiB:.1f} GiB: model states {x['model_state_bytes'] / GiB:.1f}, "
            f"activations {x['activation_bytes'] / GiB:.1f}, buffers {x['buffer_bytes'] / GiB:.1f}")
        estimates.append(Estimate(layout, fits=fits, reason=reason, **x))
    return estimates


def candidate_layouts(spec: ModelSpec, cluster: Cluster, global_batch: int, *, zero_stages=(0, 1, 2, 3),
                      recompute=RECOMPUTE, sequence_parallel=(False, True), micro_batches=None,
                      tp_within_node: bool = False) -> list[Layout]:
    """Every layout that can run: dp*tp*pp = N, tp dividing heads and MLP, pp dividing the layers,
    dp*micro_batch dividing the global batch; ZeRO only when dp > 1; sequence parallelism only with tp > 1."""
    _check_batch(global_batch)
    n, g = cluster.n_gpus, cluster.gpus_per_node
    out = []
    for t in _divisors(n):
        if spec.n_head % t or spec.kv_heads % t or spec.ffn % t or (tp_within_node and (t > g or g % t)):
            continue
        for p in _divisors(n // t):
            d = n // (t * p)
            if spec.n_layer % p or global_batch % d:
                continue
            sizes = [b for b in _divisors(global_batch // d) if micro_batches is None or b in micro_batches]
            sp_choices = sequence_parallel if t > 1 and spec.seq_len % t == 0 else (False,)
            for b, z, r, sp in itertools.product(sizes, zero_stages if d > 1 else (0,), recompute, sp_choices):
                out.append(Layout(d, t, p, z, b, r, sp))
    return out


@dataclass
class Plan:
    """Layouts that fit, fastest first (`ranked`), and those that do not, each with its `reason`."""

    spec: ModelSpec
    cluster: Cluster
    global_batch: int
    ranked: list[Estimate]
    rejected: list[Estimate] = field(repr=False)

    @property
    def best(self) -> Estimate:
        return self.ranked[0]

    def runner_up(self) -> Estimate | None:
        """The fastest layout with another mesh (dp, tp, pp) than the best."""
        shape = lambda e: (e.layout.dp, e.layout.tp, e.layout.pp)  # noqa: E731
        return next((e for e in self.ranked[1:] if shape(e) != shape(self.best)), None)

    def table(self, k: int = 10) -> str:
        return format_table(self.ranked[:k], self.cluster)

    def explain(self) -> str:
        return explain(self)


def plan(spec: ModelSpec, cluster: Cluster, global_batch: int, *, recipe="mixed_adam", efficiency: float = 0.5,
         overlap: float = 0.0, reserve_gib: float = 0.0, **choices) -> Plan:
    """Enumerate the layouts, predict each, rank those that fit by step time (then memory).

    recipe: bytes per parameter of the model states (memory.TRAINING_RECIPES); efficiency: the
    fraction of peak FLOP/s the matmuls reach; overlap: the fraction of DP communication hidden
    behind backward; reserve_gib: memory per GPU kept free. `choices` narrow the enumeration:
    zero_stages, recompute, sequence_parallel, micro_batches, tp_within_node (candidate_layouts).
    Raises NoLayoutFits, naming the smallest memory any layout needs, when none fits.
    """
    _check_options(cluster, efficiency, overlap, reserve_gib)
    layouts = candidate_layouts(spec, cluster, global_batch, **choices)
    if not layouts:
        raise ValueError(f"no layout of {cluster.n_gpus} GPUs can run {spec.name} with a global batch of "
                         f"{global_batch}: tp must divide {spec.n_head} heads, pp the {spec.n_layer} layers, dp the "
                         "batch. Change the number of GPUs or the global batch.")
    columns = {"dp": [], "tp": [], "pp": [], "zero": [], "micro_batch": [], "recompute": [], "sp": []}
    for lay in layouts:
        for key, value in zip(COLUMNS, (lay.dp, lay.tp, lay.pp, lay.zero, lay.micro_batch,
                                        RECOMPUTE.index(lay.recompute), float(lay.sequence_parallel))):
            columns[key].append(value)
    estimates = _estimates(evaluate(spec, cluster, columns, global_batch, recipe, efficiency, overlap),
                           layouts, cluster, reserve_gib)
    ranked = sorted((e for e in estimates if e.fits), key=lambda e: (e.step_s, e.memory_bytes))
    rejected = [e for e in estimates if not e.fits]
    if not ranked:
        raise NoLayoutFits(_no_fit_message(spec, cluster, recipe, reserve_gib, rejected),
                           min(rejected, key=lambda e: e.memory_bytes))
    return Plan(spec, cluster, global_batch, ranked, rejected)


def _no_fit_message(spec, cluster, recipe, reserve_gib, rejected) -> str:
    smallest = min(rejected, key=lambda e: e.memory_bytes)
    states = memory.training_bytes(spec.psi, recipe)["total"]
    usable = cluster.gpu_mem_gib - reserve_gib
    return (f"no layout of {spec.name} ({count_text(spec.psi)} parameters) fits {cluster.n_gpus} x "
            f"{usable:g} GiB: the smallest needs {smallest.memory_bytes / GiB:.1f} GiB per GPU "
            f"({smallest.layout}: model states {smallest.model_state_bytes / GiB:.1f}, activations "
            f"{smallest.activation_bytes / GiB:.1f}). The model states alone are {states / GiB:.0f} GiB with "
            f"{memory.get_recipe(recipe).total:g} bytes per parameter ({getattr(recipe, 'copies', recipe)}), "
            f"at least {math.ceil(states / (usable * GiB))} GPUs of {usable:g} GiB. Add GPUs, use fewer bytes per "
            f"parameter (recipes: {', '.join(memory.TRAINING_RECIPES)}), or shorter sequences.")
