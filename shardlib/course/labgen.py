"""Generate the lab notebooks in labs/ from their single source in solutions/.

A solution notebook marks the code the learner writes:

    def ring_all_reduce(tensor, group=None):
        world = dist.get_world_size(group)
        ### BEGIN SOLUTION
        ...the answer...
        ### END SOLUTION
        return tensor

The lab keeps everything else and replaces each marked region (markers included) by one line
at the BEGIN marker's indentation:

        raise NotImplementedError("write this part: see the instructions above")

Cells tagged `solution-only` are left out of the lab; outputs and execution counts are
removed; a note cell on top says the file is generated. Cells tagged `check` hold the
automatic checks: they must fail on the lab and pass on the solution (tests/test_labs.py).
`python -m shardlib grade LAB.ipynb` (shardlib/course/grading/) runs them and scores them.

Every lab cell carries nbgrader's cell metadata (schema 3, https://nbgrader.readthedocs.io/en/stable/
contributor_guide/metadata.html), so an instructor can hand the labs to nbgrader as they are:

    cell with a solution region   solution cell, grade_id answer-K
    cell tagged `check`           autograded test, locked, `points` (default 1; a solution's check cell
                                  sets its own with metadata {"nbgrader": {"points": 2}}); grade_id check-K,
                                  written into the solution's own check cell the first time (and kept there),
                                  so the answer key and the lab carry the same ids and
                                  `grade solutions/X --release labs/X` gives the answer key full marks
    every other cell              read-only (locked), grade_id cell-I (I: its index in the solution)

Check cells are also marked not editable and not deletable (JupyterLab honours that), answer cells
not deletable.

Layered hints: a markdown cell tagged `hints` holds one hint per `#### title` heading, from a nudge
to the outline; in the lab each becomes a closed `<details>` block ("Hint 1 of 3: title"), so a
learner opens one at a time. Text before the first heading stays visible.

Solutions are named NN_name.ipynb (the short labs, NN the lesson) or pN_name.ipynb (project labs,
sorted after them).

A release without the solutions (`python -m shardlib lessons DIR --no-solutions`, or an install built
without them) gets RELEASED_NOTE on top of each lab instead of NOTE, which links to the solution.

The output is deterministic (the JSON layout Jupyter itself writes), so regenerating an
unchanged solution gives identical bytes and `python -m shardlib labs --check` can tell
whether labs/ is stale.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = 'raise NotImplementedError("write this part: see the instructions above")'
SOLUTION_ONLY_TAG = "solution-only"
CHECK_TAG = "check"
HINTS_TAG = "hints"
HINT_HEADING = "#### "
NBGRADER_SCHEMA = 3
LAB_NAME = re.compile(r"(\d\d|p\d)_\w+\.ipynb$")  # 03_zero1_step.ipynb, p1_zero3_from_scratch.ipynb
NOTE_CELL_ID = "generated-lab-note"
# the kernelspec of the course's environment (ipykernel's own), which every notebook is saved with: a
# notebook naming another display name opens in JupyterLab already "modified"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when shardlib runs from one (see find_root)
NOTE = """\
> **This lab is generated from [`{source}`](../{source})** by `python -m shardlib labs`:
> edit the solution there, never this file by hand.
>
> Replace each `raise NotImplementedError(...)` with your code, then run the notebook from
> the top. The cells tagged `check` hold your code against a reference: they fail until
> your code is right, and pass when it is. `python -m shardlib grade labs/{name}` runs
> the whole lab in a fresh kernel and prints your score. Stuck? The worked answer is in `{source}`.
"""
RELEASED_NOTE = """\
> Replace each `raise NotImplementedError(...)` with your code, then run the notebook from
> the top. The cells tagged `check` hold your code against a reference: they fail until
> your code is right, and pass when it is. `python -m shardlib grade labs/{name}` runs
> the whole lab in a fresh kernel and prints your score.
"""


class LabError(ValueError):
    """A solution notebook whose markers cannot be turned into a lab."""


def source_text(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def as_lines(text: str) -> list[str]:
    """Notebook JSON stores a cell's source as a list of lines, each keeping its newline."""
    return text.splitlines(keepends=True)


def stub_regions(text: str, where: str) -> tuple[str, int]:
    """Replace each BEGIN/END region of `text` by the stub; return (new text, regions replaced)."""
    out, inside, regions = [], False, 0
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        marker = line.strip()
        if marker.startswith(BEGIN):
            if inside:
                raise LabError(f"{where}, line {number}: {BEGIN!r} inside another solution region")
            inside, regions = True, regions + 1
            indent = line[: len(line) - len(line.lstrip())]
            newline = "\n" if line.endswith("\n") else ""
            out.append(f"{indent}{STUB}{newline}")
        elif marker.startswith(END):
            if not inside:
                raise LabError(f"{where}, line {number}: {END!r} without a {BEGIN!r} before it")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise LabError(f"{where}: {BEGIN!r} is never closed by {END!r}")
    new = "".join(out)
    if new.endswith("\n") and not text.endswith("\n"):  # the region ended the cell
        new = new[:-1]
    return new, regions


def cell_tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def hidden_hints(text: str, where: str) -> str:
    """A `hints` cell's text with each `#### title` section folded into a closed <details> block."""
    preamble, hints = [], []  # hints: [title, body lines]
    for line in text.splitlines():
        if line.startswith(HINT_HEADING):
            hints.append([line[len(HINT_HEADING):].strip(), []])
        elif hints:
            hints[-1][1].append(line)
        else:
            preamble.append(line)
    if not hints:
        raise LabError(f"{where}: a cell tagged {HINTS_TAG!r} needs one '{HINT_HEADING}title' heading per hint")
    blocks = ["\n".join(preamble).strip()] if "\n".join(preamble).strip() else []
    for number, (title, body) in enumerate(hints, start=1):
        # blank lines around the body: JupyterLab and GitHub render markdown inside <details> only then
        blocks.append(f"<details><summary>Hint {number} of {len(hints)}: {title}</summary>\n\n"
                      f"{chr(10).join(body).strip()}\n\n</details>")
    return "\n\n".join(blocks)


def nbgrader_metadata(kind: str, grade_id: str, points: float | None = None) -> dict:
    """nbgrader's cell metadata (schema 3) for an answer, a check, or a read-only cell."""
    meta = {"grade": kind == "check", "grade_id": grade_id, "locked": kind != "answer",
            "schema_version": NBGRADER_SCHEMA, "solution": kind == "answer", "task": False}
    if kind == "check":
        meta["points"] = points
    return meta


def check_points(cell: dict, where: str) -> float:
    """The points of a check cell: the solution's {"nbgrader": {"points": P}}, else 1."""
    points = cell.get("metadata", {}).get("nbgrader", {}).get("points", 1)
    if isinstance(points, bool) or not isinstance(points, (int, float)) or points < 0:
        raise LabError(f"{where}: points must be a number >= 0, got {points!r}")
    return points


def cell_kind(cell: dict, regions: int, where: str) -> str:
    """answer (holds a solution region), check (tagged `check`) or given (everything else)."""
    if CHECK_TAG in cell_tags(cell):
        if cell["cell_type"] != "code":
            raise LabError(f"{where}: only code cells can be tagged {CHECK_TAG!r}")
        if regions:
            raise LabError(f"{where}: a check cell holds a solution region; put the learner's code in its own cell")
        return "check"
    return "answer" if regions else "given"


def with_grading_metadata(new: dict, cell: dict, kind: str, grade_id: str, where: str) -> dict:
    """`new` (a lab or source cell) with nbgrader's metadata, and JupyterLab's locks on checks."""
    metadata = {key: value for key, value in new["metadata"].items() if key not in ("nbgrader", "editable", "deletable")}
    points = check_points(cell, where) if kind == "check" else None
    metadata["nbgrader"] = nbgrader_metadata(kind, grade_id, points)
    if kind == "check":
        metadata.update(editable=False, deletable=False)
    elif kind == "answer":
        metadata["deletable"] = False
    return dict(new, metadata=metadata)


def lab_cell(cell: dict, index: int, where: str) -> tuple[dict, int]:
    """The lab's version of one solution cell: stubbed, without outputs; and its region count."""
    text, regions = source_text(cell), 0
    if cell["cell_type"] == "code":
        text, regions = stub_regions(text, f"{where}, cell {index}")
    elif HINTS_TAG in cell_tags(cell):
        text = hidden_hints(text, f"{where}, cell {index}")
    metadata = {key: value for key, value in cell.get("metadata", {}).items()
                if key not in ("execution", "collapsed", "scrolled")}
    new = {"cell_type": cell["cell_type"], "id": cell.get("id") or f"cell-{index}",
           "metadata": metadata, "source": as_lines(text)}
    if cell["cell_type"] == "code":
        new["execution_count"] = None
        new["outputs"] = []
    if "attachments" in cell:
        new["attachments"] = copy.deepcopy(cell["attachments"])
    return new, regions


def note_cell(source: str) -> dict:
    return {"cell_type": "markdown", "id": NOTE_CELL_ID,
            "metadata": {"nbgrader": nbgrader_metadata("given", NOTE_CELL_ID)},
            "source": as_lines(NOTE.format(source=source, name=Path(source).name))}


def graded_cells(solution: dict, source: str, keep_solutions: bool = False) -> tuple[list[dict], int]:
    """The cells of the lab (or, keep_solutions=True, of nbgrader's source version), with their
    nbgrader metadata; and the number of solution regions."""
    cells, regions, counts, seen = [], 0, {"answer": 0, "check": 0}, set()
    for index, cell in enumerate(solution["cells"]):
        if SOLUTION_ONLY_TAG in cell_tags(cell):
            continue
        where = f"{source}, cell {index}"
        new, found = lab_cell(cell, index, source)
        kind = cell_kind(cell, found, where)
        if kind in counts:
            counts[kind] += 1
        grade_id = f"{kind}-{counts[kind]}" if kind in counts else f"cell-{index}"
        if kind == "check":
            grade_id = stored_grade_id(cell, where) or grade_id
            if grade_id in seen:
                raise LabError(f"{where}: grade id {grade_id!r} is used twice; give each check its own")
            seen.add(grade_id)
        if keep_solutions and cell["cell_type"] == "code":
            new = dict(new, source=as_lines(source_text(cell)))
        cells.append(with_grading_metadata(new, cell, kind, grade_id, where))
        regions += found
    return cells, regions


def stored_grade_id(cell: dict, where: str) -> str | None:
    found = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
    if found is not None and not (isinstance(found, str) and re.fullmatch(r"[A-Za-z0-9_-]+", found)):
        raise LabError(f"{where}: grade_id must be letters, digits, - and _, got {found!r}")
    return found


def with_check_grade_ids(solution: dict, source: str) -> dict | None:
    """The solution with each check cell's grade id written into its metadata; None when all are there."""
    lab_checks = [cell for cell in graded_cells(solution, source)[0] if cell["metadata"]["nbgrader"]["grade"]]
    checks = [cell for cell in solution["cells"]
              if CHECK_TAG in cell_tags(cell) and SOLUTION_ONLY_TAG not in cell_tags(cell)]
    if all(stored_grade_id(cell, source) for cell in checks):
        return None
    stamped = copy.deepcopy(solution)
    targets = [cell for cell in stamped["cells"]
               if CHECK_TAG in cell_tags(cell) and SOLUTION_ONLY_TAG not in cell_tags(cell)]
    for cell, generated in zip(targets, lab_checks):
        grading = cell.setdefault("metadata", {}).setdefault("nbgrader", {})
        grading["grade_id"] = generated["metadata"]["nbgrader"]["grade_id"]
    return stamped


def released(lab: dict) -> dict:
    """The lab as handed out without the solutions: its note names no solution."""
    cells = [dict(cell, source=as_lines(RELEASED_NOTE.format(name=lab_name(lab))))
             if cell.get("id") == NOTE_CELL_ID else cell for cell in lab["cells"]]
    return dict(lab, cells=cells)


def lab_name(lab: dict) -> str:
    note = next((source_text(cell) for cell in lab["cells"] if cell.get("id") == NOTE_CELL_ID), "")
    found = re.search(r"grade labs/(\S+?\.ipynb)", note)
    return found.group(1) if found else "LAB.ipynb"


def make_lab(solution: dict, source: str) -> dict:
    """The lab notebook (a dict) for a solution notebook (a dict) read from `source`."""
    cells, regions = graded_cells(solution, source)
    cells.insert(0, note_cell(source))
    if regions == 0:
        raise LabError(f"{source}: no {BEGIN!r} region, so the lab would give the answer away")
    metadata = solution.get("metadata", {})
    kernelspec = metadata.get("kernelspec", KERNELSPEC)
    return {
        "cells": cells,
        # The solution's kernelspec and language_info (what its kernel reported): JupyterLab rewrites
        # both when they differ from the running kernel's, so a lab opens unmodified where its solution
        # was executed; nothing else, so that labs do not churn with who ran the solution last.
        "metadata": {"kernelspec": kernelspec, "language_info": metadata.get("language_info", {"name": "python"})},
        "nbformat": 4,
        "nbformat_minor": max(5, solution.get("nbformat_minor", 5)),  # 4.5: cells carry ids
    }


def dumps(notebook: dict) -> str:
    """Serialise the way Jupyter does (nbformat.writes), so saving in Jupyter changes nothing."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False, separators=(",", ": ")) + "\n"


def lab_path_for(solution_path: Path, labs_dir: Path) -> Path:
    return labs_dir / solution_path.name


def solution_paths(solutions_dir: Path) -> list[Path]:
    return sorted(path for path in solutions_dir.glob("*.ipynb") if LAB_NAME.match(path.name))


def nbgrader_source(solution: dict, source: str) -> dict:
    """nbgrader's source version of a solution: the answers kept (markers included, for nbgrader's
    `generate_assignment` to clear), outputs removed: the lab cell for cell, note included (nbgrader's
    autograde knows a submitted lab's cells by their grade ids)."""
    lab = make_lab(solution, source)  # refuses a solution without regions
    return dict(lab, cells=[lab["cells"][0], *graded_cells(solution, source, keep_solutions=True)[0]])


def generate_text(solution_path: Path, root: Path = REPO_ROOT) -> str:
    """The exact text of the lab generated from one solution notebook."""
    solution = json.loads(solution_path.read_text(encoding="utf-8"))
    try:
        source = solution_path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:  # a solution outside the repository (tests use temporary ones)
        source = f"solutions/{solution_path.name}"
    return dumps(make_lab(solution, source))


def stale_labs(solutions_dir: Path, labs_dir: Path, root: Path = REPO_ROOT) -> list[Path]:
    """Labs that are missing or differ from what their solution generates."""
    stale = []
    for solution_path in solution_paths(solutions_dir):
        lab_path = lab_path_for(solution_path, labs_dir)
        if not lab_path.exists() or lab_path.read_text(encoding="utf-8") != generate_text(solution_path, root):
            stale.append(lab_path)
    return stale


def unstamped_solutions(solutions_dir: Path) -> list[Path]:
    """Solutions with a check cell that has no grade id yet (`python -m shardlib labs` writes them)."""
    return [path for path in solution_paths(solutions_dir)
            if with_check_grade_ids(json.loads(path.read_text(encoding="utf-8")), path.name) is not None]


def stamp_solutions(solutions_dir: Path) -> list[Path]:
    """Write the check cells' grade ids into the solutions that lack them (metadata only)."""
    stamped = []
    for path in unstamped_solutions(solutions_dir):
        solution = with_check_grade_ids(json.loads(path.read_text(encoding="utf-8")), path.name)
        path.write_text(dumps(solution), encoding="utf-8", newline="\n")
        stamped.append(path)
    return stamped


def orphan_labs(solutions_dir: Path, labs_dir: Path) -> list[Path]:
    """Notebooks in labs/ with no solution to generate them from."""
    names = {path.name for path in solution_paths(solutions_dir)}
    return sorted(path for path in labs_dir.glob("*.ipynb") if path.name not in names)


def has_learner_work(lab_path: Path) -> bool:
    """A lab someone has run (it has outputs) is someone's work: not overwritten without --force."""
    notebook = json.loads(lab_path.read_text(encoding="utf-8"))
    return any(cell.get("outputs") or cell.get("execution_count") for cell in notebook.get("cells", []))


def write_labs(solutions_dir: Path, labs_dir: Path, root: Path = REPO_ROOT, force: bool = False) -> list[Path]:
    """(Re)write every stale lab, after writing missing check grade ids into the solutions; return the files
    written. Raises LabError on learner work."""
    stamped = stamp_solutions(solutions_dir)
    stale = stale_labs(solutions_dir, labs_dir, root)
    kept = [path for path in stale if path.exists() and has_learner_work(path)]
    if kept and not force:
        names = ", ".join(str(path) for path in kept)
        raise LabError(f"{names}: has outputs, so it looks like your own work; not overwritten. "
                       "Copy it elsewhere, or pass --force to overwrite it.")
    labs_dir.mkdir(parents=True, exist_ok=True)
    for lab_path in stale:
        solution_path = solutions_dir / lab_path.name
        lab_path.write_text(generate_text(solution_path, root), encoding="utf-8", newline="\n")
    return stamped + stale


def write_nbgrader_sources(solutions_dir: Path, course_dir: Path, root: Path = REPO_ROOT) -> list[Path]:
    """nbgrader's source folder: course_dir/source/<lab>/<lab>.ipynb for every lab, one assignment per lab
    (then `nbgrader generate_assignment <lab>` in course_dir). Existing files are overwritten."""
    written = []
    for solution_path in solution_paths(solutions_dir):
        solution = json.loads(solution_path.read_text(encoding="utf-8"))
        target = Path(course_dir) / "source" / solution_path.stem / solution_path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(dumps(nbgrader_source(solution, f"solutions/{solution_path.name}")), encoding="utf-8",
                          newline="\n")
        written.append(target)
    return written


def nbgrader_main(course_dir: Path, root: Path | None = None) -> int:
    """`python -m shardlib labs --nbgrader DIR`: write nbgrader's source notebooks into DIR/source/."""
    try:
        root = root or find_root()
        written = write_nbgrader_sources(root / "solutions", Path(course_dir), root)
    except LabError as error:
        print(f"error: {error}")
        return 1
    for path in written:
        print(f"wrote {path}")
    print(f"{len(written)} assignments in {Path(course_dir) / 'source'}: in {course_dir}, run "
          "`nbgrader generate_assignment <name>` for each (see INSTRUCTORS.md)")
    return 0


def find_root(start: Path | None = None) -> Path:
    """The course folder whose solutions/ to read: the checkout shardlib runs from, else the nearest
    folder at or above `start` (default: the working folder) that holds solutions/NN_*.ipynb, such
    as one written by `python -m shardlib lessons DIR`."""
    here = Path(start or Path.cwd()).resolve()
    for candidate in (REPO_ROOT, here, *here.parents):
        if solution_paths(candidate / "solutions"):
            return candidate
    raise LabError(f"no solutions/ folder with NN_name.ipynb notebooks in {here} or above it; run this in the "
                   "course's folder (a clone, or one written by `python -m shardlib lessons DIR`)")


def main(check: bool = False, force: bool = False, root: Path | None = None, as_json: bool = False) -> int:
    try:
        root = root or find_root()
    except LabError as error:
        return _report({"labs": 0, "check": check, "written": [], "stale": [], "orphans": [], "error": str(error)},
                       as_json, 1)
    solutions_dir, labs_dir = root / "solutions", root / "labs"
    report = {"labs": len(solution_paths(solutions_dir)), "check": check, "written": [], "stale": [], "orphans": [],
              "error": None}
    if not solution_paths(solutions_dir):
        report["error"] = f"no solution notebooks (NN_name.ipynb) in {solutions_dir}"
        return _report(report, as_json, 1)
    try:
        if check:
            report["stale"] = [str(p.relative_to(root)) for p in stale_labs(solutions_dir, labs_dir, root)
                               + unstamped_solutions(solutions_dir)]
            report["orphans"] = [str(p.relative_to(root)) for p in orphan_labs(solutions_dir, labs_dir)]
            return _report(report, as_json, 1 if report["stale"] or report["orphans"] else 0)
        report["written"] = [str(p.relative_to(root)) for p in write_labs(solutions_dir, labs_dir, root, force=force)]
    except LabError as error:
        report["error"] = str(error)
        return _report(report, as_json, 1)
    return _report(report, as_json, 0)


def _report(report: dict, as_json: bool, code: int) -> int:
    """Print what `python -m shardlib labs` did (as JSON with --json); return the exit code."""
    if as_json:
        print(json.dumps(dict(report, ok=code == 0), indent=1))
        return code
    if report["error"]:
        print(f"error: {report['error']}")
    for path in report["stale"]:
        print(f"stale: {path} (run `python -m shardlib labs`)")
    for path in report["orphans"]:
        print(f"orphan: {path} has no solutions/{Path(path).name}")
    for path in report["written"]:
        print(f"wrote {path}")
    if code == 0:
        written = "" if report["check"] else f", {len(report['written'])} written"
        print(f"labs/ is up to date with solutions/ ({report['labs']} labs{written})")
    return code
