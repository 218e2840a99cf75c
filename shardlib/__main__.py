"""Command line: `python -m shardlib verify | bench | plan | labs`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # plan has its own options (python -m shardlib plan --help)
        from shardlib.plan.cli import main as plan_main

        return plan_main(argv[1:])
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

    labs = commands.add_parser("labs", help="regenerate labs/ from solutions/")
    labs.add_argument("--check", action="store_true", help="change nothing; exit non-zero and list stale labs")
    labs.add_argument("--force", action="store_true", help="overwrite labs that hold outputs (someone's work)")

    commands.add_parser("plan", help="rank dp/tp/pp/ZeRO layouts for a model on a cluster (plan --help)")

    args = parser.parse_args(argv)
    if args.command == "verify":
        from shardlib.checks.registry import verify_main

        for size in args.world_size or []:
            if size < 1:
                parser.error(f"--world-size must be >= 1, got {size}")
        return verify_main(args.technique, args.world_size, args.json)
    if args.command == "bench":
        from shardlib.checks.registry import bench_main

        return bench_main(args.names, args.json, quick=args.quick)
    if args.command == "labs":
        from shardlib.course import labgen

        return labgen.main(check=args.check, force=args.force)
    return 2


if __name__ == "__main__":
    sys.exit(main())
