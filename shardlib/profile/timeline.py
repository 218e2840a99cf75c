"""Pictures from a trace: each rank's compute and communication lanes, and its memory over time.

    plot_lanes(trace, ax)            per rank two lanes, compute (blue) over communication (grey), and
                                     the labels of one phase family (e.g. the pipeline's "stage") as text
    memory_timeline(trace, rank)     [(seconds from the window's start, bytes allocated and not freed)]
    plot_memory(trace, ax, ranks)    that curve, per rank

The memory comes from torch.profiler's profile_memory: one "[memory]" event per allocation or free,
whose "Total Allocated" counts the bytes allocated since the trace started and still alive.
"""

from __future__ import annotations

from shardlib.profile.read import Trace

__all__ = ["plot_lanes", "memory_timeline", "plot_memory", "peak_memory"]

_CPU, _CUDA = 0, 1  # the profiler's device types


def plot_lanes(trace: Trace, ax, *, title: str | None = None, labels: str | None = None, window=None):
    """Compute over communication, one pair of lanes per rank (rank 0 on top), in milliseconds from the
    window's start; `labels`: write the phases whose names start with it on the compute lane."""
    import matplotlib.pyplot as plt

    start, end = window or trace.window()
    ms = lambda t: (t - start) / 1e3  # noqa: E731
    ticks, names = [], []
    for k, rank in enumerate(trace.ranks):
        row = 2 * k
        for a, b in trace.compute(rank):
            ax.barh(row, (b - a) / 1e3, left=ms(a), height=0.8, color="tab:blue", linewidth=0)
        for a, b in trace.communication(rank):
            ax.barh(row + 1, (b - a) / 1e3, left=ms(a), height=0.6, color="tab:gray", linewidth=0)
        if labels:
            for phase in trace.phases(rank, labels):
                if phase.dur > 0.03 * (end - start):
                    ax.text(ms((phase.start + phase.end) / 2), row, phase.name[len(labels):].strip(), ha="center",
                            va="center", fontsize=6, color="white", clip_on=True)
        ticks += [row, row + 1]
        names += [f"rank {rank} compute", f"rank {rank} communication"]
    ax.set_yticks(ticks, names, fontsize=8)
    ax.set_ylim(ticks[-1] + 0.6, -0.6)
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_xlabel("milliseconds (trace clock)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:gray")],
              labels=["compute (operators)", "communication (gloo / NCCL)"], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def memory_timeline(trace: Trace, rank: int, device: int = _CPU) -> list[tuple[float, int]]:
    """(seconds from the trace window's start, bytes allocated since the trace started and still alive)."""
    start, _ = trace.window()
    return [((ts - start) / 1e6, allocated) for ts, allocated in trace.memory.get((rank, device), [])]


def peak_memory(trace: Trace, rank: int, device: int = _CPU) -> int:
    """The most bytes alive at once during the trace (allocated after it started)."""
    return max((allocated for _, allocated in trace.memory.get((rank, device), [])), default=0)


def plot_memory(trace: Trace, ax, ranks=None, *, title: str | None = None, device: int = _CPU):
    """Bytes allocated and not yet freed (MiB), a step line per rank."""
    for rank in ranks if ranks is not None else trace.ranks:
        points = memory_timeline(trace, rank, device)
        if points:
            ax.step([t * 1e3 for t, _ in points], [b / 2**20 for _, b in points], where="post", label=f"rank {rank}")
    ax.set_xlabel("milliseconds (trace clock)")
    ax.set_ylabel("MiB allocated since the trace started")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
