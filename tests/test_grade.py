"""`python -m shardlib grade`: scores, messages, hangs, crashes, and real labs with planted mistakes.

The scores expected here come from the labs' own metadata (points per check) and from reading what
each planted mistake breaks, never from running the grader first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import psutil
import pytest

from shardlib.course import grade, labgen

REPO_ROOT = Path(__file__).resolve().parent.parent
GRADE_LIMIT_S = 900  # the test's own guard: a grader that hangs fails here instead of hanging the suite


def code(source: str, check: bool = False, points: float | None = None):
    metadata = {"tags": ["check"]} if check else {}
    if points is not None:
        metadata["nbgrader"] = {"grade": True, "grade_id": f"worth-{points}", "points": points}
    return nbformat.v4.new_code_cell(source, metadata=metadata)


def write(folder: Path, name: str, cells) -> Path:
    path = folder / name
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


def run_grader(path: Path, *options: str) -> tuple[int, dict]:
    """The command, in a fresh process, as an instructor runs it; returns (exit code, its JSON)."""
    done = subprocess.run([sys.executable, "-m", "shardlib", "grade", str(path), "--json", *options],
                          capture_output=True, text=True, timeout=GRADE_LIMIT_S, cwd=REPO_ROOT)
    assert done.stdout.strip(), f"no output; stderr:\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout)


def statuses(report: dict) -> dict[str, str]:
    return {check["grade_id"]: check["status"] for check in report["checks"]}


# ---------------------------------------------------------------------------------
# scoring, on notebooks whose outputs are written here (no kernel)


def executed(cells_and_outputs):
    cells = []
    for cell, outputs in cells_and_outputs:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = outputs, 1
        cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells)


def stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def error(ename, evalue):
    return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[])


RANK_ERROR = ("rank 1 failed; its traceback follows.\n\nTraceback (most recent call last):\n"
              "  File \"launch.py\", line 224, in _rank_main\n    result = fn(*args)\n"
              "AssertionError: N=2: rank 1 sent 3 elements, expected 4\n\n(ranks [0] failed too, most likely because "
              "rank 1 stopped.)")


def test_score_counts_points_of_passing_checks_and_names_failures():
    notebook = executed([
        (code("x = 1"), [stream("setup\n")]),
        (code("assert x == 1", check=True), [stream("first line\nx is one\n")]),
        (code("assert x == 2", check=True, points=3), [error("AssertionError", "x is 1, expected 2")]),
        (code("1 / 0"), [error("ZeroDivisionError", "division by zero")]),
        (code("launch()", check=True, points=2), [error("RankError", RANK_ERROR)]),
        (nbformat.v4.new_markdown_cell("text"), []),
    ])
    report = grade.score(notebook, name="lab.ipynb")
    assert (report.score, report.max_score, report.passed) == (1, 6, False)
    assert [(c.grade_id, c.cell, c.points, c.status) for c in report.checks] == [
        ("cell-1", 1, 1, "passed"), ("worth-3", 2, 3, "failed"), ("worth-2", 4, 2, "failed")]
    assert report.checks[0].message == "x is one"  # the last line the check printed
    assert report.checks[1].message == "AssertionError: x is 1, expected 2"
    assert report.checks[2].message == ("RankError: rank 1 failed; its traceback follows. ... "
                                        "AssertionError: N=2: rank 1 sent 3 elements, expected 4")
    assert report.errors == [{"cell": 3, "status": "failed", "message": "ZeroDivisionError: division by zero"}]
    text = grade.format_report(report)
    assert "Score: 1 / 6 points (1 of 3 checks passed)" in text and "FAIL  worth-3" in text, text


def test_cells_that_did_not_run_or_timed_out_fail_as_such():
    notebook = executed([(code("a", check=True), []), (code("b", check=True), []), (code("c", check=True), [])])
    report = grade.score(notebook, ran={0, 1}, timed_out={1: 30}, not_run_reason="the kernel died in cell 1")
    assert [(c.status, c.passed) for c in report.checks] == [("passed", True), ("timed out", False), ("not run", False)]
    assert "30 s" in report.checks[1].message and report.checks[2].message == "the kernel died in cell 1"


def test_nbgrader_grade_cells_count_without_the_tag():
    cell = nbformat.v4.new_code_cell("pass", metadata={"nbgrader": {"grade": True, "solution": False,
                                                                    "grade_id": "t1", "points": 4}})
    answer = nbformat.v4.new_code_cell("pass", metadata={"nbgrader": {"grade": True, "solution": True,
                                                                      "grade_id": "manual", "points": 2}})
    report = grade.score(executed([(cell, []), (answer, [])]))
    assert [(c.grade_id, c.points) for c in report.checks] == [("t1", 4)]  # a manually graded answer is not a check


def test_release_restores_edited_checks_and_scores_deleted_ones_zero():
    released = nbformat.v4.new_notebook(cells=[
        code("x = 0"), code("assert x == 1, 'x'", check=True, points=2), code("assert x == 3", check=True, points=5)])
    released.cells[2].metadata["nbgrader"]["grade_id"] = "second"
    submitted = nbformat.v4.new_notebook(cells=[
        code("x = 0"), code("assert True  # edited by the learner", check=True, points=2),
        code("print('my own check')", check=True)])
    missing = grade.apply_release(submitted, released)
    assert submitted.cells[1].source == "assert x == 1, 'x'"  # the released check is back
    assert not grade.is_check(submitted.cells[2])  # a check the release does not have counts for nothing
    assert [(m.grade_id, m.points, m.status) for m in missing] == [("second", 5, "missing")]


# ---------------------------------------------------------------------------------
# the command on small notebooks, each in a fresh kernel


@pytest.mark.slow
def test_command_runs_every_check_and_reports_json(tmp_path: Path):
    path = write(tmp_path, "mixed.ipynb", [
        code("x = 1"),
        code("assert x == 1, 'x'\nprint('x is one')", check=True),
        code("assert x == 2, f'x is {x}, expected 2'", check=True, points=3),
        code("1 / 0"),
        code("print('after a failure')", check=True),
    ])
    returncode, report = run_grader(path)
    assert returncode == 1 and (report["score"], report["max_score"]) == (2, 5), report
    assert [c["status"] for c in report["checks"]] == ["passed", "failed", "passed"], report
    assert report["checks"][1]["message"] == "AssertionError: x is 1, expected 2"
    assert report["errors"] == [{"cell": 3, "status": "failed", "message": "ZeroDivisionError: division by zero"}]
    assert report["outcome"] == "completed"

    passing = write(tmp_path, "passing.ipynb", [code("x = 1"), code("assert x == 1", check=True)])
    done = subprocess.run([sys.executable, "-m", "shardlib", "grade", str(passing)], capture_output=True, text=True,
                          timeout=GRADE_LIMIT_S, cwd=REPO_ROOT)
    assert done.returncode == 0 and "Score: 1 / 1 points (1 of 1 checks passed)" in done.stdout, done.stdout


@pytest.mark.slow
def test_a_hanging_cell_is_interrupted_and_grading_goes_on(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    path = write(tmp_path, "hang.ipynb", [
        code("import subprocess, time\n"  # a child in the kernel's process group, as forked ranks are
             f"child = subprocess.Popen(['sleep', '600'])\nopen({str(pid_file)!r}, 'w').write(str(child.pid))"),
        code("time.sleep(600)", check=True),
        code("print('the kernel is still usable')", check=True),
    ])
    returncode, report = run_grader(path, "--cell-timeout", "5")
    assert returncode == 1 and statuses(report) == {"cell-1": "timed out", "cell-2": "passed"}, report
    assert report["outcome"] == "completed" and report["score"] == 1
    child = int(pid_file.read_text())
    alive = psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE
    assert not alive, f"the kernel's child {child} outlived the grading: its process group was not killed"


@pytest.mark.slow
def test_a_notebook_past_the_whole_run_limit_is_stopped(tmp_path: Path):
    path = write(tmp_path, "stubborn.ipynb", [
        code("import time"),
        code("while True:\n    try:\n        time.sleep(600)\n    except KeyboardInterrupt:\n        pass", check=True),
        code("print('never')", check=True),
        code("print('never either')", check=True),
    ])
    returncode, report = run_grader(path, "--cell-timeout", "4", "--timeout", "10")
    assert returncode == 1 and report["outcome"] == "timed out" and report["score"] == 0, report
    found = statuses(report)
    assert found["cell-1"] == "timed out" and found["cell-3"] == "not run", report
    assert "10 s" in report["detail"]


@pytest.mark.slow
def test_a_crashed_kernel_is_reported(tmp_path: Path):
    path = write(tmp_path, "crash.ipynb", [
        code("import os"), code("print('ok')", check=True), code("os._exit(3)"), code("print('never')", check=True)])
    returncode, report = run_grader(path)
    assert returncode == 1 and report["outcome"] == "kernel died", report
    assert statuses(report) == {"cell-1": "passed", "cell-3": "not run"} and "cell 2" in report["detail"]


def test_unreadable_notebooks_are_refused(tmp_path: Path, capsys):
    (tmp_path / "broken.ipynb").write_text("{not json", encoding="utf-8")
    assert grade.main([str(tmp_path / "broken.ipynb"), "--json"]) == 2
    assert "cannot grade it" in json.loads(capsys.readouterr().out)["error"]
    with pytest.raises(SystemExit) as stop:
        grade.main([str(tmp_path / "missing.ipynb")])
    assert stop.value.code == 2 and "no such notebook" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        grade.main([str(tmp_path / "broken.ipynb"), "--timeout", "0"])


# ---------------------------------------------------------------------------------
# real labs: the unsolved lab scores 0, the solution full marks, one planted mistake exactly its checks


def graded_solution(name: str) -> nbformat.NotebookNode:
    """The solution with the lab's grade ids and points (nbgrader's source version)."""
    path = REPO_ROOT / "solutions" / name
    source = labgen.nbgrader_source(json.loads(path.read_text(encoding="utf-8")), f"solutions/{name}")
    return nbformat.reads(labgen.dumps(source), as_version=4)  # sources as strings, as Jupyter reads them


def plant(notebook, old: str, new: str):
    cells = [cell for cell in notebook.cells if old in cell.source]
    assert len(cells) == 1 and cells[0].source.count(old) == 1, f"{old!r} is not in exactly one place"
    cells[0].source = cells[0].source.replace(old, new)
    return notebook


PLANTED = {  # lab: (the mistake: text replaced in the solution, the checks it breaks)
    "03_zero1_step.ipynb": (  # the right numbers through an all-reduce: only the ledger check sees it
        ("    reduce_scatter_tensor(grad_shard, flat_grads, group=group)",
         "    dist.all_reduce(flat_grads, group=group)  # every rank receives everything\n"
         "    grad_shard.copy_(flat_grads[dist.get_rank(group) * shard.numel():][:shard.numel()])"),
        {"check-2"}),
    "07_quantizer.ipynb": (  # the two 4-bit values of a byte swapped: the int4 check, nothing else
        ("packed = u[:, 0::2] | (u[:, 1::2] << 4)", "packed = u[:, 1::2] | (u[:, 0::2] << 4)"),
        {"check-2"}),
    "11_ring_attention_step.ipynb": (  # the second block not rescaled: the merge, and ring attention using it
        ("out_b * torch.exp(lse_b - lse)[..., None]", "out_b"),
        {"check-1", "check-3"}),
    "p1_zero3_from_scratch.ipynb": (  # the summed gradient not divided by N: training on N >= 2 ranks
        ("        grad /= self.n  # the mean over ranks", "        # the mean over ranks"),
        {"check-2", "check-5"}),
    "p2_tp_sp_on_a_2d_mesh.ipynb": (  # the row bias added on every rank before the sum: t times over
        ("partial = F.linear(y, self.o_proj.weight)", "partial = self.o_proj(y)"),
        {"check-2", "check-3"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_mistake_costs_exactly_its_checks(name: str, tmp_path: Path):
    (old, new), broken = PLANTED[name]
    notebook = plant(graded_solution(name), old, new)
    points = {c.metadata["nbgrader"]["grade_id"]: c.metadata["nbgrader"]["points"]
              for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade")}
    assert broken <= set(points), f"{name}: checks {sorted(broken - set(points))} do not exist"
    path = tmp_path / name
    nbformat.write(notebook, path)
    returncode, report = run_grader(path)
    failed = {check["grade_id"] for check in report["checks"] if not check["passed"]}
    assert failed == broken, f"{name}: expected exactly {sorted(broken)} to fail, got {sorted(failed)}: {report}"
    assert report["max_score"] == sum(points.values())
    assert report["score"] == sum(points.values()) - sum(points[c] for c in broken), report
    assert returncode == 1


@pytest.mark.slow
def test_the_command_on_a_lab_and_its_solution(tmp_path: Path):
    """End to end on the lab as a learner gets it (0 points) and as solved (full marks)."""
    returncode, report = run_grader(REPO_ROOT / "labs" / "07_quantizer.ipynb")
    assert returncode == 1 and report["score"] == 0 and report["max_score"] == 3, report
    assert all(check["status"] == "failed" for check in report["checks"]), report
    solved = tmp_path / "07_quantizer.ipynb"
    nbformat.write(graded_solution("07_quantizer.ipynb"), solved)
    returncode, report = run_grader(solved, "--release", str(REPO_ROOT / "labs" / "07_quantizer.ipynb"))
    assert returncode == 0 and report["score"] == report["max_score"] == 3, report
