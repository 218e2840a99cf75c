"""Reading a plan: the ranked table, why the best layout wins, one layout's breakdown.

`format_table` prints the layouts that fit, fastest first; `explain` says in a few lines what the
best one's step time and memory go to, and what the runner-up (the fastest layout on another
mesh) trades; `breakdown` lists every part of one layout's memory, bytes sent and step time;
`as_dict` gives the same as plain numbers for JSON. The cost model and its sources are in
shardlib/plan/cost.py.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from shardlib.plan.inputs import Cluster, GiB, Layout


def _in_one_node(span: int, gpus_per_node: int) -> bool:
    return span <= gpus_per_node and gpus_per_node % span == 0


def _time_parts(e, cluster: Cluster) -> list[tuple[str, float]]:
    """(label, seconds) of each part of the step time of an Estimate."""
    lay, g, time = e.layout, cluster.gpus_per_node, e.costs.time
    where = lambda span: "intra-node" if _in_one_node(span, g) else "inter-node"  # noqa: E731
    return [("compute", time.compute), ("memory-bound kernels", time.elementwise),
            (f"TP communication ({where(lay.tp)})", time.tp),
            (f"CP communication ({where(lay.tp * lay.cp)})", time.cp),
            (f"EP all-to-all ({where(lay.tp * lay.cp * lay.ep)})", time.ep),
            ("pipeline bubble", time.bubble), (f"DP communication ({where(lay.tp * lay.cp * lay.dp)})", time.dp),
            (f"PP sends ({where(lay.n_gpus)})", time.pp), ("CPU offload", time.offload)]


def _seconds(x: float) -> str:
    return f"{x:.3g}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def _gib(nbytes: float) -> str:
    x = nbytes / GiB
    return f"{x:.1f}" if x >= 0.95 or x == 0 else f"{x:.2g}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('h') else 's'}"


def _sharding(lay: Layout) -> str:
    """How the model states are divided, in words."""
    parts, replicas = [], lay.dp * lay.cp
    if replicas > 1:
        parts.append(f"ZeRO-{lay.zero} over {replicas} data-parallel GPUs" if lay.zero else
                     f"replicated on {replicas} data-parallel GPUs")
    if lay.tp * lay.pp > 1:
        parts.append(f"split {lay.tp * lay.pp} ways by tp x pp")
    if lay.ep > 1:
        parts.append(f"experts split {lay.ep} ways")
    if lay.offload:
        parts.append("optimizer states in CPU memory")
    return ", ".join(parts) or "one GPU holds them all"


def format_table(estimates: list, cluster: Cluster) -> str:
    """One line per estimate: layout, memory per GPU (GiB), seconds per step and their parts, MFU."""
    lines = [f"{'#':>3} {'dp':>4} {'cp':>3} {'tp':>3} {'pp':>5} {'zero':>4} {'b x m':>8} {'recompute':>9} {'sp':>3} "
             f"{'GiB/GPU':>8} {'states':>7} {'act':>6} {'step s':>8} {'compute':>8} {'comm':>7} {'bubble':>7} "
             f"{'dp':>7} {'MFU':>5}"]
    for i, e in enumerate(estimates, 1):
        lay, time = e.layout, e.costs.time
        cp = f"{lay.cp}{'u' if lay.cp_method == 'ulysses' else ''}"
        pp = f"{lay.pp}" + (f"x{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        comm = time.tp + time.cp + time.ep + time.pp + time.offload
        lines.append(
            f"{i:>3} {lay.dp:>4} {cp:>3} {lay.tp:>3} {pp:>5} {lay.zero:>4} {f'{lay.micro_batch}x{e.n_micro}':>8} "
            f"{lay.recompute or '-':>9} {'y' if lay.sequence_parallel else '-':>3} {_gib(e.memory_bytes):>8} "
            f"{_gib(e.model_state_bytes):>7} {_gib(e.activation_bytes):>6} {_seconds(e.step_s):>8} "
            f"{_seconds(time.compute + time.elementwise):>8} {_seconds(comm):>7} {_seconds(time.bubble):>7} "
            f"{_seconds(time.dp):>7} "
            f"{e.mfu:>5.0%}")
    return "\n".join(lines)


def explain(result) -> str:
    """A few lines on why the best layout wins: what its time and memory go to, what the runner-up trades."""
    best, cluster = result.best, result.cluster
    lay, step = best.layout, best.step_s
    parts = _time_parts(best, cluster)
    in_flight = f", {_plural(min(lay.pp, best.n_micro), 'micro-batch')} in flight on stage 0" if lay.pp > 1 else ""
    lines = [f"{len(result.ranked)} of {len(result.ranked) + len(result.rejected)} layouts fit "
             f"{cluster.n_gpus} x {cluster.gpu_mem_gib:g} GiB; ranked by predicted step time.",
             f"Best: {lay} ({_plural(best.n_micro, 'micro-batch')} of {lay.micro_batch} per data-parallel rank): "
             f"{_seconds(step)} s per step, MFU {best.mfu:.0%}.",
             "  time: " + ", ".join(f"{label} {seconds / step:.0%}" for label, seconds in
                                    sorted(parts, key=lambda part: -part[1]) if seconds >= 0.005 * step),
             f"  memory: {_gib(best.memory_bytes)} of {cluster.gpu_mem_gib:g} GiB per GPU: model states "
             f"{_gib(best.model_state_bytes)} ({_sharding(lay)}), activations {_gib(best.activation_bytes)} "
             f"({lay.recompute or 'no'} recomputation{', sequence parallel' if lay.sequence_parallel else ''}"
             f"{in_flight})"
             + (f", gathered layers {_gib(best.buffer_bytes)}" if best.buffer_bytes else "") + "."]
    other = result.runner_up()
    if other is not None:
        deltas = [(label, theirs - ours) for (label, ours), (_, theirs) in zip(parts, _time_parts(other, cluster))]
        costs, gains = max(deltas, key=lambda x: x[1]), min(deltas, key=lambda x: x[1])
        trade = f"+{_seconds(costs[1])} s of {costs[0]}" if costs[1] > 1e-9 * step else "no slower part"
        if gains[1] < -1e-9 * step:
            trade += f", saves {_seconds(-gains[1])} s of {gains[0]}"
        change = other.memory_bytes - best.memory_bytes
        lines.append(f"Runner-up: {other.layout}: {other.step_s / step - 1:+.1%} step time ({trade}); "
                     f"{'needs' if change >= 0 else 'saves'} {_gib(abs(change))} GiB per GPU"
                     f"{' more' if change >= 0 else ''}.")
    return "\n".join(lines)


def breakdown(e, cluster: Cluster) -> str:
    """Every part of one layout's memory per GPU, bytes sent per step and step time."""
    mem, sent, step = e.costs.memory, e.costs.sent, e.step_s
    fit = "fits" if e.fits else f"does NOT fit: {e.reason}"
    lines = [f"{e.layout}: {_plural(e.n_micro, 'micro-batch')} per step on each data-parallel rank; {fit}.",
             f"memory per GPU: {_gib(mem.total)} of {cluster.gpu_mem_gib:g} GiB",
             f"  model states {_gib(mem.model_states)} ({_sharding(e.layout)}), activations {_gib(mem.activations)}, "
             f"gathered layers {_gib(mem.buffers)}" + (f"; CPU memory {_gib(mem.host)}" if mem.host else ""),
             f"step time: {_seconds(step)} s, MFU {e.mfu:.1%}"]
    lines += [f"  {label:<32} {_seconds(seconds):>9} s  {seconds / step:6.1%}" for label, seconds in
              _time_parts(e, cluster)]
    lines.append("bytes sent per GPU and step: " + (", ".join(
        f"{f.name} {getattr(sent, f.name) / 1e9:.3g} GB" for f in fields(sent) if getattr(sent, f.name)) or "none"))
    return "\n".join(lines)


def as_dict(e) -> dict:
    """An Estimate as plain numbers (bytes, seconds) for JSON."""
    return {"layout": asdict(e.layout), "fits": e.fits, "reason": e.reason, "n_micro": e.n_micro,
            "memory_bytes": {**asdict(e.costs.memory), "total": e.costs.memory.total},
            "sent_bytes": {**asdict(e.costs.sent), "total": e.costs.sent.total},
            "step_seconds": {**asdict(e.costs.time), "total": e.costs.time.total}, "mfu": e.mfu}
