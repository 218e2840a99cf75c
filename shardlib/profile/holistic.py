"""The traces read by Holistic Trace Analysis (HTA, `HolisticTraceAnalysis` on PyPI, github.com/facebookresearch/HolisticTraceAnalysis).

HTA parses each rank's torch.profiler file into a pandas DataFrame (one row per event: name, category,
ts, dur, thread ...), and computes from the GPU kernels a temporal breakdown (compute, communication,
idle), the communication/computation overlap and kernel statistics. On CPU ranks there are no
kernels: those analyses return NaN, empty tables, or raise (`gpu_analyses` says which), while the
DataFrames are complete. So shardlib reads HTA's DataFrames as an independent reader of the same
files (the tests count collectives in them), and computes the CPU breakdown itself (shardlib.profile.read).

HTA prints a line per file it parses; here it parses quietly, in this process.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections import Counter
from pathlib import Path

from shardlib.profile.read import LEDGER_KINDS

__all__ = ["hta_frames", "hta_collectives", "gpu_analyses"]


@contextlib.contextmanager
def _quiet():
    logger = logging.getLogger("hta")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pandas' deprecation notices about HTA's calls
            yield
    finally:
        logger.setLevel(level)


def _parsed(rank_files: dict):
    with _quiet():
        from hta.common.trace import Trace

        parsed = Trace({rank: str(Path(path).resolve()) for rank, path in rank_files.items()})  # HTA wants whole paths
        parsed.parse_traces(use_multiprocessing=False)
    return parsed


def hta_frames(rank_files: dict) -> dict:
    """{rank: DataFrame} of every event HTA keeps from `rank_files` ({rank: path}), names and categories as text."""
    parsed = _parsed(rank_files)
    symbols = parsed.symbol_table.get_sym_table()
    frames = {}
    for rank in rank_files:
        df = parsed.get_trace(rank).copy()
        df["name"] = df["name"].map(lambda k: symbols[k] if 0 <= k < len(symbols) else "")
        df["cat"] = df["cat"].map(lambda k: symbols[k] if 0 <= k < len(symbols) else "")
        frames[rank] = df
    return frames


def hta_collectives(frame) -> Counter:
    """Calls per ledger kind in one rank's HTA DataFrame: its c10d operators."""
    return Counter(LEDGER_KINDS[name] for name in frame["name"] if name in LEDGER_KINDS)


def gpu_analyses(rank_files: dict) -> dict:
    """What HTA's kernel-based analyses return on these files: {analysis: result, or the error's name}."""
    with _quiet():
        from hta.trace_analysis import TraceAnalysis

        analysis = TraceAnalysis(trace_files={rank: str(Path(path).resolve()) for rank, path in rank_files.items()})
        out = {}
        for name in ("get_temporal_breakdown", "get_comm_comp_overlap", "get_idle_time_breakdown",
                     "get_gpu_kernel_breakdown"):
            try:
                out[name] = getattr(analysis, name)(visualize=False)
            except Exception as error:  # noqa: BLE001 - what HTA does with CPU-only traces is the result
                out[name] = f"raises {type(error).__name__}"
    return out
