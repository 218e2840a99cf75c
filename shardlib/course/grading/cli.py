"""`python -m shardlib grade`: the command line, for one notebook or a whole class.

Every problem with the input (a file that is not a notebook, a missing path, an option out of range,
an unknown option) exits with status 2 and one line saying what to change, as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from shardlib.course.grading.grade import DEFAULT_CELL_TIMEOUT_S, DEFAULT_TIMEOUT_S, grade
from shardlib.course.grading.notebook import GradeInputError, against_release, read_notebook
from shardlib.course.grading.report import format_report
from shardlib.course.grading.sandbox import DEFAULT_MEMORY_GIB, DEFAULT_PROCESSES, become_subreaper, check_isolation
from shardlib.course.grading.stopping import stop_on_signals


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print its usage and exit 2 itself
        raise GradeInputError(message)


def seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError
    return value


seconds.__name__ = "positive seconds"


def gib(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0.5:
        raise ValueError
    return value


gib.__name__ = "GiB (0.5 or more)"


def process_count(text: str) -> int:
    value = int(text)
    if value < 8:
        raise ValueError
    return value


process_count.__name__ = "process count (8 or more)"


def parser() -> Parser:
    p = Parser(prog="python -m shardlib grade", description=(
        "Run a lab top to bottom in a fresh, sandboxed kernel, run every check cell even after one fails, and "
        "print each check (PASS/FAIL and its message), the score and the time taken. With --class, grade every "
        "learner's copy of every released lab and write the reports and a CSV of scores."),
        epilog="Exit code: 0 when every check passes (--class: when every grading ran to its end), 1 when one "
               "does not, 2 when the input cannot be used. See INSTRUCTORS.md, 'Grading'.")
    p.add_argument("notebook", nargs="?", help="the lab to grade, e.g. labs/03_zero1_step.ipynb")
    p.add_argument("--release", help="the lab as released (a notebook; '-' reads it from standard input); "
                                     "with --class, the folder of released labs")
    p.add_argument("--class", dest="class_dir", metavar="SUBMISSIONS_DIR",
                   help="grade a class: SUBMISSIONS_DIR/<learner>/.../<lab>.ipynb for every released lab")
    p.add_argument("--out", metavar="RESULTS_DIR", help="with --class: where reports and scores.csv go "
                                                        "(outside the submissions and the release)")
    p.add_argument("--jobs", type=int, default=1, help="with --class: notebooks graded at once")
    p.add_argument("--json", action="store_true", help="print JSON (for a learning-management system)")
    p.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds for the whole notebook (default {DEFAULT_TIMEOUT_S})")
    p.add_argument("--cell-timeout", type=seconds, default=DEFAULT_CELL_TIMEOUT_S,
                   help=f"seconds for one cell (default {DEFAULT_CELL_TIMEOUT_S})")
    p.add_argument("--memory", type=gib, default=DEFAULT_MEMORY_GIB,
                   help=f"GiB the kernel and its processes may hold together (default {DEFAULT_MEMORY_GIB:g})")
    p.add_argument("--processes", type=process_count, default=DEFAULT_PROCESSES,
                   help=f"processes the kernel may have at once (default {DEFAULT_PROCESSES})")
    p.add_argument("--isolation", choices=("auto", "bwrap", "none"), default="auto",
                   help="auto: bubblewrap where it works, else none; bwrap: refuse to grade without it")
    p.add_argument("--hide", action="append", default=[], help=argparse.SUPPRESS)  # --class passes its folders
    return p


def fail(message: str, as_json: bool) -> int:
    print(json.dumps({"error": message}) if as_json else f"error: {message}")
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    try:
        args = parser().parse_args(argv)
        if args.jobs < 1:
            raise GradeInputError("--jobs must be at least 1")
        check_isolation(args.isolation)
        if args.class_dir is not None:
            from shardlib.course.grading.classroom import grade_class

            return grade_class(args)
        if args.notebook is None:
            raise GradeInputError("name a notebook to grade, or --class SUBMISSIONS_DIR --release DIR --out DIR")
        if args.out is not None:
            raise GradeInputError("--out goes with --class; for one notebook, redirect the output (--json > FILE)")
        release = args.release
        if release == "-":
            release = _release_from_stdin()
        submission = read_notebook(args.notebook)
        if release is not None:  # a bad release is refused before any kernel starts
            against_release(submission, release if hasattr(release, "cells") else read_notebook(release))
    except GradeInputError as error:
        return fail(str(error), as_json)
    stop_on_signals()
    become_subreaper()
    report = grade(args.notebook, release, args.timeout, args.cell_timeout, args.memory, args.processes,
                   args.isolation, hide=[Path(p) for p in args.hide], progress=not as_json,
                   release_name="(standard input)" if args.release == "-" else "")
    print(json.dumps(report.as_dict(), indent=1) if as_json else format_report(report), flush=True)
    return 0 if report.passed else 1


def _release_from_stdin():
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".ipynb") as handle:
        handle.write(sys.stdin.buffer.read())
        handle.flush()
        return read_notebook(handle.name)
