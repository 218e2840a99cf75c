"""`python -m shardlib grade LAB.ipynb [--json] [--timeout S]`: run a lab in a fresh kernel and score it.

The notebook runs top to bottom in a new kernel of this Python (the course's environment), in the
notebook's own folder, with its saved outputs cleared first. Every code cell runs, even after one
fails, so a check that fails does not hide the ones after it. Each check cell (tagged `check`, or
nbgrader's `grade: true`) is worth its nbgrader `points` (default 1) and passes when it runs
without raising. The report lists each check with PASS/FAIL and its message (the exception, or the
last line the check printed), the code cells outside the checks that raised, the score and the
time taken. The exit code is 0 only when every check passes.

Nothing the notebook does can hang the grader:

    a cell past --cell-timeout      the kernel is interrupted (SIGINT to its process group, ranks
                                    included); the cell fails as "timed out" and grading goes on
    the run past --timeout          the remaining cells are not run; their checks fail as "not run"
    a kernel that dies              (a crash, out of memory) the remaining checks fail as "not run"

and whatever happens, the kernel's whole process group (the kernel and the ranks it forked) is
killed at the end; a watchdog thread kills it too if the run overstays --timeout by a minute.

--release LAB: grade against the lab as released. Its check cells replace the notebook's cells of
the same grade id, and only its checks count, so a check edited (or added) by the learner changes
nothing, and a check deleted by the learner scores 0 as "missing".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
from nbformat.reader import NotJSONError

from shardlib.course.labgen import CHECK_TAG, cell_tags

DEFAULT_TIMEOUT_S = 1800  # the whole run
DEFAULT_CELL_TIMEOUT_S = 600  # one cell (shardlib.launch's own default timeout is 300 s)
INTERRUPT_GRACE_S = 10  # after an interrupt, how long the kernel has to report the cell's end
WATCHDOG_GRACE_S = 60  # past --timeout, the process group is killed whatever the kernel does
TIMEOUT_ENAME = "CellTimeout"  # the error the grader records for a cell that ran out of time
CURRENT_ENV = "current-env"


@dataclass
class CheckResult:
    grade_id: str
    cell: int  # index in the notebook as graded
    points: float
    passed: bool
    status: str  # passed | failed | timed out | not run | missing
    message: str


@dataclass
class Report:
    notebook: str
    checks: list[CheckResult]
    errors: list[dict] = field(default_factory=list)  # code cells outside the checks that raised
    outcome: str = "completed"  # completed | timed out | kernel died
    detail: str = ""
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return sum(check.points for check in self.checks if check.passed)

    @property
    def max_score(self) -> float:
        return sum(check.points for check in self.checks)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def as_dict(self) -> dict:
        return {"notebook": self.notebook, "score": self.score, "max_score": self.max_score, "passed": self.passed,
                "outcome": self.outcome, "detail": self.detail, "seconds": round(self.seconds, 1),
                "checks": [asdict(check) for check in self.checks], "errors": self.errors}


# ---------------------------------------------------------------------------------
# scoring an executed notebook (no kernel needed)


def is_check(cell) -> bool:
    if cell.get("cell_type") != "code":
        return False
    grading = cell.get("metadata", {}).get("nbgrader", {})
    return CHECK_TAG in cell_tags(cell) or bool(grading.get("grade") and not grading.get("solution"))


def grade_id(cell, index: int) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or f"cell-{index}"


def points(cell) -> float:
    value = cell.get("metadata", {}).get("nbgrader", {}).get("points", 1)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 1


def error_of(cell) -> dict | None:
    """The cell's error output (ename, evalue), or None when it ran cleanly."""
    return next((out for out in cell.get("outputs", []) if out.get("output_type") == "error"), None)


TRACEBACK = "Traceback (most recent call last):"


def error_message(error: dict) -> str:
    """'Name: first line'; for an error that carries another process's traceback (a rank's), also that
    traceback's own exception line: the first unindented line after its frames."""
    ename, evalue = error.get("ename", "Exception"), str(error.get("evalue", ""))
    lines = [line for line in evalue.splitlines() if line.strip()]
    message = f"{ename}: {lines[0].strip()}" if lines else ename
    if TRACEBACK in evalue:
        after = evalue.rsplit(TRACEBACK, 1)[1].splitlines()
        cause = next((line.strip() for line in after if line.strip() and not line[0].isspace()), "")
        if cause and cause not in message:
            message += f" ... {cause}"
    return message


def last_printed_line(cell) -> str:
    text = "".join("".join(out.get("text", "")) for out in cell.get("outputs", [])
                   if out.get("output_type") == "stream" and out.get("name") == "stdout")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def score(notebook, ran: set[int] | None = None, timed_out: dict[int, float] | None = None,
          not_run_reason: str = "not run", name: str = "") -> Report:
    """The report of an executed notebook. ran: indices of the cells that ran (default: all code cells);
    timed_out: {index: seconds} of cells stopped by the grader; not_run_reason: why the others did not run."""
    timed_out = timed_out or {}
    checks, errors = [], []
    for index, cell in enumerate(notebook["cells"]):
        if cell.get("cell_type") != "code":
            continue
        executed = ran is None or index in ran
        error = error_of(cell)
        if index in timed_out:
            status, message = "timed out", f"the cell ran past the grader's limit of {timed_out[index]:g} s"
        elif not executed:
            status, message = "not run", not_run_reason
        elif error is not None:
            status, message = "failed", error_message(error)
        else:
            status, message = "passed", last_printed_line(cell)
        if is_check(cell):
            checks.append(CheckResult(grade_id(cell, index), index, points(cell), status == "passed", status, message))
        elif status in ("failed", "timed out"):
            errors.append({"cell": index, "status": status, "message": message})
    return Report(name, checks, errors)


# ---------------------------------------------------------------------------------
# against the released lab


def apply_release(notebook, release) -> list[CheckResult]:
    """Put the release's check cells (and points) into `notebook`, by grade id; drop checks the release
    does not have. Returns the release's checks missing from the notebook (scored 0)."""
    released = {grade_id(cell, i): cell for i, cell in enumerate(release["cells"]) if is_check(cell)}
    if not released:
        raise ValueError("the release has no check cells (tagged `check`, or nbgrader grade cells)")
    seen = set()
    for index, cell in enumerate(notebook["cells"]):
        if not is_check(cell):
            continue
        key = grade_id(cell, index)
        if key in released and key not in seen:
            seen.add(key)
            cell["source"] = released[key]["source"]
            cell["metadata"] = json.loads(json.dumps(released[key]["metadata"]))
        else:  # a check the release does not have, or a duplicate: it runs, but as an ordinary cell
            cell["metadata"]["tags"] = [tag for tag in cell_tags(cell) if tag != CHECK_TAG]
            cell["metadata"].pop("nbgrader", None)
    return [CheckResult(key, -1, points(cell), False, "missing",
                        "this check cell is not in the notebook: restore it from the released lab")
            for key, cell in released.items() if key not in seen]


# ---------------------------------------------------------------------------------
# running a notebook


def _kernel_manager():
    """A kernel of this very Python, whatever kernels are installed (as nbval's --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class CurrentEnvKernelSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            if kernel_name == CURRENT_ENV:
                return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                              **ipykernel.kernelspec.get_kernel_dict())
            return super().get_kernel_spec(kernel_name)

    return AsyncKernelManager(kernel_name=CURRENT_ENV, kernel_spec_manager=CurrentEnvKernelSpecs())


def _kill_group(pgid: int | None) -> None:
    if pgid is None or not hasattr(os, "killpg"):  # Windows: the kernel manager's own shutdown kills the kernel
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def execute(notebook, cwd: Path, timeout: float = DEFAULT_TIMEOUT_S, cell_timeout: float = DEFAULT_CELL_TIMEOUT_S,
            progress: bool = False, env: dict | None = None,
            on_kernel=None) -> tuple[set[int], dict[int, float], str, str]:
    """Run `notebook` (a NotebookNode, changed in place) cell by cell in a fresh kernel started in `cwd`.
    env: extra environment variables for the kernel; on_kernel(pid): called once the kernel runs.

    Returns (indices of the cells that ran, {index: limit} of the cells that timed out, outcome, detail)."""
    from nbclient import NotebookClient

    timed_out = {}

    def note_timeout(cell, cell_index, execute_reply):
        if execute_reply and execute_reply.get("content", {}).get("ename") == TIMEOUT_ENAME:
            timed_out[cell_index] = client.timeout

    client = NotebookClient(
        notebook, km=_kernel_manager(), timeout=cell_timeout, startup_timeout=120, allow_errors=True,
        interrupt_on_timeout=True, iopub_timeout=INTERRUPT_GRACE_S, shutdown_kernel="immediate",
        error_on_timeout={"ename": TIMEOUT_ENAME, "evalue": "the grader's time limit", "traceback": []},
        on_cell_executed=note_timeout, resources={"metadata": {"path": str(cwd)}})
    env = dict(os.environ, MPLBACKEND="Agg", **(env or {}))  # plots render to nothing, whatever backend is set
    deadline = time.monotonic() + timeout
    watchdog, pgid, fired = None, None, []

    def kill_on_deadline():
        fired.append(True)
        _kill_group(pgid)

    try:
        with client.setup_kernel(cwd=str(cwd), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
            pgid = getattr(client.km.provisioner, "pgid", None)  # the kernel leads its own process group
            if on_kernel is not None:
                on_kernel(client.km.provisioner.process.pid)
            watchdog = threading.Timer(timeout + WATCHDOG_GRACE_S, kill_on_deadline)
            watchdog.daemon = True
            watchdog.start()
            ran, outcome, detail = _run_cells(client, deadline, cell_timeout, timed_out, fired, progress)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        _kill_group(pgid)  # the kernel is shut down; its ranks, if any are left, go with it
    if outcome == "timed out":
        detail = f"the notebook ran past the grader's limit of {timeout:g} s"
    return ran, timed_out, outcome, detail


def _run_cells(client, deadline: float, cell_timeout: float, timed_out: dict, fired: list,
               progress: bool) -> tuple[set[int], str, str]:
    """Execute the code cells in order until the end, the deadline, or the kernel's death."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from tqdm.auto import tqdm

    cells = client.nb.cells
    code = [i for i, cell in enumerate(cells) if cell.cell_type == "code" and cell.source.strip()]
    ran = set()
    for index in tqdm(code, desc="grading", unit="cell", disable=None if progress else True, file=sys.stderr):
        left = deadline - time.monotonic()
        if left <= 0:
            return ran, "timed out", ""
        client.timeout = max(1, int(min(cell_timeout, left)))  # the whole run's limit bounds every cell
        ran.add(index)
        try:
            client.execute_cell(cells[index], index)
        except DeadKernelError:
            if fired:  # the watchdog killed it
                timed_out[index] = client.timeout
                return ran, "timed out", ""
            return ran, "kernel died", (f"the kernel died while running cell {index} (a crash, os._exit, or out "
                                        "of memory); the cells after it did not run")
        except CellTimeoutError:  # the kernel never reported the end of an interrupted cell
            timed_out[index] = client.timeout
        if index in timed_out and time.monotonic() >= deadline:
            return ran, "timed out", ""
    return ran, "completed", ""


def grade(path: str | Path, timeout: float = DEFAULT_TIMEOUT_S, cell_timeout: float = DEFAULT_CELL_TIMEOUT_S,
          release: str | Path | None = None, progress: bool = False) -> Report:
    """Run the notebook at `path` in a fresh kernel and score its checks (see the module docstring)."""
    path = Path(path)
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:  # a fresh run: nothing the learner saved counts
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    missing = apply_release(notebook, nbformat.read(Path(release), as_version=4)) if release else []
    started = time.monotonic()
    ran, timed_out, outcome, detail = execute(notebook, path.resolve().parent, timeout, cell_timeout, progress)
    why = detail or "not run"
    report = score(notebook, ran, timed_out, not_run_reason=why, name=str(path))
    report.checks += missing
    report.outcome, report.detail, report.seconds = outcome, detail, time.monotonic() - started
    return report


# ---------------------------------------------------------------------------------
# the command


def _points(value: float) -> str:
    return f"{value:g} point{'' if value == 1 else 's'}"


def format_report(report: Report) -> str:
    lines = [f"Graded {report.notebook}"]
    width = max([len(check.grade_id) for check in report.checks] + [8])
    for check in report.checks:
        mark = "PASS" if check.passed else "FAIL"
        status = "" if check.status in ("passed", "failed") else f"[{check.status}] "
        where = f"cell {check.cell}" if check.cell >= 0 else "missing"
        lines.append(f"  {mark}  {check.grade_id:<{width}}  {_points(check.points):>9}  ({where})  "
                     f"{status}{_shorten(check.message)}")
    if not report.checks:
        lines.append("  (no check cells: nothing to score; checks are code cells tagged `check`)")
    for error in report.errors:
        lines.append(f"  code cell {error['cell']} {error['status']}: {_shorten(error['message'])}")
    if report.outcome != "completed":
        lines.append(f"  {report.outcome.upper()}: {report.detail}")
    passed = sum(check.passed for check in report.checks)
    lines.append(f"Score: {report.score:g} / {report.max_score:g} points ({passed} of {len(report.checks)} checks "
                 f"passed) in {report.seconds:.1f} s")
    return "\n".join(lines)


def _shorten(text: str, limit: int = 220) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shardlib grade",
        description="Run a lab top to bottom in a fresh kernel, run every check cell even after one fails, "
                    "and print each check (PASS/FAIL and its message), the score and the time taken.",
        epilog="Exit code: 0 when every check passes, 1 when one does not (or the notebook hung or crashed "
               "the kernel), 2 when the notebook cannot be read.")
    parser.add_argument("notebook", help="the lab to grade, e.g. labs/03_zero1_step.ipynb")
    parser.add_argument("--json", action="store_true", help="print one JSON object (for a learning-management system)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds for the whole run (default {DEFAULT_TIMEOUT_S})")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT_S,
                        help=f"seconds for one cell (default {DEFAULT_CELL_TIMEOUT_S})")
    parser.add_argument("--release", help="the lab as released: its check cells replace the notebook's")
    args = parser.parse_args(argv)
    for name in ("timeout", "cell_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive seconds, got {getattr(args, name):g}")
    for given in (args.notebook, args.release):
        if given is not None and not Path(given).is_file():
            parser.error(f"{given}: no such notebook")
    try:
        report = grade(args.notebook, args.timeout, args.cell_timeout, args.release, progress=not args.json)
    except (NotJSONError, nbformat.ValidationError, ValueError, KeyError) as error:
        message = f"{args.notebook}: cannot grade it: {error}"
        print(json.dumps({"notebook": args.notebook, "error": message}) if args.json else f"error: {message}")
        return 2
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
