"""The ring's transfers against its block computations, on a measured timeline (lesson 11).

On CPU ranks the N processes share a few cores, so a block of real attention takes longer while the
neighbours compute too, and gloo's copies compete with it: the timeline would show the machine, not
the schedule. Here each step of the real ring (shardlib.parallel.ring_attention.ring_pass, the
exchange ring attention uses: isend/irecv of a K,V block of real size over gloo or NCCL) computes
for a known time by sleeping, without using a core, as a GPU kernel looks from the host (the same
device as lessons/timed_stage.py uses for pipelines). What the timeline measures is then the
transfers alone: overlapped (started before the block computes) or serial (finished before it).
"""

from __future__ import annotations

import time

import matplotlib.patches as mpatches
import torch
import torch.distributed as dist

from shardlib.launch import current_device
from shardlib.parallel.ring_attention import ring_pass

__all__ = ["timed_ring", "plot_ring_timelines"]

COLORS = {"start": "tab:orange", "compute": "tab:blue", "wait": "tab:red"}
LABELS = {"start": "starting the transfer (isend/irecv)", "compute": "compute (timed block)",
          "wait": "waiting for the next K,V block"}


def timed_ring(block_bytes: int, t_compute: float, repeats: int = 7) -> dict:
    """On each rank: N steps of the ring with blocks of `block_bytes`, each step computing for
    `t_compute` seconds, serial and overlapped taking turns (so both see the same machine) `repeats`
    times each. For each mode, the pass whose slowest rank was fastest: {"serial" | "overlapped":
    {"total": this rank's seconds, "events": [(kind, start, end)]}}, times from the pass's start
    (all ranks start it together)."""
    group = dist.group.WORLD
    block = torch.randn(block_bytes // 4, device=current_device())
    passes = {"serial": [], "overlapped": []}
    for turn in range(repeats):
        for mode in (("serial", "overlapped") if turn % 2 else ("overlapped", "serial")):
            events = []
            dist.barrier(group)
            start = time.perf_counter()
            for _source, _block in ring_pass(block, lambda rank: block.numel(), group=group,
                                             overlap=mode == "overlapped", timeline=events):
                time.sleep(t_compute)  # the attention of this block, on an accelerator
            total = time.perf_counter() - start
            passes[mode].append({"total": total, "events": [(kind, a - start, b - start) for kind, a, b in events]})
    best = {}
    for mode, results in passes.items():
        slowest = torch.tensor([r["total"] for r in results], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # each pass's slowest rank
        best[mode] = results[int(slowest.argmin())]
    return best


def plot_ring_timelines(axes, runs: dict[str, list[dict]]) -> None:
    """One panel per mode (label -> each rank's result for it, from timed_ring): a row per rank;
    starting a transfer in orange, compute in blue, waiting for the next block in red."""
    end = max(r["total"] for per_rank in runs.values() for r in per_rank) * 1e3
    for ax, (label, per_rank) in zip(axes, runs.items()):
        for rank, result in enumerate(per_rank):
            for kind, a, b in result["events"]:
                ax.barh(rank, (b - a) * 1e3, left=a * 1e3, height=0.6, color=COLORS[kind], edgecolor="black",
                        linewidth=0.4)
        slowest = max(r["total"] for r in per_rank) * 1e3
        ax.set_title(f"{label}: {slowest:.0f} ms")
        ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
        ax.set_xlim(0, end * 1.02)
        ax.invert_yaxis()
        ax.set_xlabel("time since the pass started (ms)")
    axes[-1].legend(handles=[mpatches.Patch(color=c, label=LABELS[k]) for k, c in COLORS.items()],
                    loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
