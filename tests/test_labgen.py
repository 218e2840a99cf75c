"""The lab generator on small notebooks written here (no kernel needed)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import nbformat
import pytest

from shardlib.course import labgen
from shardlib.__main__ import main as cli


def solution_notebook() -> nbformat.NotebookNode:
    code = nbformat.v4.new_code_cell
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Lab 99\nWrite `scale`."),
        code("import math\n\n"
             "def scale(xs, factor):\n"
             "    out = []\n"
             "    for x in xs:\n"
             "        ### BEGIN SOLUTION\n"
             "        y = x * factor\n"
             "        out.append(y)\n"
             "        ### END SOLUTION\n"
             "    return out"),
        code("print('the answer is 42')", metadata={"tags": ["solution-only"]}),
        code("assert scale([1, 2], 3) == [3, 6]", metadata={"tags": ["check"]}),
    ])
    notebook.cells[1].outputs = [nbformat.v4.new_output("stream", text="hello\n")]
    notebook.cells[1].execution_count = 7
    notebook.cells[1].metadata["execution"] = {"iopub.execute_input": "2024-01-01T00:00:00"}
    notebook.metadata["language_info"] = {"name": "python", "version": "3.11.7"}
    return notebook


def write(folder: Path, name: str, notebook) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(nbformat.writes(notebook), encoding="utf-8")
    return path


def test_region_becomes_stub_at_its_indentation_and_the_rest_is_kept():
    lab = labgen.make_lab(solution_notebook(), "solutions/99_scale.ipynb")
    code = "".join(lab["cells"][2]["source"])
    assert code == ("import math\n\n"
                    "def scale(xs, factor):\n"
                    "    out = []\n"
                    "    for x in xs:\n"
                    f"        {labgen.STUB}\n"
                    "    return out")
    assert "BEGIN SOLUTION" not in json.dumps(lab) and "x * factor" not in json.dumps(lab)


def test_solution_only_cells_dropped_outputs_stripped_note_on_top():
    lab = labgen.make_lab(solution_notebook(), "solutions/99_scale.ipynb")
    sources = ["".join(cell["source"]) for cell in lab["cells"]]
    assert "solutions/99_scale.ipynb" in sources[0] and lab["cells"][0]["cell_type"] == "markdown"
    assert sources[1:] == ["# Lab 99\nWrite `scale`.", sources[2], "assert scale([1, 2], 3) == [3, 6]"]
    for cell in lab["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
            assert "execution" not in cell["metadata"]
    assert lab["cells"][3]["metadata"]["tags"] == ["check"]
    assert lab["metadata"]["language_info"] == {"name": "python", "version": "3.11.7"}  # the solution's
    nbformat.validate(nbformat.from_dict(lab))


def test_generation_is_deterministic_and_check_sees_staleness(tmp_path: Path):
    solution = write(tmp_path / "solutions", "99_scale.ipynb", solution_notebook())
    assert labgen.generate_text(solution, tmp_path) == labgen.generate_text(solution, tmp_path)
    assert labgen.main(check=True, root=tmp_path) == 1  # no lab yet
    assert labgen.main(root=tmp_path) == 0
    written = (tmp_path / "labs" / "99_scale.ipynb").read_bytes()
    assert labgen.main(check=True, root=tmp_path) == 0
    assert labgen.main(root=tmp_path) == 0
    assert (tmp_path / "labs" / "99_scale.ipynb").read_bytes() == written

    changed = solution_notebook()
    changed.cells[3].source = "assert scale([1, 2], 4) == [4, 8]"
    write(tmp_path / "solutions", "99_scale.ipynb", changed)
    assert labgen.stale_labs(tmp_path / "solutions", tmp_path / "labs", tmp_path) == [tmp_path / "labs" / "99_scale.ipynb"]
    assert labgen.main(check=True, root=tmp_path) == 1


def test_output_is_what_jupyter_writes(tmp_path: Path):
    """Opening and saving a lab in Jupyter must not make it stale by reformatting it."""
    solution = write(tmp_path / "solutions", "99_scale.ipynb", solution_notebook())
    text = labgen.generate_text(solution, tmp_path)
    saved = tmp_path / "saved.ipynb"
    nbformat.write(nbformat.reads(text, as_version=4), saved)  # as Jupyter saves a notebook
    assert saved.read_text(encoding="utf-8") == text


def test_labs_holding_outputs_are_not_overwritten(tmp_path: Path):
    solution = write(tmp_path / "solutions", "99_scale.ipynb", solution_notebook())
    lab = nbformat.reads(labgen.generate_text(solution, tmp_path), as_version=4)
    lab.cells[2].source = "def scale(xs, factor):\n    return [x * factor for x in xs]"
    lab.cells[2].outputs = [nbformat.v4.new_output("stream", text="done\n")]
    path = write(tmp_path / "labs", "99_scale.ipynb", lab)
    mine = path.read_text(encoding="utf-8")
    assert labgen.main(root=tmp_path) == 1
    assert path.read_text(encoding="utf-8") == mine
    assert labgen.main(root=tmp_path, force=True) == 0
    assert path.read_text(encoding="utf-8") == labgen.generate_text(solution, tmp_path)


@pytest.mark.parametrize("source, message", [
    ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("x = 1\n### END SOLUTION\n", "without"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside another"),
    ("x = 1\n", "no '### BEGIN SOLUTION' region"),
])
def test_bad_markers_are_named(source: str, message: str):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    with pytest.raises(labgen.LabError, match=message):
        labgen.make_lab(notebook, "solutions/99_bad.ipynb")


def test_command_line(tmp_path: Path, monkeypatch, capsys):
    write(tmp_path / "solutions", "99_scale.ipynb", solution_notebook())
    monkeypatch.setattr(labgen, "REPO_ROOT", tmp_path)
    assert cli(["labs", "--check"]) == 1
    assert "stale: labs/99_scale.ipynb" in capsys.readouterr().out
    assert cli(["labs"]) == 0
    assert cli(["labs", "--check"]) == 0
    assert (tmp_path / "labs" / "99_scale.ipynb").exists()


# ---------------------------------------------------------------------------------
# nbgrader metadata, layered hints, project labs

NBGRADER_KEYS = {"grade", "grade_id", "locked", "schema_version", "solution", "task", "points"}


def graded_notebook() -> nbformat.NotebookNode:
    notebook = solution_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell("assert scale([2], 2) == [4]",
                                                    metadata={"tags": ["check"], "nbgrader": {"points": 3}}))
    notebook.cells.insert(1, nbformat.v4.new_markdown_cell(
        "Stuck? Open one hint at a time.\n\n#### a nudge\nMultiply.\n\n#### the outline\n```\ny = x * factor\n```",
        metadata={"tags": ["hints"]}))
    return notebook


def test_every_lab_cell_carries_nbgrader_metadata():
    """nbgrader's cell metadata, schema 3 (https://nbgrader.readthedocs.io/en/stable/contributor_guide/metadata.html)."""
    lab = labgen.make_lab(graded_notebook(), "solutions/99_scale.ipynb")
    meta = [cell["metadata"]["nbgrader"] for cell in lab["cells"]]
    for cell, m in zip(lab["cells"], meta):
        assert set(m) <= NBGRADER_KEYS and m["schema_version"] == 3, m
        assert all(isinstance(m[key], bool) for key in ("grade", "locked", "solution", "task")), m
        assert re.fullmatch(r"[a-zA-Z0-9_\-]+", m["grade_id"]), m
        assert ("points" in m) == m["grade"], m  # points exactly on graded cells
        if cell["cell_type"] == "markdown":
            assert not m["grade"] and not m["solution"], m  # nbgrader: a graded markdown cell must be an answer
    assert len({m["grade_id"] for m in meta}) == len(meta), "grade ids must be unique"
    kinds = [(m["grade_id"], m["solution"], m["grade"], m["locked"], m.get("points")) for m in meta]
    assert kinds == [("generated-lab-note", False, False, True, None), ("cell-0", False, False, True, None),
                     ("cell-1", False, False, True, None), ("answer-1", True, False, False, None),
                     ("check-1", False, True, True, 1), ("check-2", False, True, True, 3)], kinds
    checks = [cell for cell in lab["cells"] if cell["metadata"]["nbgrader"]["grade"]]
    assert all(c["metadata"]["editable"] is False and c["metadata"]["deletable"] is False for c in checks)
    assert lab["cells"][3]["metadata"]["deletable"] is False and "editable" not in lab["cells"][3]["metadata"]
    nbformat.validate(nbformat.from_dict(lab))


def test_hints_are_folded_one_by_one():
    lab = labgen.make_lab(graded_notebook(), "solutions/99_scale.ipynb")
    text = "".join(lab["cells"][2]["source"])
    assert text == ("Stuck? Open one hint at a time.\n\n"
                    "<details><summary>Hint 1 of 2: a nudge</summary>\n\nMultiply.\n\n</details>\n\n"
                    "<details><summary>Hint 2 of 2: the outline</summary>\n\n```\ny = x * factor\n```\n\n</details>")
    bare = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("no headings", metadata={"tags": ["hints"]}),
                                           *solution_notebook().cells[1:2]])
    with pytest.raises(labgen.LabError, match="one '#### title' heading per hint"):
        labgen.make_lab(bare, "solutions/99_bad.ipynb")


def test_a_check_holding_the_answer_or_bad_points_is_refused():
    notebook = solution_notebook()
    notebook.cells[3].source = "### BEGIN SOLUTION\nx = 1\n### END SOLUTION\nassert x"
    with pytest.raises(labgen.LabError, match="check cell holds a solution region"):
        labgen.make_lab(notebook, "solutions/99_bad.ipynb")
    notebook = solution_notebook()
    notebook.cells[3].metadata["nbgrader"] = {"points": -1}
    with pytest.raises(labgen.LabError, match="points must be a number >= 0"):
        labgen.make_lab(notebook, "solutions/99_bad.ipynb")


def test_nbgrader_source_keeps_the_answers_with_the_labs_metadata():
    source = labgen.nbgrader_source(graded_notebook(), "solutions/99_scale.ipynb")
    lab = labgen.make_lab(graded_notebook(), "solutions/99_scale.ipynb")
    assert [c["metadata"] for c in source["cells"]] == [c["metadata"] for c in lab["cells"]]  # cell for cell
    assert "### BEGIN SOLUTION" in "".join(source["cells"][3]["source"])
    assert all(c.get("outputs", []) == [] for c in source["cells"])


def test_project_labs_are_found_and_sort_after_the_short_ones(tmp_path: Path):
    for name in ("p1_big.ipynb", "03_small.ipynb", "notes.ipynb", "p_x.ipynb"):
        write(tmp_path, name, solution_notebook())
    assert [p.name for p in labgen.solution_paths(tmp_path)] == ["03_small.ipynb", "p1_big.ipynb"]


def test_nbgrader_sources_command(tmp_path: Path, capsys):
    solution = write(tmp_path / "solutions", "99_scale.ipynb", graded_notebook())
    assert cli(["labs", "--root", str(tmp_path), "--nbgrader", str(tmp_path / "course")]) == 0
    written = tmp_path / "course" / "source" / "99_scale" / "99_scale.ipynb"
    assert f"wrote {written}" in capsys.readouterr().out
    expected = labgen.nbgrader_source(json.loads(solution.read_text(encoding="utf-8")), "solutions/99_scale.ipynb")
    assert json.loads(written.read_text(encoding="utf-8")) == expected


# ---------------------------------------------------------------------------------
# grade ids shared by the answer key and its lab; a release without solutions


def test_check_grade_ids_are_written_into_the_solution_once_and_kept(tmp_path: Path):
    solution = write(tmp_path / "solutions", "99_scale.ipynb", graded_notebook())
    assert labgen.unstamped_solutions(tmp_path / "solutions") == [solution]
    assert labgen.main(root=tmp_path) == 0
    stamped = json.loads(solution.read_text(encoding="utf-8"))
    ids = [c["metadata"]["nbgrader"]["grade_id"] for c in stamped["cells"] if "check" in c["metadata"].get("tags", [])]
    lab = json.loads((tmp_path / "labs" / "99_scale.ipynb").read_text(encoding="utf-8"))
    assert ids == ["check-1", "check-2"] == [c["metadata"]["nbgrader"]["grade_id"] for c in lab["cells"]
                                             if c["metadata"]["nbgrader"]["grade"]]
    assert stamped["cells"][-1]["metadata"]["nbgrader"]["points"] == 3, "the points stay"
    assert labgen.main(check=True, root=tmp_path) == 0
    clash = copy.deepcopy(stamped)
    clash["cells"][-1]["metadata"]["nbgrader"]["grade_id"] = "check-1"
    with pytest.raises(labgen.LabError, match="grade id 'check-1' is used twice"):
        labgen.make_lab(clash, "solutions/99_scale.ipynb")


def test_every_solution_carries_its_labs_check_grade_ids():
    root = Path(__file__).resolve().parent.parent
    assert not labgen.unstamped_solutions(root / "solutions"), "run `python -m shardlib labs` and commit"
    for path in labgen.solution_paths(root / "solutions"):
        solution = json.loads(path.read_text(encoding="utf-8"))
        lab = json.loads((root / "labs" / path.name).read_text(encoding="utf-8"))
        answer_key = [c["metadata"]["nbgrader"]["grade_id"] for c in solution["cells"]
                      if "check" in c["metadata"].get("tags", []) and "solution-only" not in c["metadata"]["tags"]]
        assert answer_key == [c["metadata"]["nbgrader"]["grade_id"] for c in lab["cells"]
                              if c["metadata"]["nbgrader"]["grade"]], path.name


def test_a_released_lab_names_no_solution():
    lab = labgen.make_lab(graded_notebook(), "solutions/99_scale.ipynb")
    released = labgen.released(lab)
    assert "solutions/" in json.dumps(lab) and "solutions" not in json.dumps(released)
    assert "grade labs/99_scale.ipynb" in "".join(released["cells"][0]["source"])
    assert released["cells"][1:] == lab["cells"][1:]
