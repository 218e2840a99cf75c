"""Side-by-side timing: implementations take turns, so that all of them see the same machine.

On a shared machine (2 cores, other processes, a GPU's clocks) the load changes from one second to
the next. Timing A for a while and then B compares A's machine with B's. Here they alternate, in
alternating order (A B, B A, A B ...), and each keeps its statistic over its own turns: the ratio of
two such numbers is what a benchmark reports (`python -m shardlib bench`), never an absolute time.

    interleaved_times({"ours": step_a, "torch": step_b}, repeats=15)   # median seconds of each
    interleaved_times(..., statistic=min, sync=dist.barrier)           # best time; ranks start together

Every saved timing says how busy the machine was: a lesson prints `machine_load()` in the cell that
times something ("load average 0.42 on 2 cores"), and a test holds each saved lesson to
QUIET_LOAD_PER_CORE (tests/test_notebook_outputs.py). The 1-minute load average counts every runnable
process, other programs and the lesson's own earlier ranks included.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

__all__ = ["interleaved_times", "machine_load", "QUIET_LOAD_PER_CORE"]

# The most load per core at which saved timings count as taken on a quiet machine.
QUIET_LOAD_PER_CORE = 1.25


def machine_load() -> str:
    """How busy this machine is now, in the words every lesson prints beside its timings:
    "load average 0.42 on 2 cores" (the 1-minute load average; tests read this exact form)."""
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, *, warmup: int = 1,
                      statistic: Callable[[list[float]], float] = statistics.median,
                      sync: Callable[[], object] | None = None) -> dict[str, float]:
    """{name: statistic of the seconds of `fns[name]()`} over `repeats` turns after `warmup` untimed ones.

    sync: called before each timed call (e.g. torch.distributed.barrier, so every rank starts the
    same implementation together). Work queued on a GPU is waited for before the clock stops.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(warmup + repeats):
        for name in (names if turn % 2 else names[::-1]):
            if sync is not None:
                sync()
            start = time.perf_counter()
            fns[name]()
            if torch.cuda.is_initialized():  # never initialise CUDA here: later forks could not use it
                torch.cuda.synchronize()  # kernels are asynchronous: time what has finished
            if turn >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistic(ts) for name, ts in times.items()}
