"""Labs: labs/ is what solutions/ generates, and every check cell can fail.

For each solutions/NN_name.ipynb the generated lab is executed in a fresh kernel: every cell
tagged `check` must raise there (the learner has not written the code yet), and every cell of
the solution, check cells included, must run without error. A check that passes on the
unsolved stub cannot tell a learner anything, so it is a defect.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ipykernel.kernelspec
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from shardlib.course import grading, labgen

REPO_ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = labgen.solution_paths(REPO_ROOT / "solutions")
CELL_TIMEOUT_S = 900
STUB_LIMIT_S = 1200  # the test's own guard on the stub's grading (the grader's own limit is 1800 s)
# A check that fails with one of these did not reach the learner's code: the lab is broken.
BROKEN_LAB_ERRORS = {"NameError", "SyntaxError", "IndentationError", "ImportError", "ModuleNotFoundError"}
CURRENT_ENV = "current-env"


class CurrentEnvKernelSpecs(KernelSpecManager):
    """Run notebooks with this Python, whatever kernels are installed (as nbval's current-env)."""

    def get_kernel_spec(self, kernel_name):
        if kernel_name == CURRENT_ENV:
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())
        return super().get_kernel_spec(kernel_name)


def execute(notebook: dict, cwd: Path) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel started in `cwd`, going on past errors."""
    node = nbformat.reads(json.dumps(notebook), as_version=4)
    kernel = KernelManager(kernel_name=CURRENT_ENV, kernel_spec_manager=CurrentEnvKernelSpecs())
    client = NotebookClient(node, km=kernel, timeout=CELL_TIMEOUT_S, startup_timeout=300,
                            allow_errors=True, resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return node


def error_name(cell) -> str | None:
    """The exception a code cell raised (e.g. 'AssertionError'), or None if it ran cleanly."""
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            return output.get("ename", "Exception")
    return None


def check_cells(notebook) -> list[tuple[int, dict]]:
    return [(index, cell) for index, cell in enumerate(notebook["cells"])
            if cell["cell_type"] == "code" and labgen.CHECK_TAG in labgen.cell_tags(cell)]


def checks_that_pass_on_stub(report) -> list[str]:
    """Problems with the graded lab: check cells that did not fail, or failed for a broken lab."""
    problems = []
    for check in report.checks:
        name = check.message.split(":", 1)[0]
        if check.passed:
            problems.append(f"check cell {check.cell} passes on the unsolved lab: it cannot catch a wrong answer")
        elif check.status != "failed" or name in BROKEN_LAB_ERRORS:
            problems.append(f"check cell {check.cell} ends as {check.status!r} ({check.message}), before reaching "
                            "the learner's code; keep the learner's code inside functions so the rest of the lab runs")
    return problems


def cells_that_fail(notebook) -> list[str]:
    return [f"cell {index} raised {error_name(cell)}: {''.join(cell['source'])[:200]!r}"
            for index, cell in enumerate(notebook["cells"])
            if cell["cell_type"] == "code" and error_name(cell) is not None]


def git_committed_text(path: Path) -> str | None:
    """The file as last committed, or None when there is no git, no commit or no such file."""
    relative = path.relative_to(REPO_ROOT).as_posix()
    try:
        shown = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"HEAD:{relative}"],
                               capture_output=True, text=True, encoding="utf-8", timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return shown.stdout if shown.returncode == 0 else None


def test_there_are_labs():
    assert SOLUTIONS, "no solutions/NN_name.ipynb: the course has at least one lab"


def test_labs_are_generated_from_solutions():
    stale = []
    for lab_path in labgen.stale_labs(REPO_ROOT / "solutions", REPO_ROOT / "labs", REPO_ROOT):
        expected = labgen.generate_text(REPO_ROOT / "solutions" / lab_path.name, REPO_ROOT)
        # A learner's own work in a lab leaves the committed lab as generated: that is fine.
        if git_committed_text(lab_path) != expected:
            stale.append(lab_path.relative_to(REPO_ROOT).as_posix())
    assert not stale, f"stale labs {stale}: run `python -m shardlib labs` and commit the result"
    orphans = labgen.orphan_labs(REPO_ROOT / "solutions", REPO_ROOT / "labs")
    assert not orphans, f"labs without a solution to generate them from: {orphans}"


@pytest.mark.slow  # runs the lab and its solution in a kernel, each once, through the grader
@pytest.mark.parametrize("solution_path", SOLUTIONS, ids=[path.stem for path in SOLUTIONS])
def test_checks_fail_on_lab_and_the_answer_key_gets_full_marks_against_it(solution_path: Path, tmp_path: Path):
    """The lab as released, graded: every check fails (for the learner's missing code, not a broken lab).
    The solution graded against that release (`grade solutions/X --release labs/X`): every cell of the
    solution runs, none raises, and every check passes, with tamper verification after every cell."""
    lab_path = tmp_path / solution_path.name
    lab_path.write_text(labgen.generate_text(solution_path, REPO_ROOT), encoding="utf-8")
    assert check_cells(json.loads(lab_path.read_text(encoding="utf-8"))), \
        f"{solution_path.name}: no cell tagged `check`, so nothing checks the learner's code"

    # two kernels at once: the stub graded by the command in a process of its own (a grading in this process
    # ends every process started here after its kernel), the answer key here meanwhile
    stub_run = subprocess.Popen([sys.executable, "-m", "shardlib", "grade", str(lab_path), "--release", str(lab_path),
                                 "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        solved = grading.grade(solution_path, release=lab_path)
        out, err = stub_run.communicate(timeout=STUB_LIMIT_S)
    finally:
        stub_run.kill()
    stub = json.loads(out) if out.strip() else {"error": err[-3000:]}
    problems = checks_that_pass_on_stub(SimpleNamespace(checks=[SimpleNamespace(**c) for c in stub.get("checks", [])]))
    assert not problems and stub.get("max_score", 0) > 0 and stub["score"] == 0, (problems, stub)

    print(f"answer key {solution_path.name} against its release: {solved.score:g} / {solved.max_score:g} "
          f"in {solved.seconds:.0f} s ({solved.outcome}; isolation {solved.isolation.split(':')[0]})")
    assert solved.outcome == "completed" and not solved.errors, grading.format_report(solved)
    assert solved.passed and solved.max_score == stub["max_score"], grading.format_report(solved)


@pytest.mark.slow  # starts kernels
def test_a_check_that_cannot_fail_is_caught(tmp_path: Path):
    """The machinery above on a tiny lab: one real check, one that passes whatever the code."""
    def cell(source, tags=()):
        return nbformat.v4.new_code_cell(source, metadata={"tags": list(tags)} if tags else {})

    solution = nbformat.v4.new_notebook(cells=[
        cell("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"),
        cell("assert double(21) == 42", tags=["check"]),
        cell("assert True", tags=["check"]),
        cell("assert undefined_name", tags=["check"]),
    ])
    path = tmp_path / "99_double.ipynb"
    path.write_text(nbformat.writes(solution), encoding="utf-8")
    lab_path = tmp_path / "lab.ipynb"
    lab_path.write_text(labgen.generate_text(path, tmp_path), encoding="utf-8")
    report = grading.grade(lab_path, release=lab_path)
    assert [c.message.split(":")[0] for c in report.checks] == ["NotImplementedError", "", "NameError"], report
    problems = checks_that_pass_on_stub(report)
    assert len(problems) == 2 and "cell 3 passes" in problems[0] and "NameError" in problems[1], problems
    assert cells_that_fail(execute(solution, cwd=tmp_path)) == [
        "cell 3 raised NameError: 'assert undefined_name'"]


def released_cell(lab: str, defines: str) -> str:
    cells = [c for c in json.loads((REPO_ROOT / "labs" / lab).read_text(encoding="utf-8"))["cells"]
             if c["cell_type"] == "code" and f"def {defines}(" in "".join(c["source"])]
    assert len(cells) == 1, f"{lab}: {len(cells)} cells define {defines}"
    return "".join(cells[0]["source"])


def test_the_zero3_memory_probe_counts_memory_however_it_is_reached():
    """The released p1 probe against byte counts known by construction: memory kept under a second, tiny
    storage over the same bytes (numpy's, listed first) or only as a gradient is counted, each byte once."""
    import numpy as np
    import torch

    probe = {"torch": torch}  # the lab imports it in an earlier cell
    exec(released_cell("p1_zero3_from_scratch.ipynb", "live_tensor_bytes"), probe)  # noqa: S102 - the lab's own cell
    live = probe["live_tensor_bytes"]
    memory = np.zeros(125_000)  # 1 MB
    base = live()
    tiny = torch.from_numpy(memory[:1])  # 8 bytes at the same address: formerly the only storage counted there
    full = torch.from_numpy(memory)
    assert tiny.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    assert live() - base == 1_000_000, f"aliased storages: {live() - base} bytes counted, 1,000,000 kept"
    views = [full[:10], full[5:], full.view(2, -1)]
    assert live() - base == 1_000_000, "views of one storage count its bytes once"
    del tiny, full, views
    weight = torch.zeros(1000, dtype=torch.float64, requires_grad=True)
    (weight * 2).sum().backward()  # weight.grad: 8,000 bytes with no Python object until read
    assert live() - base == 16_000, f"a parameter and its gradient: {live() - base} bytes counted, 16,000 kept"
    weight.untyped_storage().resize_(0)
    assert live() - base == 8_000, "a storage resized to 0 counts 0"
