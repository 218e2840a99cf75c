"""Plots of lesson 10 (serving under load): KV bytes per rank, latency against offered load, a day of traffic."""

from __future__ import annotations

__all__ = ["plot_kv_bytes", "plot_latency_vs_load", "plot_day"]

COLORS = {"1 device": "black", "2 replicas": "tab:blue", "4 replicas": "tab:cyan", "TP 2": "tab:red",
          "PP 2": "tab:green"}


def plot_kv_bytes(ax, rows: list[dict]) -> None:
    """rows: {"kv_heads", "t", "measured", "formula"} (bytes per rank): bars measured, ticks the formula."""
    heads = sorted({r["kv_heads"] for r in rows}, reverse=True)
    ts = sorted({r["t"] for r in rows})
    width = 0.8 / len(ts)
    for j, t in enumerate(ts):
        xs = [i + (j - (len(ts) - 1) / 2) * width for i in range(len(heads))]
        cell = {r["kv_heads"]: r for r in rows if r["t"] == t}
        ax.bar(xs, [cell[h]["measured"] / 1e3 for h in heads], width * 0.9, label=f"t = {t} (measured)")
        ax.scatter(xs, [cell[h]["formula"] / 1e3 for h in heads], marker="_", s=300, color="black", zorder=3,
                   label="formula" if j == 0 else None)
    ax.set_xticks(range(len(heads)), [f"{h} kv head{'s' if h > 1 else ''}" for h in heads])
    ax.set_ylabel("KV cache per rank (kB)")
    ax.set_title("KV cache per tensor-parallel rank: split by heads, floored at one head", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot_latency_vs_load(axes, curves: dict) -> None:
    """curves[name]: {"rates", "mean", "p90", "formula_rates", "formula_mean", "capacity", "formula_capacity"}
    (requests/s and seconds). Left: mean end-to-end latency with the M/G/c formula and both capacities;
    right: p90 (a p99 of a few dozen requests is one request's luck)."""
    left, right = axes
    for name, c in curves.items():
        color = COLORS.get(name)
        left.plot(c["rates"], [x * 1e3 for x in c["mean"]], "o-", color=color, label=f"{name}")
        left.plot(c["formula_rates"], [x * 1e3 for x in c["formula_mean"]], "--", color=color, lw=1)
        left.axvline(c["capacity"], color=color, lw=2, alpha=0.35)
        left.axvline(c["formula_capacity"], color=color, lw=1, ls=":")
        right.plot(c["rates"], [x * 1e3 for x in c["p90"]], "o-", color=color, label=name)
    left.set_title("mean end-to-end latency: measured (dots), M/G/c formula (dashed)\n"
                   "capacity: measured (wide line), formula c/E[S] (dotted)", fontsize=9)
    right.set_title("p90 end-to-end latency, measured", fontsize=9)
    for ax in axes:
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)


def plot_day(axes, day: dict, runs: dict, window: float, slo: float) -> None:
    """day: {"t", "rate"}; runs[name]: {"routable", "provisioned", "p99"} per window. Three panels:
    offered load, replicas provisioned, p99 TTFT per window against the SLO."""
    load, replicas, tail = axes
    load.plot(day["t"], day["rate"], color="gray")
    load.set_ylabel("offered load (req/s)")
    load.set_title("a day of traffic (compressed)", fontsize=9)
    for name, run in runs.items():
        starts = [k * window for k in range(len(run["provisioned"]))]
        replicas.step(starts, run["provisioned"], where="post", label=f"{name}: paid")
        replicas.step(starts, run["routable"], where="post", ls=":", color=replicas.lines[-1].get_color(),
                      label=f"{name}: taking traffic")
        tail.plot([(k + 0.5) * window for k in range(len(run["p99"]))], [x * 1e3 for x in run["p99"]], "o-", ms=3,
                  label=name)
    tail.axhline(slo * 1e3, color="black", ls="--", lw=1, label="TTFT SLO")
    replicas.set_ylabel("replicas")
    tail.set_ylabel("p99 TTFT per window (ms)")
    tail.set_yscale("log")
    for ax in axes:
        ax.set_xlabel("time of the compressed day (s)")
        ax.grid(alpha=0.3)
    replicas.legend(fontsize=7)
    tail.legend(fontsize=7)
