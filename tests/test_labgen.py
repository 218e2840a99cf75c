"""The lab generator on small notebooks written here (no kernel needed)."""

from __future__ import annotations

import json
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
    assert lab["metadata"]["language_info"] == {"name": "python"}
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
