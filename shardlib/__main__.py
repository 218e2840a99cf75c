"""Command line: `python -m shardlib verify | bench | labs`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlib", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    verify = commands.add_parser("verify", help="check each technique against its single-device reference")
    verify.add_argument("--technique", action="append", help="a technique name (repeatable); default: all")
    verify.add_argument("--world-size", type=int, action="append", help="world size (repeatable); default: per technique")
    verify.add_argument("--json", action="store_true", help="print a JSON list of records")

    bench = commands.add_parser("bench", help="from-scratch vs PyTorch, side by side, printing ratios")
    bench.add_argument("names", nargs="*", help="benchmarks to run; default: all")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (for a smoke run)")
    bench.add_argument("--json", action="store_true", help="print a JSON list of rows")

    args = parser.parse_args(argv)
    if args.command == "verify":
        from shardlib import verify as module

        for size in args.world_size or []:
            if size < 1:
                parser.error(f"--world-size must be >= 1, got {size}")
        return module.main(args.technique, args.world_size, args.json)
    if args.command == "bench":
        from shardlib import bench as module

        return module.main(args.names, args.json, quick=args.quick)
    return 2


if __name__ == "__main__":
    sys.exit(main())
