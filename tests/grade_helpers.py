"""Small labs for the grader's tests, made by the lab generator from a solution written here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil

from shardlib.course import labgen

REPO_ROOT = Path(__file__).resolve().parent.parent
GRADE_LIMIT_S = 600  # the test's own guard: a grader that hangs fails here instead of hanging the suite
ANSWER = "def double(x):\n    return x * 2"


def code(source: str, tags=()) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source, metadata={"tags": list(tags)} if tags else {})


LIGHT = ("TOL = 0\n\n\ndef helper(x):\n    return x * 2",  # no torch: a kernel that starts in a second
         ["assert abs(double(3) - helper(3)) <= TOL, 'double(3) is wrong'", "assert all([double(2) == 4])"])


def double_solution(checks=None, setup=None) -> nbformat.NotebookNode:
    """A lab in four cells: a locked set-up (torch, shardlib, a tolerance, data, a helper), the answer, two checks."""
    checks = checks or [
        "assert torch.allclose(double(torch.ones(3)), helper(torch.ones(3)), atol=TOL), 'double is wrong'",
        "assert callable(shardlib.launch) and all([double(2) == EXPECTED[2]]), 'double(2) is not 4'\n"
        "print('double(2) is 4')"]
    setup = setup or "import torch\nimport shardlib\nTOL = 1e-6\nEXPECTED = {2: 4}\n\n\ndef helper(x):\n    return x * 2"
    return nbformat.v4.new_notebook(cells=[
        code(setup),
        code("def double(x):\n    ### BEGIN SOLUTION\n    return x * 2\n    ### END SOLUTION"),
        *[code(check, ["check"]) for check in checks]])


def light_lab(folder: Path, checks=None) -> Path:
    """The same lab without torch (for the tests of dying, hanging and forking kernels)."""
    return write_lab(folder, double_solution(checks or LIGHT[1], LIGHT[0]))


def write_lab(folder: Path, solution=None, name: str = "99_double.ipynb") -> Path:
    """The lab generated from `solution` (default double_solution()), written to folder/name."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"solution-{name}"
    source.write_text(nbformat.writes(solution or double_solution()), encoding="utf-8")
    path = folder / name
    path.write_text(labgen.generate_text(source, folder), encoding="utf-8")
    source.unlink()
    return path


def submit(lab: Path, folder: Path, answer: str = ANSWER, added=(), name: str | None = None) -> Path:
    """A learner's copy of `lab`: its answer cell holding `answer`, and cells of their own `added` after it."""
    notebook = nbformat.read(lab, as_version=4)
    index = next(i for i, c in enumerate(notebook.cells) if c.metadata.get("nbgrader", {}).get("solution"))
    notebook.cells[index].source = answer
    notebook.cells[index + 1:index + 1] = [code(source) for source in added]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name or lab.name)
    nbformat.write(notebook, path)
    return path


def run_grader(*args: str, timeout: float = GRADE_LIMIT_S) -> tuple[int, dict, float]:
    """`python -m shardlib grade ARGS --json` as an instructor runs it: (exit code, its JSON, seconds)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "shardlib", "grade", *map(str, args), "--json"],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    assert done.stdout.strip(), f"no output; stderr:\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout), time.monotonic() - started


def statuses(report: dict) -> dict[str, str]:
    return {check["grade_id"]: check["status"] for check in report["checks"]}


def leftovers(marker: str) -> list[psutil.Process]:
    """Processes still alive whose command line holds `marker`."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if marker in " ".join(process.info["cmdline"] or []) and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            pass
    return found
