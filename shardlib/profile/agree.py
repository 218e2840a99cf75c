"""The trace against shardlib's own timers, on the same run: the same events, measured twice.

    ddp_overlap(trace, rank, timeline, backward)   the share of the bucket all-reduces' time that falls inside
                                                   backward, from the trace's labels and from DDP's own timeline
    bucket_intervals(trace, rank, timeline, bw)    each bucket's issue and completion, from backward's start,
                                                   in the trace and by the timeline
    phase_durations(trace, rank, events)           a pipeline's forwards and backwards: each label's
                                                   duration in the trace beside its Event's

DDP's events are the same moments on both sides (shardlib.parallel.ddp takes each timeline reading inside
the label of the same name): backward's start (the "backward" label; its perf_counter reading), each
bucket's issue ("bucket b all-reduce"; its "start") and its completion ("bucket b done", opened in the
completion callback of the collective's future on gloo's thread; its "done"). Backward computes until
its last gradient, whose hook issues the last bucket: the window is backward's start to the last issue.
So the two fractions differ only by the two clocks and the microseconds between a label's opening and
the reading inside it (more when the process is descheduled between the two).

What the trace shows besides, and the timeline cannot: gloo's own slices ("gloo:all_reduce"), the
collective running. A bucket's interval from issue to completion also holds its wait for one of gloo's
threads, and the callback's wait for the interpreter; summary() in
shardlib.profile.read measures the slices against the operators instead.
"""

from __future__ import annotations

import re

from shardlib.profile.read import Trace, overlap_fraction

__all__ = ["ddp_overlap", "bucket_intervals", "phase_durations"]

_ISSUE = re.compile(r"bucket (\d+) all-reduce( \(ring\))?$")
_DONE = re.compile(r"bucket (\d+) done$")


def _labels(trace: Trace, rank: int, pattern) -> dict:
    """{bucket: the first slice on `rank` whose name matches `pattern`}."""
    found = {}
    for s in trace.phases(rank, "bucket "):
        match = pattern.match(s.name)
        if match:
            found.setdefault(int(match.group(1)), s)
    return found


def _traced_buckets(trace: Trace, rank: int) -> tuple[float, dict, dict]:
    """(backward's start, {bucket: issue}, {bucket: completion}) in the trace, in microseconds."""
    backward = trace.phases(rank, "backward")
    issued, done = _labels(trace, rank, _ISSUE), _labels(trace, rank, _DONE)
    if not backward or not issued:
        raise ValueError(f"rank {rank}: no 'backward' or 'bucket b all-reduce' label in the trace")
    if set(done) != set(issued):
        raise ValueError(f"rank {rank}: 'bucket b done' labels for buckets {sorted(done)}, issues for {sorted(issued)}: "
                         "trace a DistributedDataParallel(record_timeline=True), with a profiler that records every "
                         "thread (shardlib.trace)")
    return backward[0].start, {b: s.start for b, s in issued.items()}, {b: s.start for b, s in done.items()}


def _timeline_buckets(timeline: list) -> tuple[dict, dict]:
    starts = {b: t for t, event, b in timeline if event == "start"}
    dones = {b: t for t, event, b in timeline if event == "done"}
    return starts, dones


def ddp_overlap(trace: Trace, rank: int, timeline: list, backward: tuple[float, float]) -> tuple[float, float]:
    """(overlap fraction from the trace, the same from DDP's timeline) for one rank: the share of the union of
    the buckets' issue-to-completion intervals that falls between backward's start and the last issue."""
    start, issued, done = _traced_buckets(trace, rank)
    from_trace = overlap_fraction([(issued[b], done[b]) for b in issued], [(start, max(issued.values()))])
    starts, dones = _timeline_buckets(timeline)
    own = overlap_fraction([(starts[b], dones[b]) for b in starts], [(backward[0], max(starts.values()))])
    return from_trace, own


def bucket_intervals(trace: Trace, rank: int, timeline: list, backward: tuple[float, float]) -> list:
    """(bucket, (issue, completion) in the trace, the same by the timeline), seconds from backward's start."""
    start, issued, done = _traced_buckets(trace, rank)
    starts, dones = _timeline_buckets(timeline)
    return [(b, ((issued[b] - start) / 1e6, (done[b] - start) / 1e6), (starts[b] - backward[0], dones[b] - backward[0]))
            for b in sorted(starts) if b in issued]


def phase_durations(trace: Trace, rank: int, events: list) -> list[tuple[str, float, float]]:
    """(label, seconds in the trace, seconds by the timeline's Event) for each forward, backward and W of a rank."""
    labels = {s.name: s.dur / 1e6 for s in trace.phases(rank, "stage ")}
    rows = []
    for e in events:
        # the label names the virtual stage; the Event its rank and chunk (virtual stage = chunk * p + rank)
        matches = [name for name in labels if name.endswith(f" {e.op} micro-batch {e.microbatch}")
                   and int(name.split()[1]) % max(1, len(trace.ranks)) == e.rank
                   and int(name.split()[1]) // max(1, len(trace.ranks)) == e.chunk]
        if len(matches) != 1:
            raise ValueError(f"rank {rank}: {len(matches)} labels for {e.op} of micro-batch {e.microbatch}, "
                             f"chunk {e.chunk}")
        rows.append((matches[0], labels[matches[0]], e.end - e.start))
    return rows
