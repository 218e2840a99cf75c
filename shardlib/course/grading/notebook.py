"""Reading a notebook to grade, the role of each cell, and the notebook as graded against a release.

A cell's role comes from nbgrader's cell metadata (schema 3), which every lab cell carries:

    check     a code cell tagged `check`, or an nbgrader autograded test (grade, not solution)
    answer    an nbgrader solution cell: the learner's code
    locked    an nbgrader read-only cell (locked, not solution): given code, the set-up, the parameters
    learner   anything else (cells the learner added)

Against a release (`--release LAB`), the notebook graded is the release, cell for cell, with only the
answers taken from the submission: every check and every locked cell is the released one, in the
released order, whatever the learner edited, moved or deleted; a missing answer is the release's
stub. Cells the learner added run where they were (after the released cell they followed). A
submission's cell is matched to the release by its nbgrader grade id, else by its cell id (a lab
keeps its solution's cell ids, so the answer key matches its release).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import nbformat
from nbformat.v4.rwbase import rejoin_lines

from shardlib.course.labgen import CHECK_TAG, cell_tags

NOTEBOOK_LIMIT_BYTES = 64 * 2 ** 20  # a lab is a few hundred kilobytes; anything this big is not one


class GradeInputError(ValueError):
    """A notebook, path or option the grader cannot use; its text is the one line the command prints."""


def read_notebook(path: str | Path) -> nbformat.NotebookNode:
    """The notebook at `path`, validated; GradeInputError (one line) for anything that is not one."""
    path = Path(path)
    if path.is_dir():
        raise GradeInputError(f"{path}: a folder, not a notebook (a whole class: --class SUBMISSIONS_DIR)")
    if not path.is_file():
        raise GradeInputError(f"{path}: no such notebook")
    try:
        if path.stat().st_size > NOTEBOOK_LIMIT_BYTES:
            raise GradeInputError(f"{path}: {path.stat().st_size / 2 ** 20:.0f} MiB is too large for a notebook")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise GradeInputError(f"{path}: cannot read it ({error})") from None
    except json.JSONDecodeError as error:
        raise GradeInputError(f"{path}: not a notebook: not valid JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        what = {dict: "an object without a list of cells", list: "a list", type(None): "null", str: "a string",
                bool: "true or false"}.get(type(data), "a number")
        raise GradeInputError(f"{path}: not a notebook: its JSON is {what}, not an object with a list of cells")
    try:
        with warnings.catch_warnings():  # nbformat warns (and logs) about what it is about to reject
            warnings.simplefilter("ignore")
            notebook = nbformat.from_dict(data)
            if notebook.get("nbformat") != 4:
                notebook = nbformat.convert(notebook, 4)
            notebook = rejoin_lines(nbformat.from_dict(nbformat.validator.normalize(notebook)[1]))
            nbformat.validate(notebook)
    except nbformat.ValidationError as error:
        first = str(error).strip().splitlines()[0]
        raise GradeInputError(f"{path}: not a valid notebook: {first}") from None
    except Exception as error:  # nbformat's conversion fails in many ways on odd JSON
        raise GradeInputError(f"{path}: not a valid notebook: {type(error).__name__}: {error}") from None
    return notebook


def nbgrader(cell) -> dict:
    grading = cell.get("metadata", {}).get("nbgrader", {})
    return grading if isinstance(grading, dict) else {}


def is_check(cell) -> bool:
    if cell.get("cell_type") != "code":
        return False
    grading = nbgrader(cell)
    return CHECK_TAG in cell_tags(cell) or bool(grading.get("grade") and not grading.get("solution"))


def is_answer(cell) -> bool:
    return bool(nbgrader(cell).get("solution"))


def is_locked(cell) -> bool:
    return is_check(cell) or bool(nbgrader(cell).get("locked") and not is_answer(cell))


def role(cell) -> str:
    return "check" if is_check(cell) else "answer" if is_answer(cell) else "locked" if is_locked(cell) else "learner"


def code_cells(notebook) -> list[tuple[int, str, str]]:
    """(index, role, source) of each code cell with something in it: what the grader runs, in order."""
    return [(i, role(cell), cell.source) for i, cell in enumerate(notebook.cells)
            if cell.cell_type == "code" and cell.source.strip()]


def grade_id(cell, index: int | None = None) -> str | None:
    found = nbgrader(cell).get("grade_id")
    if isinstance(found, str) and found:
        return found
    return None if index is None else f"cell-{index}"


def points(cell) -> float:
    value = nbgrader(cell).get("points", 1)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 1


def fresh(notebook) -> nbformat.NotebookNode:
    """A copy without outputs: nothing the learner saved counts."""
    notebook = copy.deepcopy(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return notebook


def as_learner_cell(cell) -> nbformat.NotebookNode:
    """A cell the release does not have: it runs, as the learner's code, and counts for nothing."""
    cell = copy.deepcopy(cell)
    cell.metadata.pop("nbgrader", None)
    if "tags" in cell.metadata:
        cell.metadata["tags"] = [tag for tag in cell_tags(cell) if tag != CHECK_TAG]
    return cell


def against_release(submission, release) -> nbformat.NotebookNode:
    """The notebook to grade: the release with the submission's answers (see the module docstring)."""
    released = release.cells
    if not any(is_check(cell) for cell in released):
        raise GradeInputError("the release has no check cells (tagged `check`, or nbgrader grade cells)")
    by_grade_id = {grade_id(cell): i for i, cell in enumerate(released) if grade_id(cell)}
    by_cell_id = {cell.get("id"): i for i, cell in enumerate(released) if cell.get("id")}
    matched, added, last = {}, {}, -1
    for cell in submission.cells:
        key = grade_id(cell)
        index = by_grade_id.get(key) if key else None
        if index is None and (key is None or key not in by_grade_id):
            index = by_cell_id.get(cell.get("id"))
        if index is not None and index not in matched:
            matched[index], last = cell, index
        else:
            added.setdefault(last, []).append(as_learner_cell(cell))
    cells = list(added.get(-1, []))
    for index, cell in enumerate(released):
        graded = copy.deepcopy(cell)
        mine = matched.get(index)
        if is_answer(cell) and mine is not None and mine.get("cell_type") == cell.cell_type:
            graded.source = mine.source
        cells.append(graded)
        cells.extend(added.get(index, []))
    return fresh(nbformat.v4.new_notebook(cells=cells, metadata=copy.deepcopy(release.metadata)))
