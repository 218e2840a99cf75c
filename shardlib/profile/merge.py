"""One timeline from N ranks: merge the ranks' Chrome-trace files into one that Perfetto opens as it is.

torch.profiler writes one file per process, each in the Trace Event Format that chrome://tracing and
ui.perfetto.dev read (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
an object whose "traceEvents" list holds complete events ("ph": "X", with "ts" and "dur" in
microseconds), instant events ("i"), flow events ("s", "f") and metadata ("M": process and thread
names). Merging is three changes per rank, nothing else:

    process    "pid" becomes the rank, named "rank r" and sorted by rank: one process row per rank
    clock      "ts" is shifted by (baseTimeNanoseconds of the rank - that of rank 0) / 1000; the
               profiler writes times as wall-clock minus a base, so after the shift every rank's
               events sit on one clock (on one machine the ranks share it exactly; across machines
               to the precision of their clock synchronisation)
    flow ids   offset per rank, so that an arrow of one rank never joins another rank's events

Events that are not of a rank's own process (the profiler's "Spans" and "Traces" rows) are dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["merge_traces", "FLOW_ID_STRIDE"]

FLOW_ID_STRIDE = 1 << 40  # rank r's flow ids become id + r * stride


def _load(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _rank_of(trace: dict, default: int) -> int:
    return int((trace.get("distributedInfo") or {}).get("rank", default))


def _own_pids(events: list) -> set:
    """The operating-system pids of the rank's process (numbers; the profiler's own rows are strings)."""
    return {e["pid"] for e in events if isinstance(e.get("pid"), int) and e.get("ph") != "M"} | \
           {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and isinstance(e.get("pid"), int)}


def _rank_events(trace: dict, rank: int, shift_us: float) -> list:
    events = trace.get("traceEvents", [])
    pids = _own_pids(events)
    merged = []
    for e in events:
        if e.get("pid") not in pids:
            continue
        e = dict(e, pid=rank)
        if "ts" in e:
            e["ts"] = e["ts"] + shift_us
        if e.get("ph") in ("s", "f", "t") and "id" in e:
            e["id"] = e["id"] + rank * FLOW_ID_STRIDE
        if e.get("ph") == "M" and e.get("name") == "process_name":
            e["args"] = {"name": f"rank {rank}"}
        elif e.get("ph") == "M" and e.get("name") == "process_sort_index":
            e["args"] = {"sort_index": rank}
        elif e.get("ph") == "M" and e.get("name") == "process_labels":
            e["args"] = {"labels": f"rank {rank} ({e.get('args', {}).get('labels', '')})"}
        merged.append(e)
    return merged


def merge_traces(rank_files, out) -> Path:
    """Write the ranks' traces (files, in any order; each names its rank) as one trace at `out`."""
    traces = [_load(path) for path in rank_files]
    if not traces:
        raise ValueError("merge_traces needs at least one rank's trace file")
    ranks = [_rank_of(t, k) for k, t in enumerate(traces)]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"the traces name ranks {ranks}: each rank once")
    base = traces[ranks.index(min(ranks))].get("baseTimeNanoseconds", 0)
    events = []
    for trace, rank in sorted(zip(traces, ranks), key=lambda pair: pair[1]):
        shift_us = (trace.get("baseTimeNanoseconds", 0) - base) / 1000
        events += _rank_events(trace, rank, shift_us)
    info = traces[0].get("distributedInfo") or {}
    merged = {"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": base,
              "otherData": {"ranks": sorted(ranks), "backend": info.get("backend"),
                            "world_size": info.get("world_size", len(ranks)),
                            "merged_from": [Path(p).name for p in rank_files]}}
    out = Path(out)
    out.write_text(json.dumps(merged), encoding="utf-8")
    return out
