"""Command line: `python -m shardlib verify | bench | trace | plan | simulate | labs | lessons | doctor | grade`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # plan has its own options (python -m shardlib plan --help)
        from shardlib.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["simulate"]:  # simulate has its own options (python -m shardlib simulate --help)
        from shardlib.simulate.cli import main as simulate_main

        return simulate_main(argv[1:])
    if argv[:1] == ["doctor"]:  # doctor has its own options (python -m shardlib doctor --help)
        from shardlib.course.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["grade"]:  # grade has its own options (python -m shardlib grade --help)
        from shardlib.course.grading.cli import main as grade_main

        return grade_main(argv[1:])
    if argv[:1] == ["trace"]:  # trace has its own options (python -m shardlib trace --help)
        from shardlib.profile.cli import main as trace_main

        return trace_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m shardlib", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    verify = commands.add_parser("verify", help="check each technique against its single-device reference")
    verify.add_argument("--technique", action="append", help="a technique name (repeatable); default: all")
    verify.add_argument("--world-size", type=int, action="append", help="world size (repeatable); default: per technique")
    verify.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                        help="cpu: processes over gloo (default); cuda: one GPU per rank (NCCL); "
                             "auto: GPUs when there are enough")
    verify.add_argument("--json", action="store_true", help="print a JSON list of records")

    bench = commands.add_parser("bench", help="from-scratch vs PyTorch, side by side, printing ratios")
    bench.add_argument("names", nargs="*", help="benchmarks to run; default: all")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (for a smoke run)")
    bench.add_argument("--json", action="store_true", help="print a JSON list of rows")

    labs = commands.add_parser("labs", help="regenerate labs/ from solutions/")
    labs.add_argument("--check", action="store_true", help="change nothing; exit non-zero and list stale labs")
    labs.add_argument("--force", action="store_true", help="overwrite labs that hold outputs (someone's work)")
    labs.add_argument("--json", action="store_true", help="print a JSON object of what was written or is stale")

    labs.add_argument("--root", help="the course folder holding solutions/ (default: found from here)")
    labs.add_argument("--nbgrader", metavar="DIR", help="instead, write nbgrader's source notebooks (the solutions "
                      "with the labs' cell metadata) into DIR/source/<lab>/, for `nbgrader generate_assignment`")

    lessons = commands.add_parser("lessons", help="write the lessons, labs, solutions and configs into a folder")
    lessons.add_argument("dir", help="the folder to write into (created if missing)")
    lessons.add_argument("--force", action="store_true", help="overwrite files that differ (someone's work)")
    lessons.add_argument("--no-solutions", action="store_true",
                         help="leave out solutions/ (a release for learners: the labs' notes name no solution)")

    commands.add_parser("trace", help="one step of a technique under torch.profiler, every rank, merged (trace --help)")
    commands.add_parser("plan", help="rank dp/tp/pp/ZeRO layouts for a model on a cluster (plan --help)")
    commands.add_parser("simulate", help="one rank of a large job, run by shardlib's code on meta tensors, "
                        "against the planner (simulate --help)")
    commands.add_parser("doctor", help="versions, GPUs, and the device each lesson will use here (doctor --help)")
    commands.add_parser("grade", help="run a lab in a fresh kernel and score its checks (grade LAB.ipynb --help)")

    args = parser.parse_args(argv)
    if args.command == "verify":
        from shardlib.checks.registry import verify_main

        for size in args.world_size or []:
            if size < 1:
                parser.error(f"--world-size must be >= 1, got {size}")
        return verify_main(args.technique, args.world_size, args.json, device=args.device)
    if args.command == "bench":
        from shardlib.checks.registry import bench_main

        return bench_main(args.names, args.json, quick=args.quick)
    if args.command == "labs":
        from shardlib.course import labgen

        if args.nbgrader:
            return labgen.nbgrader_main(Path(args.nbgrader), Path(args.root) if args.root else None)
        return labgen.main(check=args.check, force=args.force, as_json=args.json,
                           root=Path(args.root) if args.root else None)
    if args.command == "lessons":
        from shardlib.course import export

        return export.main(args.dir, force=args.force, solutions=not args.no_solutions)
    return 2


if __name__ == "__main__":
    sys.exit(main())
