"""Reading a simulation: the rank's memory and traffic against the planner, the ledger, the timeline plot.

`format_report` prints one rank: where it sits in the job, its memory (model states, activation
peak, ZeRO-3 buffers) and bytes sent per group and collective, simulated beside planned with the ratio, the peak
and where it happened, and the ledger's calls and bytes per collective and group. `as_dict` is the
same for JSON. `plot_timeline` draws the bytes the rank holds through the step.
"""

from __future__ import annotations

from shardlib.plan.inputs import GiB
from shardlib.simulate.compare import Comparison, compare
from shardlib.simulate.run import Simulation

__all__ = ["format_report", "as_dict", "plot_timeline", "GROUP_NAMES"]

GROUP_NAMES = {"tp": "tensor parallel", "cp": "context parallel", "pp": "pipeline", "dense_dp": "data parallel",
               "ep": "expert parallel", "expert_dp": "data parallel (experts)"}


def _where(sim: Simulation) -> str:
    c = sim.coords
    place = ", ".join(f"{k} {c[k]}" for k in ("pp", "dp", "cp", "tp") if getattr(sim.layout, k) > 1) or "alone"
    layers = "; ".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in sim.layers)
    return (f"{sim.spec.name}, {sim.layout}, {sim.attention} attention, rank {sim.rank} of {sim.layout.n_gpus} "
            f"({place}): "
            f"{sim.n_micro} micro-batches of {sim.layout.micro_batch}, layers {layers}")


def _row(c: Comparison, unit: float) -> str:
    mark = "" if c.target is None else ("  ok" if c.within else f"  off (target {c.target:.0%})"
                                        if c.target >= 0.01 else "  off (target: exact)")
    return f"  {c.quantity:<26}{c.simulated / unit:>12.3f}{c.planned / unit:>12.3f}{c.ratio:>9.4f}{mark}"


def format_report(sim: Simulation, comparisons: list[Comparison] | None = None) -> str:
    rows = comparisons if comparisons is not None else compare(sim)
    memory = [r for r in rows if not r.quantity.startswith("sent")]
    sent = [r for r in rows if r.quantity.startswith("sent") and (r.simulated or r.planned)]
    lines = [_where(sim), "",
             f"  {'memory (GiB)':<26}{'simulated':>12}{'planned':>12}{'ratio':>9}", *(_row(r, GiB) for r in memory),
             f"  peak: {sim.peak / GiB:.2f} GiB in all, in the {sim.peak_where}; "
             f"activations at their peak in the {sim.activation_peak_where}", "",
             f"  {'sent per step (GB)':<26}{'simulated':>12}{'planned':>12}{'ratio':>9}", *(_row(r, 1e9) for r in sent),
             "", f"  {'ledger: group':<28}{'collective':<16}{'calls':>8}{'bytes':>18}{'sent bytes':>18}"]
    for group, kinds in sorted(sim.by_group().items()):
        for kind, row in sorted(kinds.items()):
            if kind != "barrier":
                lines.append(f"  {GROUP_NAMES.get(group, group):<28}{kind:<16}{row['calls']:>8}"
                             f"{row['bytes']:>18,}{row['sent_bytes']:>18,}")
    lines.append(f"\n  simulated in {sim.wall_s:.1f} s")
    return "\n".join(lines)


def as_dict(sim: Simulation, comparisons: list[Comparison] | None = None) -> dict:
    rows = comparisons if comparisons is not None else compare(sim)
    return {"model": sim.spec.name, "layout": str(sim.layout), "attention": sim.attention, "rank": sim.rank,
            "coords": sim.coords,
            "global_batch": sim.global_batch, "micro_batches": sim.n_micro, "layers": sim.layers,
            "model_states": sim.model_states, "activation_peak": sim.activation_peak,
            "activation_peak_where": str(sim.activation_peak_where), "peak": sim.peak,
            "peak_where": str(sim.peak_where), "buffer_peak": sim.buffer_peak,
            "ledger": sim.by_group(), "sent": sim.sent_by_group(),
            "against_planner": [{"quantity": r.quantity, "simulated": r.simulated, "planned": r.planned,
                                 "ratio": r.ratio, "target": r.target, "within": r.within} for r in rows],
            "wall_s": sim.wall_s}


def plot_timeline(sim: Simulation, ax=None, title: str | None = None, activations_only: bool = False):
    """Bytes held through the step, one point per event (each layer's forward end, backward start and end):
    stacked, model states (parameters and optimizer flat, gradients), gathered ZeRO-3 parameters and saved
    activations at their highest since the previous event; or the activations alone. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3))
    xs = range(len(sim.samples))
    acts = [x.high / GiB for x in sim.samples]
    if activations_only:
        ax.plot(xs, acts, color="tab:blue", lw=0.8, label="saved activations")
        ax.set_ylim(bottom=0)
        tops = acts
    else:
        states = (sim.model_states["params"] + sim.model_states["optimizer"]) / GiB
        grads, buffers = [x.grads / GiB for x in sim.samples], [x.buffers / GiB for x in sim.samples]
        ax.stackplot(xs, [states] * len(xs), grads, buffers, acts,
                     labels=["parameters + optimizer", "gradients", "gathered parameters", "saved activations"],
                     colors=["tab:gray", "tab:olive", "tab:purple", "tab:blue"], alpha=0.8)
        tops = [states + g + f + a for g, f, a in zip(grads, buffers, acts)]
    top = max(xs, key=tops.__getitem__)
    ax.plot([top], [tops[top]], "v", color="black", ms=5)
    ax.text(0.99, 0.04, f"peak: {sim.peak_where}", transform=ax.transAxes, ha="right", fontsize=8,
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.8))
    ax.set_xlim(0, max(len(xs) - 1, 1))
    ax.set_xlabel("step, event by event (each layer's forward end, backward start and end)")
    ax.set_ylabel("GiB on this GPU")
    ax.set_title(title or f"{sim.spec.name}: rank {sim.rank} of {sim.layout.n_gpus}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    return ax
