"""The trace against shardlib's own timers, on the same run: the same events, measured twice.

    ddp_overlap(trace, rank, timeline, backward)   overlap of the bucket all-reduces with backward's compute,
                                                   from the trace and from DDP's own bucket timeline
    bucket_issue_times(trace, rank, timeline, bw)  when each bucket's all-reduce was issued, from backward's
                                                   start: its label in the trace, its "start" in the timeline
    phase_durations(trace, rank, events)           a pipeline's forwards and backwards: each label's
                                                   duration in the trace beside its Event's

Both sides use one definition. DDP: the share of the all-reduces' time that falls inside backward's
compute, from the backward's start to its last gradient (own: the first "start" to the last
"grad_ready" of the timeline; trace: the "backward" label's start to the first "wait for bucket"
label, where autograd has produced every gradient). The all-reduces are gloo's slices in the trace
and start to done in the timeline (issued to the future's callback, so a bucket queued behind
another counts its wait there, not in the trace): the two fractions differ by that.
"""

from __future__ import annotations

from shardlib.profile.read import Trace, overlap_fraction

__all__ = ["ddp_overlap", "bucket_issue_times", "phase_durations"]


def ddp_overlap(trace: Trace, rank: int, timeline: list, backward: tuple[float, float]) -> tuple[float, float]:
    """(overlap fraction from the trace, the same from DDP's timeline) for one rank."""
    start = trace.phases(rank, "backward")[0].start
    waits = trace.phases(rank, "wait for bucket")
    end = waits[0].start if waits else trace.phases(rank, "backward")[0].end
    comm = [(s.start, s.end) for s in trace.phases(rank, "gloo:all_reduce")]
    from_trace = overlap_fraction(comm, [(start, end)])
    starts = {b: t for t, event, b in timeline if event == "start"}
    dones = {b: t for t, event, b in timeline if event == "done"}
    last_grad = max(t for t, event, _ in timeline if event == "grad_ready")
    own = overlap_fraction([(starts[b], dones[b]) for b in starts if b in dones], [(backward[0], last_grad)])
    return from_trace, own


def bucket_issue_times(trace: Trace, rank: int, timeline: list, backward: tuple[float, float]) -> list:
    """(bucket, seconds from backward's start to its all-reduce's issue in the trace, the same by DDP's timeline)."""
    start = trace.phases(rank, "backward")[0].start
    labels = {int(s.name.split()[1]): (s.start - start) / 1e6 for s in trace.phases(rank, "bucket ")}
    own = {b: t - backward[0] for t, event, b in timeline if event == "start"}
    return [(b, labels[b], own[b]) for b in sorted(own) if b in labels]


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
