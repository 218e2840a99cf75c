"""`python -m shardlib trace TECHNIQUE --world-size N [--out DIR] [--memory]`: one step of a technique,
traced on every rank, with a summary read back from the trace."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["main", "run"]


def _shown(path) -> str:
    """A path relative to the current folder when it is under it (as in a lesson's output), else whole."""
    path, here = Path(path).resolve(), Path.cwd().resolve()
    return os.path.relpath(path, here) if path.is_relative_to(here) else str(path)


def run(technique: str, world_size: int, out_dir, *, memory: bool = False, device: str = "cpu") -> list[dict]:
    """Trace one step of `technique` on `world_size` ranks into `out_dir`; each rank's result (traced_step)."""
    from shardlib.launch import launch
    from shardlib.profile.techniques import TECHNIQUES, traced_step, world_size_error

    if technique not in TECHNIQUES:
        raise ValueError(f"unknown technique {technique!r}; trace knows: {', '.join(TECHNIQUES)}")
    problem = world_size_error(technique, world_size)
    if problem:
        raise ValueError(problem)
    return launch(traced_step, world_size, args=(technique, str(out_dir), memory), device=device, timeout=300)


def report(technique: str, per_rank: list[dict]) -> list[str]:
    """The lines `trace` prints: the files, then per rank the summary and the collectives against the ledger."""
    from shardlib.profile.read import read_trace, summary

    merged = read_trace(per_rank[0]["merged"])
    lines = [f"{technique}: {len(per_rank)} ranks, one traced step",
             f"  merged trace (open it in https://ui.perfetto.dev or chrome://tracing): {_shown(per_rank[0]['merged'])}",
             "  per rank: " + ", ".join(_shown(r["rank_file"]) for r in per_rank),
             f"  {'rank':>4} {'window ms':>10} {'compute':>9} {'comm':>9} {'overlapped':>10} {'idle':>9}"
             f"  collectives in the trace (= ledger?)"]
    for rank, row in summary(merged).items():
        found = dict(sorted(merged.collectives(rank).items()))
        same = found == dict(sorted(per_rank[rank]["calls"].items()))
        lines.append(f"  {rank:>4} {row['window_s'] * 1e3:10.1f} {row['compute_s'] * 1e3:9.1f} "
                     f"{row['communication_s'] * 1e3:9.1f} {row['overlapped_s'] * 1e3:10.1f} {row['idle_s'] * 1e3:9.1f}"
                     f"  {found} ({'= ledger' if same else 'ledger: ' + str(per_rank[rank]['calls'])})")
    return lines


def main(argv: list[str] | None = None) -> int:
    from shardlib.profile.techniques import DEFAULT_WORLD_SIZE, TECHNIQUES

    parser = argparse.ArgumentParser(prog="python -m shardlib trace", description=__doc__)
    parser.add_argument("technique", choices=list(TECHNIQUES), metavar="TECHNIQUE",
                        help=f"one of: {', '.join(TECHNIQUES)}")
    parser.add_argument("--world-size", type=int, help="ranks (default: 2; ep-dp: 4)")
    parser.add_argument("--out", help="folder for the traces (default: traces/TECHNIQUE)")
    parser.add_argument("--memory", action="store_true", help="also record allocations (profile_memory)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    args = parser.parse_args(argv)
    world_size = args.world_size or DEFAULT_WORLD_SIZE[args.technique]
    out = Path(args.out or Path("traces") / args.technique)
    try:
        per_rank = run(args.technique, world_size, out, memory=args.memory, device=args.device)
    except ValueError as error:
        print(f"nothing was run: {error}", file=sys.stderr)
        return 2
    print("\n".join(report(args.technique, per_rank)))
    return 0
