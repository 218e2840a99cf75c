"""Record a torch.profiler trace on every rank: `with shardlib.trace(DIR): step()` inside the rank function.

    def rank_fn():
        model = ...
        step(model)                                   # warm-up, untraced
        with shardlib.trace("traces/ddp", memory=True):
            step(model)                               # one Chrome-trace JSON per rank
    shardlib.launch(rank_fn, 2)                       # then DIR/merged.json: every rank, one timeline

Every rank writes DIR/rank<r>.json (torch.profiler's export_chrome_trace); after a barrier, rank 0
merges them into DIR/merged.json (shardlib.profile.merge): one process row per rank, clocks aligned.
It runs the same under shardlib.launch and torchrun; on CUDA ranks it records the GPU's kernels too
and, with memory=True, also `torch.cuda.memory._record_memory_history`, saved as
DIR/memory_snapshot_rank<r>.pickle for PyTorch's memory visualizer (https://pytorch.org/memory_viz).

memory=True is torch.profiler's profile_memory: every allocation and free of the traced region,
as "[memory]" instant events whose "Total Allocated" counts the bytes allocated since the trace
started and not yet freed (shardlib.profile.memory_timeline reads them).

The phases shardlib's techniques label with torch.profiler.record_function ("bucket 2 all-reduce",
"bucket 2 done", "all-gather blocks.1", "stage 0 F micro-batch 3" ...), on whichever thread opens them,
show in the trace as user annotations, next
to PyTorch's own operators and collectives (c10d::allreduce_ where the call is made, gloo:all_reduce
on gloo's thread while it runs, nccl kernels on the GPU).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

__all__ = ["trace", "TraceFiles", "rank_file", "MERGED"]

MERGED = "merged.json"
# libkineto logs profiler_start / profiler_stop lines (and a GPU count error on machines without one)
# straight to the process's stderr: 6 is above its highest level, so it stays quiet (KINETO_LOG_LEVEL)
_QUIET_KINETO = "6"


def _every_thread():
    """Record labels on every thread of the rank, not only those the profiler's state reaches: DDP's
    "bucket b done" is opened in the collective's completion callback, on gloo's thread. Not with
    profile_memory: PyTorch 2.14's profiler then records no allocation at all."""
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a PyTorch whose profiler has no profile_all_threads: those labels are missing
        return None


def rank_file(out_dir, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.json"


@dataclass
class TraceFiles:
    """Where a traced region was written: this rank's file, the merged one (after the region), the snapshot."""

    rank_file: Path
    merged: Path
    memory_snapshot: Path | None = None


@contextmanager
def trace(out_dir, *, memory: bool = False, group=None):
    """Profile the region on every rank of `group` (all ranks: None): DIR/rank<r>.json, then DIR/merged.json.

    Every rank of the group must enter and leave the region (leaving is a barrier: rank 0 merges
    once all the files exist). memory: record allocations (profile_memory); on CUDA also the
    allocator's history for the memory visualizer. Without a process group, one file: DIR/rank0.json.
    """
    from shardlib.launch import current_device
    from shardlib.profile.merge import merge_traces

    os.environ.setdefault("KINETO_LOG_LEVEL", _QUIET_KINETO)  # before the profiler starts for the first time
    distributed = dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = current_device().type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    files = TraceFiles(rank_file(out, rank), out / MERGED,
                       out / f"memory_snapshot_rank{rank}.pickle" if memory and cuda else None)
    if files.memory_snapshot is not None:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    with profile(activities=activities, profile_memory=memory, record_shapes=memory,
                 experimental_config=None if memory else _every_thread()) as profiler:
        yield files
        if cuda:
            torch.cuda.synchronize()  # the region's kernels belong to the region
    profiler.export_chrome_trace(str(files.rank_file))
    if files.memory_snapshot is not None:
        torch.cuda.memory._dump_snapshot(str(files.memory_snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
    if distributed:
        dist.barrier(group=group)  # every rank's file is written
    if rank == 0:
        merge_traces([rank_file(out, r) for r in range(world)], files.merged)
    if distributed:
        dist.barrier(group=group)  # the merged file exists for every rank once the region ends
