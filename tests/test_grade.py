"""`python -m shardlib grade`: release merging, bad input, scoring, and real labs with planted mistakes.

The scores expected here come from the labs' own metadata (points per check) and from reading what
each planted mistake breaks, never from running the grader first. The sandbox, tampering, dying,
forking and hanging notebooks, and a class, are in tests/test_grade_sandbox.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from grade_helpers import REPO_ROOT, code, double_solution, run_grader, submit, write_lab
from shardlib.course import labgen
from shardlib.course.grading import cli, report, review, sandbox
from shardlib.course.grading.notebook import against_release, code_cells, grade_id, is_answer, read_notebook, role
from shardlib.course.grading.tamper import Verifier

RANK_ERROR = ("rank 1 failed; its traceback follows.\n\nTraceback (most recent call last):\n"
              "  File \"launch.py\", line 224, in _rank_main\n    result = fn(*args)\n"
              "AssertionError: N=2: rank 1 sent 3 elements, expected 4\n\n(ranks [0] failed too, most likely because "
              "rank 1 stopped.)")


def test_messages_name_the_cause_and_are_capped():
    assert report.error_message("RankError", RANK_ERROR) == (
        "RankError: rank 1 failed; its traceback follows. ... AssertionError: N=2: rank 1 sent 3 elements, expected 4")
    huge = report.error_message("AssertionError", "x" * 50_000_000)
    assert len(huge) == report.MESSAGE_LIMIT and huge.endswith("..."), len(huge)


def test_the_release_restores_checks_and_locked_cells_and_keeps_only_the_answers(tmp_path: Path):
    lab = read_notebook(write_lab(tmp_path))
    mine = read_notebook(submit(write_lab(tmp_path), tmp_path / "learner", answer="def double(x):\n    return 2 * x",
                                added=["print('my own cell')"]))
    roles = [role(cell) for cell in mine.cells]
    setup, answer, first_check = roles.index("locked", 1), roles.index("answer"), roles.index("check")
    mine.cells[setup].source = "import torch\nimport shardlib\nTOL = 1e9  # edited\ndef helper(x):\n    return x"
    mine.cells[first_check].source = "pass  # edited by the learner"
    mine.cells[first_check].metadata["nbgrader"]["points"] = 100
    del mine.cells[first_check + 1]  # the second check, deleted
    mine.cells.insert(0, mine.cells.pop(answer))  # the answer moved to the top
    graded = against_release(mine, lab)
    kept = [(role(c), c.source) for c in graded.cells if c.cell_type == "code"]
    released = [(role(c), c.source) for c in lab.cells if c.cell_type == "code"]
    # the learner's own cell stays after the released cell it followed; the rest is in the released order
    assert [r for r, _ in kept] == ["locked", "learner", "answer", "check", "check"], kept
    assert kept[0] == released[0] and kept[3:] == released[2:], "locked cells and checks are the released ones"
    assert kept[2] == ("answer", "def double(x):\n    return 2 * x") and kept[1][1] == "print('my own cell')"
    assert all(cell.metadata["nbgrader"].get("points", 1) == 1 for cell in graded.cells if role(cell) == "check")
    forged = nbformat.v4.new_notebook(cells=[code("print('a check of my own')", ["check"])])
    assert [role(c) for c in against_release(forged, lab).cells if c.cell_type == "code"][-1] == "check"
    assert role(against_release(forged, lab).cells[0]) == "learner", "a learner's own check counts for nothing"


def not_a_notebook(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bad.ipynb"
    path.write_text(text, encoding="utf-8")
    return path


BAD_NOTEBOOKS = {
    "empty list": "[]", "null": "null", "no cells": "{}", "not JSON": "{not json",
    "source a number": json.dumps({"cells": [{"cell_type": "code", "source": 5, "metadata": {}, "outputs": [],
                                              "execution_count": None}], "metadata": {}, "nbformat": 4,
                                   "nbformat_minor": 5}),
    "cells not a list": json.dumps({"cells": 3, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}),
}
BAD_OPTIONS = {
    "timeout nan": ["--timeout", "nan"], "timeout inf": ["--timeout", "inf"], "timeout zero": ["--timeout", "0"],
    "cell timeout negative": ["--cell-timeout", "-1"], "memory nan": ["--memory", "nan"],
    "processes few": ["--processes", "2"], "unknown option": ["--frobnicate"], "jobs zero": ["--jobs", "0"],
    "isolation unknown": ["--isolation", "docker"], "out without class": ["--out", "results"],
}


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_every_bad_input_exits_2_with_one_line(tmp_path: Path, capsys, monkeypatch, as_json: bool):
    lab = write_lab(tmp_path)
    cases = {name: [str(not_a_notebook(tmp_path / name, text))] for name, text in BAD_NOTEBOOKS.items()}
    cases.update({name: [str(lab), *options] for name, options in BAD_OPTIONS.items()})
    no_checks = tmp_path / "no checks.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[code("x = 1")]), no_checks)
    cases.update({"missing notebook": [str(tmp_path / "missing.ipynb")], "a folder": [str(tmp_path)],
                  "bad release": [str(lab), "--release", str(not_a_notebook(tmp_path / "r", "[]"))],
                  "release without checks": [str(lab), "--release", str(no_checks)],
                  "nothing to grade": [], "class without release": ["--class", str(tmp_path), "--out", "x"],
                  "results inside the submissions": ["--class", str(tmp_path), "--release", str(tmp_path),
                                                     "--out", str(tmp_path / "results")]})
    cases["bubblewrap insisted on where it is missing"] = [str(lab), "--isolation", "bwrap"]
    monkeypatch.setattr(sandbox, "bubblewrap", lambda: None)
    for name, argv in cases.items():
        assert cli.main(argv + (["--json"] if as_json else [])) == 2, name
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1, f"{name}: {lines}"
        message = json.loads(lines[0])["error"] if as_json else lines[0]
        assert message and "Traceback" not in message and (as_json or message.startswith("error: ")), (name, message)


@pytest.mark.slow
def test_a_notebook_is_scored_from_the_kernels_replies(tmp_path: Path):
    path = tmp_path / "mixed.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[
        code("x = 1"), code("assert x == 1, 'x'\nprint('x is one')", ["check"]),
        code("print('a line printed before the error')\nassert x == 2, f'x is {x}, expected 2'", ["check"]),
        code("1 / 0"), code("print('y' * 50_000_000)\nprint('after a failure')", ["check"])]), path)
    returncode, found, _ = run_grader(path)
    assert returncode == 1 and (found["score"], found["max_score"]) == (2, 3), found
    assert [c["status"] for c in found["checks"]] == ["passed", "failed", "passed"], found
    assert found["checks"][1]["message"] == "AssertionError: x is 1, expected 2"
    assert found["checks"][2]["message"] == "after a failure"
    assert found["errors"] == [{"cell": 3, "status": "failed", "message": "ZeroDivisionError: division by zero"}]
    assert len(json.dumps(found)) < 20_000, "a check printing 50 MB must not make a 50 MB report"


def test_only_the_release_itself_runs_without_a_verification_after_each_cell(tmp_path: Path):
    """Untouched answers and nothing added: no code of the learner's runs, so every cell may wait for one
    verification after the last. One changed answer, one added cell, or no release: not so."""
    lab_path = write_lab(tmp_path)
    lab = read_notebook(lab_path)
    stubs = [c.source for c in lab.cells if c.cell_type == "code" and is_answer(c)]
    release = Verifier(code_cells(lab), stubs)
    assert release.untouched and release.can_wait(1, "answer", 2, "check")
    answered = against_release(read_notebook(submit(lab_path, tmp_path / "a")), lab)
    added = against_release(read_notebook(submit(lab_path, tmp_path / "b", answer=stubs[0], added=["x = 1"])), lab)
    for notebook, release_stubs in ((answered, stubs), (added, stubs), (lab, None)):
        found = Verifier(code_cells(notebook), release_stubs)
        assert not found.untouched and not found.can_wait(1, "answer", 2, "check")


@pytest.mark.slow  # starts kernels
def test_released_cells_verified_once_together_keep_their_names_and_data_watched(tmp_path: Path):
    """Two released cells in a row are verified once, after the second (tamper.Verifier.can_wait): the
    second may change the data the first bound, and the learner's changes after them to the first's
    names and data are still seen."""
    checks = ["assert double(3) == helper(3), 'double(3) is wrong'", "assert all([double(2) == EXPECTED[2]])"]
    solution = double_solution(checks, "EXPECTED = {2: 4}\n\n\ndef helper(x):\n    return x * 2")
    solution.cells.insert(1, code("EXPECTED[3] = 6"))
    lab = write_lab(tmp_path / "release", solution)
    cells = code_cells(read_notebook(lab))
    verifier = Verifier(cells)
    assert [verifier.can_wait(i, r, *following[:2]) for (i, r, _), following in zip(cells, cells[1:])] == [
        True, False, False, False]
    honest = run_grader(submit(lab, tmp_path / "alice"), "--release", lab)[1]
    assert (honest["outcome"], honest["score"], honest["max_score"]) == ("completed", 2, 2), honest
    wrong = "def double(x):\n    return x\n\n\ndef helper(x):\n    return x\n\n\nEXPECTED[2] = 2"
    cheat = run_grader(submit(lab, tmp_path / "bob", answer=wrong), "--release", lab)[1]
    assert cheat["outcome"] == "tampered" and cheat["score"] == 0, cheat
    for name in ("helper", "EXPECTED"):
        assert any(name in line for line in cheat["tampering"]), (name, cheat["tampering"])


# ---------------------------------------------------------------------------------
# real labs: one planted mistake costs exactly its checks


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
    returncode, found, _ = run_grader(path, "--release", REPO_ROOT / "labs" / name)
    failed = {check["grade_id"] for check in found["checks"] if not check["passed"]}
    assert failed == broken, f"{name}: expected exactly {sorted(broken)} to fail, got {sorted(failed)}: {found}"
    assert found["max_score"] == sum(points.values()) and found["outcome"] == "completed", found
    assert found["score"] == sum(points.values()) - sum(points[c] for c in broken), found
    assert returncode == 1


def test_only_the_notebooks_own_comparisons_count_as_lying():
    """The verification's list of classes whose own code answers comparisons: a library's dataclass (its __eq__
    compiled by dataclasses from text, file name '<string>') is the library's; the notebook's own lying
    __eq__, made the same way or written out, is not."""
    import dataclasses
    import types

    import torch

    from shardlib.comm.ledger import CommRecord
    from shardlib.course.grading import probe

    roots = [str(Path(dataclasses.__file__).parent), str(REPO_ROOT / "shardlib")]
    before = probe.lying_types(torch, roots, set())
    assert "CommRecord" not in before and CommRecord.__eq__.__code__.co_filename == "<string>"

    @dataclasses.dataclass
    class Written(dict):
        def __eq__(self, other):
            return True

    import shardlib.comm.ledger as ledger

    @dataclasses.dataclass(eq=False)
    class Forged(float):  # a lie compiled as dataclasses compiles, in a library module's globals
        a: int = 0

    code = compile("def __eq__(self, other):\n    return True", "<string>", "exec").co_consts[0]
    Forged.__eq__ = types.FunctionType(code, vars(ledger))
    Forged.__dataclass_fields__ = {}
    found = probe.lying_types(torch, roots, set())
    assert "Written.__eq__" in found and "Forged.__eq__" in found, found


TRANSIENT = {  # a wrong answer that changes what the checks read while they run and undoes it before the
    # verification after the cell (a thread, a callback after the cell): the kernel's verification sees nothing
    "a thread": "import sys, threading, time\ndef double(x):\n    global TOL\n    old = TOL\n    TOL = 1e9\n"
                "    EXPECTED[2] = x\n    def undo():\n        time.sleep(0.01)\n        global TOL\n        TOL = old\n"
                "        EXPECTED[2] = 4\n    threading.Thread(target=undo).start()\n    return x",
    "a callback after the cell": "def double(x):\n    global TOL\n    old, events = TOL, get_ipython().events\n"
                                 "    TOL = 1e9\n    EXPECTED.update({2: x})\n    def undo(result):\n"
                                 "        global TOL\n        TOL = old\n        EXPECTED.update({2: 4})\n"
                                 "        events.unregister('post_run_cell', undo)\n"
                                 "    events.register('post_run_cell', undo)\n    return x",
}


def reading(submission: Path, lab: Path) -> list[str]:
    """The grader's reading of `submission` graded against `lab` (as grade.grade makes it)."""
    release = read_notebook(lab)
    graded = against_release(read_notebook(submission), release)
    stubs = [c.source for c in release.cells if c.cell_type == "code" and is_answer(c)]
    return review.review([(i, role(c), c.source, grade_id(c, i)) for i, c in enumerate(graded.cells)
                          if c.cell_type == "code" and c.source.strip()], stubs)


@pytest.mark.parametrize("how", sorted(TRANSIENT))
def test_the_reading_lists_changes_to_the_released_names_made_from_an_answer(how: str, tmp_path: Path):
    lab = write_lab(tmp_path)
    found = reading(submit(lab, tmp_path / "learner", answer=TRANSIENT[how]), lab)
    assert any("declares global TOL" in line for line in found), found
    assert any("the released cells' EXPECTED, in place" in line for line in found), found
    assert not [line for line in reading(submit(lab, tmp_path / "honest"), lab) if "released cells" in line]


@pytest.mark.parametrize("name", [path.name for path in sorted((REPO_ROOT / "solutions").glob("*.ipynb"))])
def test_the_answer_keys_change_no_released_name(name: str):
    found = reading(REPO_ROOT / "solutions" / name, REPO_ROOT / "labs" / name)
    assert not [line for line in found if "released cells" in line], found
