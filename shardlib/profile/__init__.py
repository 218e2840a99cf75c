"""Profiler traces of sharded steps, as practitioners read them (lesson 13).

    record.py      `shardlib.trace(DIR)`: a torch.profiler trace on every rank, then one merged file
    merge.py       the ranks' Chrome-trace files as one timeline: a process row per rank, one clock
    read.py        slices back from a trace: collectives, phases, compute, communication, overlap, idle
    timeline.py    the pictures: per-rank compute and communication lanes; memory over time
    techniques.py  one traced step of each technique `verify` knows (`python -m shardlib trace`)
    cli.py         `python -m shardlib trace TECHNIQUE --world-size N [--out DIR] [--memory]`

Open a merged trace at https://ui.perfetto.dev (Open trace file) or chrome://tracing (Load): each
rank is a process; its rows are the Python thread (operators, shardlib's labels) and gloo's threads
(the collectives running). Holistic Trace Analysis (`hta.trace_analysis.TraceAnalysis`) reads the
per-rank files of a folder.
"""

from shardlib.profile.record import trace

__all__ = ["trace"]
