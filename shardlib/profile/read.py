"""Read a trace back: slices per rank, the collectives PyTorch recorded, compute, communication, idle.

`read_trace(path)` takes a merged file (shardlib.profile.merge) or one rank's file. What it finds:

    compute        on a CPU rank, the operators the profiler records on the rank's threads (cpu_op),
                   less PyTorch's collective calls (c10d::*) and autograd's wrappers
                   ("autograd::engine::evaluate_function: ..."), inside which a rank may be
                   waiting for a collective; on a GPU rank, the GPU kernels that are not NCCL's
    communication  on a CPU rank, gloo's own slices ("gloo:all_reduce", "gloo:recv" ...: the
                   collective running, on gloo's threads or the caller's) and the c10d::* calls;
                   on a GPU rank, NCCL's kernels
    overlapped     the communication during which the rank computes: |communication & compute|
    idle           the window (first event to last, over every rank) neither computing nor communicating
    collectives    PyTorch's own count, one c10d::* operator per call, named as shardlib's ledger
                   names its records (c10d::allreduce_ -> all_reduce ...): held against the ledger
    phases         the user annotations (record_function): shardlib's labels and gloo's

Holistic Trace Analysis (HolisticTraceAnalysis on PyPI) computes the same breakdown, and the
communication/computation overlap, from the GPU kernels of a trace; on a trace without GPU kernels
(CPU ranks over gloo) those analyses come back empty or fail, while its parser reads the events
well. This module is what it lacks for CPU ranks: the interval arithmetic above, on the CPU
threads. Times are microseconds, as in the file.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Slice", "Trace", "read_trace", "union", "total", "intersect", "LEDGER_KINDS", "summary",
           "overlap_fraction"]

LEDGER_KINDS = {  # PyTorch's collective operators -> the ledger's kinds (shardlib.comm.ledger)
    "c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather", "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather", "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter", "c10d::broadcast_": "broadcast", "c10d::alltoall_base_": "all_to_all",
    "c10d::alltoall_": "all_to_all", "c10d::send": "send", "c10d::recv_": "recv", "c10d::barrier": "barrier",
    "c10d::reduce_": "reduce", "c10d::gather_": "gather", "c10d::scatter_": "scatter",
}
_WRAPPER = "autograd::engine::evaluate_function"


@dataclass(frozen=True)
class Slice:
    rank: int
    tid: object
    name: str
    cat: str
    start: float  # microseconds
    end: float

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    slices: list[Slice]
    memory: dict = field(default_factory=dict)  # (rank, device type) -> [(ts, bytes allocated since the trace began)]
    path: Path | None = None

    @property
    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.slices})

    def of(self, rank: int) -> list[Slice]:
        return [s for s in self.slices if s.rank == rank]

    def window(self) -> tuple[float, float]:
        return min(s.start for s in self.slices), max(s.end for s in self.slices)

    def collectives(self, rank: int) -> Counter:
        """Calls per ledger kind, as PyTorch recorded them (one c10d operator per call)."""
        return Counter(LEDGER_KINDS[s.name] for s in self.of(rank) if s.name in LEDGER_KINDS)

    def phases(self, rank: int, prefix: str = "") -> list[Slice]:
        """User annotations (record_function labels, gloo's slices) starting with `prefix`, in time order."""
        return sorted((s for s in self.of(rank) if s.cat == "user_annotation" and s.name.startswith(prefix)),
                      key=lambda s: s.start)

    def is_gpu(self, rank: int) -> bool:
        return any(s.cat == "kernel" for s in self.of(rank))

    def communication(self, rank: int) -> list[tuple[float, float]]:
        """The rank's communication, as a union of intervals."""
        if self.is_gpu(rank):
            found = [s for s in self.of(rank) if s.cat == "kernel" and "nccl" in s.name.lower()]
        else:
            found = [s for s in self.of(rank) if s.name.startswith(("gloo:", "c10d::"))]
        return union((s.start, s.end) for s in found)

    def compute(self, rank: int) -> list[tuple[float, float]]:
        """The rank's compute, as a union of intervals (see the module docstring)."""
        if self.is_gpu(rank):
            found = [s for s in self.of(rank) if s.cat == "kernel" and "nccl" not in s.name.lower()]
        else:
            found = [s for s in self.of(rank) if s.cat == "cpu_op" and not s.name.startswith(("c10d::", _WRAPPER))]
        return union((s.start, s.end) for s in found)


def _slices(event: dict) -> bool:
    return event.get("ph") == "X" and isinstance(event.get("pid"), int) and "dur" in event


def read_trace(path) -> Trace:
    """The complete events ("X") of a merged trace (process = rank) or of one rank's trace, and its memory."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    events = data.get("traceEvents", [])
    rank_of = None  # a single rank's file: its pid is an operating-system pid; the rank is in distributedInfo
    if "otherData" not in data or "ranks" not in (data.get("otherData") or {}):
        rank_of = int((data.get("distributedInfo") or {}).get("rank", 0))
    slices, memory = [], {}
    for e in events:
        rank = rank_of if rank_of is not None else e.get("pid")
        if _slices(e):
            slices.append(Slice(rank, e.get("tid"), e.get("name", ""), e.get("cat", ""), e["ts"], e["ts"] + e["dur"]))
        elif e.get("ph") == "i" and e.get("name") == "[memory]" and isinstance(e.get("pid"), int):
            args = e.get("args", {})
            memory.setdefault((rank, args.get("Device Type", 0)), []).append(
                (e["ts"], args.get("Total Allocated", 0), args.get("Bytes", 0)))
    return Trace(slices, {key: _since_start(series) for key, series in memory.items()}, path)


def _since_start(series: list) -> list[tuple[float, int]]:
    """(ts, bytes allocated since the trace started and still alive). The profiler's "Total Allocated" counts
    from the first trace of the process on (what an earlier trace allocated and freed untraced stays in
    it): the level before the trace's first allocation is taken off."""
    series.sort()
    _, first_total, first_bytes = series[0]
    baseline = first_total - first_bytes
    return [(ts, allocated - baseline) for ts, allocated, _ in series]


# ---------------------------------------------------------------------------------
# intervals


def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def total(intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(a, b) -> list[tuple[float, float]]:
    """The time covered by both unions `a` and `b` (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_fraction(communication, compute) -> float:
    """The part of the communication time during which compute runs (0 when nothing was communicated)."""
    comm = union(communication)
    busy = total(comm)
    return total(intersect(comm, union(compute))) / busy if busy else 0.0


def summary(trace: Trace) -> dict[int, dict[str, float]]:
    """Per rank, seconds of compute, communication, overlapped communication and idle time in the window."""
    start, end = trace.window()
    out = {}
    for rank in trace.ranks:
        comm, compute = trace.communication(rank), trace.compute(rank)
        overlapped = total(intersect(comm, compute))
        busy = total(union(comm + compute))
        out[rank] = {"window_s": (end - start) / 1e6, "compute_s": total(compute) / 1e6,
                     "communication_s": total(comm) / 1e6, "overlapped_s": overlapped / 1e6,
                     "exposed_communication_s": (total(comm) - overlapped) / 1e6,
                     "idle_s": (end - start - busy) / 1e6,
                     "overlap_fraction": overlapped / total(comm) if comm else 0.0}
    return out
