"""Lesson 13's timed pieces: FSDP units and pipeline stages whose compute takes a known time.

On a CPU, ranks share the cores with each other and with gloo's communication threads, so real
compute and communication slow each other down and an overlap is hard to see. A timed piece
sleeps for its compute time, without using a core, as a GPU kernel looks from the host (as
shardlib.lessons.timed_stage.TimedStage does for lesson 05): what remains on the timeline is the
schedule and the messages. What the CPU can show this way: whether a collective starts early
enough to finish under the compute (ordering, overlap). What it cannot: how fast a GPU computes, or
how NVLink or InfiniBand compare with the loopback gloo uses here.

    TimedUnits        n units, each a Linear(width, width) whose forward sleeps t_forward and backward
                      t_backward; fully_shard-ed, it shows ZeRO-3's all-gathers with and without prefetch
    prefetch_timeline one launch: steps with prefetch on and off, their timelines, ledgers and times
    TimedSplitStage   a pipeline stage whose backward is B (t_backward) then W (t_weight), for zero-bubble
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlib.comm import comm_ledger
from shardlib.launch import current_device
from shardlib.parallel.fsdp import _units, fully_shard
from shardlib.parallel.split_backward import split_weight_gradients

__all__ = ["TimedUnits", "prefetch_timeline", "plot_overlap", "TimedSplitStage"]


class _TimedCompute(torch.autograd.Function):
    """Identity that sleeps t_forward forward and t_backward backward, logging (name, phase, start, end)."""

    @staticmethod
    def forward(ctx, x, name, t_forward, t_backward, log):
        start = time.perf_counter()
        time.sleep(t_forward)
        if log is not None:
            log.append((name, "forward", start, time.perf_counter()))
        ctx.name, ctx.t_backward, ctx.log = name, t_backward, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        time.sleep(ctx.t_backward)
        if ctx.log is not None:
            ctx.log.append((ctx.name, "backward", start, time.perf_counter()))
        return grad, None, None, None, None


class _TimedUnit(nn.Module):
    def __init__(self, name: str, width: int, t_forward: float, t_backward: float, log):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.name, self.t_forward, self.t_backward, self.log = name, t_forward, t_backward, log

    def forward(self, x):  # (b, width)
        return _TimedCompute.apply(self.linear(x), self.name, self.t_forward, self.t_backward, self.log)


class TimedUnits(nn.Module):
    """`n_units` timed units in a row; `log` (a list) collects their compute intervals."""

    def __init__(self, n_units: int = 4, width: int = 1024, t_forward: float = 0.03, t_backward: float = 0.06,
                 log: list | None = None):
        super().__init__()
        self.units = nn.ModuleList(_TimedUnit(f"units.{k}", width, t_forward, t_backward, log) for k in range(n_units))

    def forward(self, x):  # (b, width)
        for unit in self.units:
            x = unit(x)
        return x


def _build(prefetch: bool, sizes: dict) -> tuple[nn.Module, list, list]:
    compute, gathers = [], []
    torch.manual_seed(0)
    model = TimedUnits(log=compute, **sizes).to(current_device())
    for unit in model.units:
        fully_shard(unit, prefetch=prefetch)
    fully_shard(model, prefetch=prefetch)  # the root: it records the order the units run in
    for _, unit in _units(model):
        unit.gather_log = gathers
    return model, compute, gathers


def _run_prefetch(sizes: dict, steps: int) -> dict:
    runs = {prefetch: _build(prefetch, sizes) for prefetch in (False, True)}
    x = torch.randn(8, sizes["width"], device=current_device())  # (b, width)
    out = {prefetch: {"step_s": []} for prefetch in runs}
    for step in range(steps):
        for prefetch in ((False, True) if step % 2 else (True, False)):  # take turns: both see the same machine
            model, compute, gathers = runs[prefetch]
            compute.clear()
            gathers.clear()
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            with comm_ledger() as ledger:
                model(x).square().mean().backward()  # forward and backward: where the all-gathers are
            out[prefetch]["step_s"].append(time.perf_counter() - start)
            out[prefetch].update(compute=list(compute), gathers=[dict(g) for g in gathers], start=start,
                                 ledger=sorted((r.kind, r.nbytes, r.sent_bytes) for r in ledger.records))
    return out


def prefetch_timeline(steps: int = 5, n_units: int = 4, width: int = 1024, t_forward: float = 0.02,
                      t_backward: float = 0.04) -> dict:
    """On each rank: forward and backward of the same model sharded twice, without prefetch and with,
    taking turns for `steps` steps each. Returns {False: ..., True: ...} per prefetch setting, each
    with `step_s` (every step; the first one has no recorded order to prefetch from), and the last
    step's `compute` and `gathers` intervals, its `start` and its `ledger` records, sorted.
    """
    sizes = dict(n_units=n_units, width=width, t_forward=t_forward, t_backward=t_backward)
    return _run_prefetch(sizes, steps)


def plot_overlap(per_rank: list, ax, title: str):
    """Rows per rank: compute (forward blue, backward orange) above its all-gathers (grey; prefetched: green)."""
    import matplotlib.pyplot as plt

    origin = min(r["start"] for r in per_rank)
    span = 0.0
    for rank, r in enumerate(per_rank):
        row = 2 * rank
        for name, phase, start, end in r["compute"]:
            ax.barh(row, end - start, left=start - origin, color="tab:blue" if phase == "forward" else "tab:orange",
                    height=0.8, edgecolor="white", linewidth=0.5)
            ax.text((start + end) / 2 - origin, row, name.split(".")[-1], ha="center", va="center", fontsize=7,
                    color="white")
            span = max(span, end - origin)
        for g in r["gathers"]:
            if g["done"] is not None:
                ax.barh(row + 1, g["done"] - g["issued"], left=g["issued"] - origin, height=0.6,
                        color="tab:green" if g["prefetch"] else "tab:gray", edgecolor="white", linewidth=0.5)
                span = max(span, g["done"] - origin)
    ax.set_yticks([k for rank in range(len(per_rank)) for k in (2 * rank, 2 * rank + 1)],
                  [label for rank in range(len(per_rank)) for label in (f"rank {rank} compute", f"rank {rank} all-gather")])
    ax.set_ylim(2 * len(per_rank) - 0.4, -0.6)
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds since the step started")
    ax.set_title(title, fontsize=9)
    colors = {"forward": "tab:blue", "backward": "tab:orange", "all-gather, waited for": "tab:gray",
              "all-gather, prefetched": "tab:green"}
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    return ax


# ---------------------------------------------------------------------------------
# a pipeline stage with a split backward


class _TimedSplit(torch.autograd.Function):
    """Identity: t_forward forward; backward t_backward (B) and, through the store, t_weight (W)."""

    @staticmethod
    def forward(ctx, x, t_forward, t_backward, t_weight, store):
        time.sleep(t_forward)
        ctx.times, ctx.store = (t_backward, t_weight), store
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        t_backward, t_weight = ctx.times
        time.sleep(t_backward)
        ctx.store.put(lambda: time.sleep(t_weight), ())
        return grad, None, None, None, None


class TimedSplitStage(nn.Module):
    """A pipeline stage of known cost whose backward splits into B and W (zero-bubble schedules)."""

    def __init__(self, stage_index: int, num_stages: int, width: int = 64, t_forward: float = 0.02,
                 t_backward: float = 0.02, t_weight: float = 0.02):
        super().__init__()
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.linear = nn.Linear(width, width)
        self.times = (t_forward, t_backward, t_weight)
        split_weight_gradients(self)  # sets self.weight_grad_store; the Linear's dW waits for W too

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, width)
        return _TimedSplit.apply(self.linear(x), *self.times, self.weight_grad_store)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def activation_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)  # (b, width)

