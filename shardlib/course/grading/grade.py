"""Grading one notebook: run it cell by cell in a sandboxed kernel, verify after every cell, score the checks.

A check passes when the kernel's reply to it says `ok` and the verification after it (tamper.py)
finds nothing changed. How each check can end:

    passed | failed        the reply's status (failed: the exception's name and first line)
    out of memory          it failed with MemoryError or a failed allocation, or the kernel was killed
                           for holding more memory than allowed
    timed out              it ran past --cell-timeout: interrupted (SIGINT to the kernel and its ranks)
    kernel died            the kernel's process ended during it (os._exit, a crash, a signal)
    kernel died            also a check whose reply came but whose kernel died before the verification after it
                           (a reply can be forged from the kernel: only a verified one counts)
    not run                it never started; the message says why: the kernel died or was unresponsive
                           (ignored the interrupt INTERRUPT_GRACE_S; it is then killed) after cell N, the
                           run passed --timeout, or the grader was stopped (SIGTERM, SIGHUP)
    tampered               the notebook changed what the checks rely on: every check scores 0
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from shardlib.course.grading.kernel import Kernel, Run
from shardlib.course.grading.notebook import (against_release, code_cells, fresh, grade_id, is_answer, is_check,
                                              points, read_notebook)
from shardlib.course.grading.report import CheckResult, Report, cap, error_message
from shardlib.course.grading.review import review
from shardlib.course.grading.sandbox import DEFAULT_MEMORY_GIB, DEFAULT_PROCESSES, make_sandbox
from shardlib.course.grading.stopping import GraderStopped
from shardlib.course.grading.tamper import Verifier, take_baseline, verify

DEFAULT_TIMEOUT_S = 1800  # the whole run
DEFAULT_CELL_TIMEOUT_S = 600  # one cell (shardlib.launch's own default timeout is 300 s)
VERIFY_TIMEOUT_S = 120  # the grader's own code in the kernel, after a cell (the first imports what the labs use)
OOM_MARKS = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "out of memory")


def grade(path: str | Path, release=None, timeout: float = DEFAULT_TIMEOUT_S,
          cell_timeout: float = DEFAULT_CELL_TIMEOUT_S, memory_gib: float = DEFAULT_MEMORY_GIB,
          processes: int = DEFAULT_PROCESSES, isolation: str = "auto", hide=(), progress: bool = False,
          release_name: str = "") -> Report:
    """Grade the notebook at `path` (against `release`: a path, or a notebook already read, named release_name)."""
    path = Path(path)
    submission = read_notebook(path)
    if release is not None and not hasattr(release, "cells"):
        release_name, hide = str(release), [*hide, Path(release).resolve().parent]
        release = read_notebook(release)
    graded = against_release(submission, release) if release is not None else fresh(submission)
    stubs = None if release is None else [c.source for c in release.cells if c.cell_type == "code" and is_answer(c)]
    report = Report(notebook=str(path), release=release_name)
    cells = code_cells(graded)
    report.review = [cap(found, 300) for found in review(
        [(i, r, source, grade_id(graded.cells[i], i)) for i, r, source in cells], stubs or ())][:200]
    checks = {i: CheckResult(grade_id(cell, i), i, points(cell), "not run", "")
              for i, cell in enumerate(graded.cells) if is_check(cell)}
    report.checks = list(checks.values())
    scratch = Path(tempfile.mkdtemp(prefix="shardlib-grade-"))
    started = time.monotonic()
    why_not_run = "not run"
    try:
        sandbox = make_sandbox(scratch, [path.resolve().parent, *hide], memory_gib, processes, isolation)
        report.isolation = sandbox.describe()
        with Kernel(sandbox) as kernel:
            why_not_run = _run(kernel, Verifier(cells, stubs), cells, checks, report, started + timeout, cell_timeout,
                               timeout, progress)
    except GraderStopped as stopped:
        report.outcome, report.detail = "stopped", f"the grader was stopped by {stopped}"
        why_not_run = f"not run ({report.detail})"
    except RuntimeError as error:  # the kernel did not start, or the baseline could not be taken
        report.outcome, report.detail = "error", str(error)
        why_not_run = f"not run ({error})"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for check in report.checks:
        if check.status == "not run" and not check.message:
            check.message = why_not_run
    if report.outcome == "tampered":
        for check in report.checks:
            check.status, check.message = "tampered", "the notebook changed what the checks rely on (see above)"
    report.seconds = time.monotonic() - started
    return report


def _run(kernel: Kernel, verifier: Verifier, cells, checks: dict, report: Report, deadline: float,
         cell_timeout: float, timeout: float, progress: bool) -> str:
    """Run the cells; return why the cells left did not run."""
    take_baseline(kernel, verifier, VERIFY_TIMEOUT_S)
    waiting = []  # released cells whose verification is the next cell's (Verifier.can_wait)
    for position, (index, cell_role, source) in enumerate(cells):
        left = deadline - time.monotonic()
        if left <= 0:
            report.outcome, report.detail = "timed out", f"the notebook ran past the grader's limit of {timeout:g} s"
            _unverified(checks, waiting, "timed out", "the grader's limit came before it could verify the check")
            return f"not run ({report.detail})"
        limit = min(cell_timeout, left)
        run = kernel.run(source, limit)
        _record(index, cell_role, run, limit, checks, report)
        if progress:
            print(f"  cell {index} ({cell_role}): {run.status} in {run.seconds:.1f} s", file=sys.stderr, flush=True)
        if run.status == "died":
            reason = kernel.died_why()
            report.outcome = "out of memory" if reason.startswith("out of memory") else "kernel died"
            report.detail = f"the kernel died in cell {index}: {reason}"
            if index in checks:
                checks[index].status, checks[index].message = report.outcome, reason
            _unverified(checks, waiting, "kernel died", f"the kernel died in cell {index}, before the grader could "
                                                        f"verify the check: {reason}")
            return f"not run (the kernel died in cell {index})"
        if run.status == "unresponsive":
            report.outcome = "unresponsive"
            report.detail = (f"cell {index} ran past the limit and ignored the interrupt for "
                             f"{run.seconds - limit:.0f} s: the kernel was killed")
            _unverified(checks, waiting, "kernel died", f"the kernel was killed in cell {index}, before the grader "
                                                        "could verify the check")
            return f"not run (kernel unresponsive after cell {index})"
        following = cells[position + 1] if position + 1 < len(cells) else None
        if following is not None and verifier.can_wait(index, cell_role, *following[:2]):
            waiting.append(index)
            continue
        found = verify(kernel, verifier, index, cell_role, VERIFY_TIMEOUT_S, covering=waiting)
        covered, waiting = [*waiting, index], []
        if found is None:  # a check passes only once the verification after it has run: its reply may be forged
            reason = f"the kernel died right after it, before the grader could verify it: {kernel.died_why()}"
            _unverified(checks, covered, "kernel died", reason)
            report.outcome, report.detail = "kernel died", f"the kernel died after cell {index}: {kernel.died_why()}"
            return f"not run (the kernel died after cell {index})"
        if found:
            report.outcome = "tampered"
            report.detail = f"cell {index} ({cell_role}) changed what the checks rely on"
            report.tampering = [cap(f"cell {index} ({cell_role}): {what}", 300) for what in found[:20]]
            return "not run (tampered)"
    return "not run"


def _unverified(checks: dict, indices, status: str, reason: str) -> None:
    """The checks among `indices` that passed before any verification after them ran: not passed."""
    for index in indices:
        if index in checks and checks[index].status == "passed":
            checks[index].status, checks[index].message = status, reason


def _record(index: int, cell_role: str, run: Run, limit: float, checks: dict, report: Report) -> None:
    if run.status == "ok":
        status, message = "passed", run.last_line()
    elif run.status == "error":
        message = error_message(run.ename, run.evalue)
        status = "out of memory" if any(mark in message for mark in OOM_MARKS) else "failed"
    elif run.status in ("timed out", "unresponsive"):
        status = "timed out"
        message = f"the cell ran past the grader's limit of {limit:g} s" + (
            " and ignored the interrupt" if run.status == "unresponsive" else "")
    else:
        return  # died: the caller says why
    if index in checks:
        checks[index].status, checks[index].message, checks[index].seconds = status, message, run.seconds
    elif status != "passed":
        report.errors.append({"cell": index, "status": status, "message": message})
