"""Reading a plan: the ranked table and its legend, why the best layout wins, one layout's breakdown.

`format_table` prints the layouts that fit, fastest first (`LEGEND` says what each column is); `explain`
says what the best one's step time and memory go to, and what it trades against the best layout of
another mesh (`Plan.runner_up`) or against a layout you name, with the single assumption of the cost
model that decides between them (`deciding`); `breakdown` lists every part of one layout's memory, bytes
sent and step time; `as_dict` gives the same as plain numbers for JSON. The cost model and its sources
are in shardlib/plan/cost.py.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from shardlib.plan.inputs import CP_SUFFIX, RECOMPUTE, Cluster, GiB, Layout

LEGEND = (
    ("dp, cp, tp (ep)", "data-, context- (u: Ulysses, g: all-gather, else ring attention) and tensor-parallel sizes; "
                        "expert-parallel, inside dp, where a layout of the table uses it"),
    ("pp", "pipeline stages, x v: interleaved with v chunks of layers per GPU"),
    ("zero", "ZeRO stage over the dp x cp GPUs holding the same weights (1: optimizer states sharded); * a "
             "framework refuses this combination (Layout.caveats), costed anyway"),
    ("b x m", "micro-batch size x micro-batches per step on each data-parallel rank"),
    ("sp", "y: sequence parallelism, o: and its collectives overlapped with the products (tp_overlap)"),
    ("GiB/GPU, states, act", "memory per GPU: all of it (with the CUDA context and NCCL's buffers), model states, "
                             "activations (GiB); ! it fits only in the headroom a recommended layout leaves free "
                             "(20%: arXiv 2411.06465), ranked after every layout that leaves it"),
    ("step s", "predicted seconds per step; the columns after it are its parts:"),
    ("compute", "matrix products and memory-bound kernels"),
    ("tp+cp+pp", "exposed tensor-, context-, expert-parallel and pipeline communication (and CPU offload)"),
    ("bubble", "pipeline idle time"),
    ("DP s", "exposed data-parallel communication"),
    ("MFU", "model FLOPs utilization: (6 Psi_active + 12 L s h) per token x tokens per step / (step s x GPUs x "
            "peak FLOP/s)"),
)

# The assumption of the cost model behind each part of the step time (shardlib/plan/cost.py for the formulas)
ASSUMPTIONS = {
    "compute": "the matmul curve: each product at the GPU's measured ceiling times the fitted fraction, with tile "
               "and wave quantization of its per-GPU shape (gemm.py)",
    "recompute": "that the layout recomputing less keeps its activations within the GPU's memory: the activation "
                 "model (arXiv 2205.05198, compute.py) and the recipe's bytes per parameter; the forward run again "
                 "costs the other its products",
    "elementwise": "memory-bound kernels at the fitted fraction of HBM bandwidth",
    "tp": "tensor-parallel collectives (all-reduces; all-gathers and reduce-scatters with sequence parallelism) on "
          "the critical path at the fitted fraction of the link bandwidth (with tp_overlap all of them hidden by the "
          "overlap rule; without it only the backward's at the column-parallel layers' inputs, behind their weight "
          "gradients, with async_tp_backward, the default)",
    "cp": "ring-attention blocks hidden behind attention by the overlap rule (kappa = 18.9%, links.py); Ulysses' "
          "all-to-alls and the all-gather method's K, V gathers on the critical path",
    "stage balance": "the slowest pipeline stage sets the pace: its share of the layers, and on the last stage the "
                     "output layer and the loss over the whole vocabulary (cost.py, Stages); per GPU the same products",
    "ep": "expert all-to-alls on the critical path",
    "bubble": "the 1F1B bubble: (p - 1) / v micro-batch times of idle per step",
    "pp": "pipeline sends on the critical path",
    "dp": "data-parallel traffic overlapped with compute by the overlap rule (kappa = 18.9%, links.py) at the "
          "fitted fraction of the link bandwidth",
    "optimizer": "the optimizer step at HBM bandwidth",
    "offload": "CPU Adam at the host's memory bandwidth and the PCIe transfers",
    "headroom": "layouts that leave a fifth of the GPU free are ranked before those that fit only in it (planner."
                "HEADROOM: none of arXiv 2411.06465's 454 runs ran out of memory below 80% by such an estimate)",
}


def _in_one_node(span: int, gpus_per_node: int) -> bool:
    return span <= gpus_per_node and gpus_per_node % span == 0


def _time_parts(e, cluster: Cluster) -> list[tuple[str, str, float]]:
    """(field, label, seconds) of each part of the step time of an Estimate."""
    lay, g, time = e.layout, cluster.gpus_per_node, e.costs.time
    where = lambda span: "intra-node" if _in_one_node(span, g) else "inter-node"  # noqa: E731
    labels = dict(compute="compute", elementwise="memory-bound kernels", tp=f"TP communication ({where(lay.tp)})",
                  cp=f"CP communication ({where(lay.tp * lay.cp)})",
                  ep=f"EP all-to-all ({where(lay.tp * lay.cp * lay.ep)})", bubble="pipeline bubble",
                  pp=f"PP sends ({where(lay.n_gpus)})", dp=f"DP communication ({where(lay.tp * lay.cp * lay.dp)})",
                  optimizer="optimizer step", offload="CPU offload")
    return [(f.name, labels[f.name], getattr(time, f.name)) for f in fields(time)]


def _seconds(x: float) -> str:
    return f"{x:.3g}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def _gib(nbytes: float) -> str:
    x = nbytes / GiB
    return f"{x:.1f}" if x >= 0.95 or x == 0 else f"{x:.2g}"


def _free(e, cluster: Cluster) -> str:
    """The share of its GPU an estimate leaves free."""
    return f"{max(1 - e.memory_bytes / (cluster.gpu_mem_gib * GiB), 0.0):.0%}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('h') else 's'}"


def _sharding(lay: Layout) -> str:
    """How the model states are divided, in words."""
    parts, replicas = [], lay.dp * lay.cp
    group = (f"{replicas} GPUs of its data- and context-parallel group (dp {lay.dp} x cp {lay.cp})" if lay.cp > 1
             else f"{replicas} data-parallel GPUs")
    if replicas > 1:
        parts.append(f"ZeRO-{lay.zero} over the {group}" if lay.zero else f"replicated on the {group}")
    if lay.tp * lay.pp > 1:
        parts.append(f"split {lay.tp * lay.pp} ways by tp x pp")
    if lay.ep > 1:
        parts.append(f"experts split {lay.ep} ways")
    if lay.offload:
        parts.append("optimizer states in CPU memory")
    return ", ".join(parts) or "one GPU holds them all"


def legend() -> str:
    """What each column of format_table holds."""
    return "\n".join(f"  {name:<22} {what}" for name, what in LEGEND)


def format_table(estimates: list, cluster: Cluster) -> str:
    """One line per estimate: layout, memory per GPU (GiB), seconds per step and their parts, MFU (LEGEND)."""
    experts = any(e.layout.ep > 1 for e in estimates)  # a column for expert parallelism where a layout uses it
    lines = [f"{'#':>3} {'dp':>4} {'cp':>3} {'tp':>3} " + (f"{'ep':>3} " if experts else "") + f"{'pp':>5} {'zero':>4} "
             f"{'b x m':>8} {'recompute':>9} {'sp':>3} {'GiB/GPU':>8} {'states':>7} {'act':>6} {'step s':>8} "
             f"{'compute':>8} {'tp+cp+pp':>8} {'bubble':>7} {'DP s':>7} {'MFU':>5}"]
    for i, e in enumerate(estimates, 1):
        lay, time = e.layout, e.costs.time
        cp = f"{lay.cp}{CP_SUFFIX[lay.cp_method]}"
        pp = f"{lay.pp}" + (f"x{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        comm = time.tp + time.cp + time.ep + time.pp + time.offload
        sp = "o" if lay.tp_overlap else "y" if lay.sequence_parallel else "-"
        zero = f"{lay.zero}{'*' if lay.caveats() else ''}"
        lines.append(
            f"{i:>3} {lay.dp:>4} {cp:>3} {lay.tp:>3} " + (f"{lay.ep:>3} " if experts else "")
            + f"{pp:>5} {zero:>4} {f'{lay.micro_batch}x{e.n_micro}':>8} "
            f"{lay.recompute or '-':>9} {sp:>3} {_gib(e.memory_bytes) + ('!' if e.tight else ''):>8} "
            f"{_gib(e.model_state_bytes):>7} {_gib(e.activation_bytes):>6} {_seconds(e.step_s):>8} "
            f"{_seconds(time.compute + time.elementwise + time.optimizer):>8} {_seconds(comm):>8} "
            f"{_seconds(time.bubble):>7} {_seconds(time.dp):>7} {e.mfu:>5.0%}")
    return "\n".join(lines)


def deciding(best, other, cluster: Cluster) -> dict:
    """What decides `best` over `other`: the part of the step time where `other` loses most, whether that part
    alone decides (the rest of the difference favours `other` or is smaller than the gap), and its assumption."""
    deltas = [(name, label, theirs - ours) for (name, _, ours), (_, label, theirs) in
              zip(_time_parts(best, cluster), _time_parts(other, cluster))]
    name, label, most = max(deltas, key=lambda x: x[2])
    if name == "compute" and _recomputes(other.layout) > _recomputes(best.layout):  # the products it runs again
        name, label = "recompute", f"compute ({other.layout.recompute or 'no'} recomputation against "\
                                   f"{best.layout.recompute or 'none'})"
    elif name == "compute" and _products(other.layout) == _products(best.layout):  # the same shapes: another split
        name, label = "stage balance", f"compute (the slowest of {other.layout.pp} stages against " \
                                       f"{best.layout.pp})"
    gap = other.step_s - best.step_s
    return dict(field=name, label=label, seconds=most, gap=gap, single=most >= gap and gap > 0,
                assumption=ASSUMPTIONS[name])


def _products(lay: Layout) -> tuple:
    """What sets the shapes and the count of one GPU's products per micro-batch but the layers of its stage."""
    return lay.tp, lay.cp, lay.ep, lay.micro_batch, _recomputes(lay)


def _recomputes(lay: Layout) -> int:
    return RECOMPUTE.index(lay.recompute)


def _trade(best, other, cluster: Cluster, what: str, headroom: float) -> str:
    d = deciding(best, other, cluster)
    change = other.memory_bytes - best.memory_bytes
    memory = (f"{'needs' if change >= 0 else 'saves'} {_gib(abs(change))} GiB per GPU{' more' if change >= 0 else ''}"
              if other.fits else f"does not fit ({other.reason})")
    if other.tight:
        memory += f", leaving {_free(other, cluster)} of the GPU free (less than the {headroom:.0%} headroom)"
    head = f"{what}: {other.layout}: {other.step_s / best.step_s - 1:+.1%} step time; {memory}."
    head += "".join(f"\n  note: {note}." for note in other.layout.caveats())
    if d["gap"] <= 0:  # faster: ranked behind only because it fits in the headroom alone
        tight_only = other.tight and not best.tight
        return head + (f"\n  The assumption that alone decides: {ASSUMPTIONS['headroom']}." if tight_only else "")
    how = "alone decides" if d["single"] else "decides most"
    return (f"{head}\n  It pays +{_seconds(d['seconds'])} s of {d['label']} of the {_seconds(d['gap'])} s gap; "
            f"the assumption that {how}: {d['assumption']}.")


def explain(result, against: Layout | None = None) -> str:
    """Why the best layout wins: what its time and memory go to, what the best layout of another mesh
    (dp, cp, tp, pp), or `against`, trades."""
    best, cluster = result.best, result.cluster
    lay, step = best.layout, best.step_s
    parts = _time_parts(best, cluster)
    in_flight = f", stage 0 holding the micro-batches of its warm-up" if lay.pp > 1 else ""
    lines = [f"{len(result.ranked)} of {len(result.ranked) + len(result.rejected)} layouts fit "
             f"{cluster.n_gpus} x {cluster.gpu_mem_gib:g} GiB, {result.n_roomy} of them leaving {result.headroom:.0%} "
             f"free; ranked by predicted step time, those that leave it first.",
             f"Best: {lay} ({_plural(best.n_micro, 'micro-batch')} of {lay.micro_batch} per data-parallel rank): "
             f"{_seconds(step)} s per step, MFU {best.mfu:.0%}.",
             "  time: " + ", ".join(f"{label} {seconds / step:.0%}" for _, label, seconds in
                                    sorted(parts, key=lambda part: -part[2]) if seconds >= 0.005 * step),
             f"  memory: {_gib(best.memory_bytes)} of {cluster.gpu_mem_gib:g} GiB per GPU: model states "
             f"{_gib(best.model_state_bytes)} ({_sharding(lay)}), activations {_gib(best.activation_bytes)} "
             f"({lay.recompute or 'no'} recomputation{', sequence parallel' if lay.sequence_parallel else ''}"
             f"{in_flight})" + (f", gathered layers {_gib(best.buffer_bytes)}" if best.buffer_bytes else "")
             + f", CUDA context and NCCL {_gib(best.costs.memory.runtime)}"
             + (f"; tight: no layout leaves {result.headroom:.0%} free" if best.tight else "") + "."]
    lines += [f"  note: {note}." for note in lay.caveats()]
    faster = result.ranked[result.n_roomy] if 0 < result.n_roomy < len(result.ranked) else None  # the fastest tight
    if faster is not None and faster.step_s < step:
        lines.append(f"  {faster.layout} would take {faster.step_s / step - 1:+.1%} step time, leaving "
                     f"{_free(faster, cluster)} of the GPU free: measure its memory before choosing it.")
    if against is not None:
        rank, other = result.find(against)
        if other is None:
            lines.append(f"{against} is not among the layouts searched.")
        elif rank != 1:
            lines.append(_trade(best, other, cluster, f"Against {'rank ' + str(rank) if rank else 'it'}",
                                result.headroom))
        return "\n".join(lines)
    other = result.runner_up()
    if other is not None:
        lines.append(_trade(best, other, cluster, "Best of another mesh", result.headroom))
    return "\n".join(lines)


def breakdown(e, cluster: Cluster) -> str:
    """Every part of one layout's memory per GPU, bytes sent per step and step time."""
    mem, sent, step = e.costs.memory, e.costs.sent, e.step_s
    fit = "fits" if e.fits else f"does NOT fit: {e.reason}"
    lines = [f"{e.layout}: {_plural(e.n_micro, 'micro-batch')} per step on each data-parallel rank; {fit}."]
    lines += [f"  note: {note}." for note in e.layout.caveats()]
    lines += [f"memory per GPU: {_gib(mem.total)} of {cluster.gpu_mem_gib:g} GiB",
              f"  model states {_gib(mem.model_states)} ({_sharding(e.layout)}: parameters {_gib(mem.params)}, "
              f"gradients {_gib(mem.grads)}, optimizer {_gib(mem.optimizer)}), activations {_gib(mem.activations)}, "
              f"gathered layers {_gib(mem.buffers)}, CUDA context and NCCL buffers {_gib(mem.runtime)}"
              + (f"; CPU memory {_gib(mem.host)}" if mem.host else ""),
              f"step time: {_seconds(step)} s, MFU {e.mfu:.1%}"]
    lines += [f"  {label:<32} {_seconds(seconds):>9} s  {seconds / step:6.1%}" for _, label, seconds in
              _time_parts(e, cluster)]
    lines.append("bytes sent per GPU and step: " + (", ".join(
        f"{f.name} {getattr(sent, f.name) / 1e9:.3g} GB" for f in fields(sent) if getattr(sent, f.name)) or "none"))
    return "\n".join(lines)


def as_dict(e) -> dict:
    """An Estimate as plain numbers (bytes, seconds) for JSON."""
    return {"layout": asdict(e.layout), "fits": e.fits, "tight": e.tight, "reason": e.reason, "n_micro": e.n_micro,
            "memory_bytes": {**asdict(e.costs.memory), "model_states": e.costs.memory.model_states,
                             "total": e.costs.memory.total},
            "sent_bytes": {**asdict(e.costs.sent), "total": e.costs.sent.total},
            "step_seconds": {**asdict(e.costs.time), "total": e.costs.time.total}, "mfu": e.mfu}
