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
NOTE_CELL_ID = "generated-lab-note"
REPO_ROOT = Path(__file__).resolve().parents[2]
NOTE = """\
> **This lab is generated from [`{source}`](../{source})** by `python -m shardlib labs`:
> edit the solution there, never this file by hand.
>
> Replace each `raise NotImplementedError(...)` with your code, then run the notebook from
> the top. The cells tagged `check` hold your code against a reference: they fail until
> your code is right, and pass when it is. Stuck? The worked answer is in `{source}`.
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


def lab_cell(cell: dict, index: int, where: str) -> tuple[dict, int]:
    """The lab's version of one solution cell: stubbed, without outputs; and its region count."""
    text, regions = source_text(cell), 0
    if cell["cell_type"] == "code":
        text, regions = stub_regions(text, f"{where}, cell {index}")
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
    return {"cell_type": "markdown", "id": NOTE_CELL_ID, "metadata": {},
            "source": as_lines(NOTE.format(source=source))}


def make_lab(solution: dict, source: str) -> dict:
    """The lab notebook (a dict) for a solution notebook (a dict) read from `source`."""
    cells, regions = [note_cell(source)], 0
    for index, cell in enumerate(solution["cells"]):
        if SOLUTION_ONLY_TAG in cell_tags(cell):
            continue
        new, found = lab_cell(cell, index, source)
        cells.append(new)
        regions += found
    if regions == 0:
        raise LabError(f"{source}: no {BEGIN!r} region, so the lab would give the answer away")
    metadata = solution.get("metadata", {})
    kernelspec = metadata.get("kernelspec", {"display_name": "Python 3", "language": "python", "name": "python3"})
    return {
        "cells": cells,
        # Only what does not depend on who ran the solution last, so labs do not churn.
        "metadata": {"kernelspec": kernelspec, "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": max(5, solution.get("nbformat_minor", 5)),  # 4.5: cells carry ids
    }


def dumps(notebook: dict) -> str:
    """Serialise the way Jupyter does (nbformat.writes), so saving in Jupyter changes nothing."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False, separators=(",", ": ")) + "\n"


def lab_path_for(solution_path: Path, labs_dir: Path) -> Path:
    return labs_dir / solution_path.name


def solution_paths(solutions_dir: Path) -> list[Path]:
    return sorted(path for path in solutions_dir.glob("*.ipynb") if re.match(r"\d\d_", path.name))


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


def orphan_labs(solutions_dir: Path, labs_dir: Path) -> list[Path]:
    """Notebooks in labs/ with no solution to generate them from."""
    names = {path.name for path in solution_paths(solutions_dir)}
    return sorted(path for path in labs_dir.glob("*.ipynb") if path.name not in names)


def has_learner_work(lab_path: Path) -> bool:
    """A lab someone has run (it has outputs) is someone's work: not overwritten without --force."""
    notebook = json.loads(lab_path.read_text(encoding="utf-8"))
    return any(cell.get("outputs") or cell.get("execution_count") for cell in notebook.get("cells", []))


def write_labs(solutions_dir: Path, labs_dir: Path, root: Path = REPO_ROOT, force: bool = False) -> list[Path]:
    """(Re)write every stale lab; return the labs written. Raises LabError on learner work."""
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
    return stale


def main(check: bool = False, force: bool = False, root: Path | None = None) -> int:
    root = root or REPO_ROOT
    solutions_dir, labs_dir = root / "solutions", root / "labs"
    if not solution_paths(solutions_dir):
        print(f"no solution notebooks (NN_name.ipynb) in {solutions_dir}")
        return 1
    try:
        if check:
            stale = stale_labs(solutions_dir, labs_dir, root)
            for path in stale:
                print(f"stale: {path.relative_to(root)} (run `python -m shardlib labs`)")
            for path in orphan_labs(solutions_dir, labs_dir):
                print(f"orphan: {path.relative_to(root)} has no solutions/{path.name}")
            if not stale and not orphan_labs(solutions_dir, labs_dir):
                print(f"labs/ is up to date with solutions/ ({len(solution_paths(solutions_dir))} labs)")
                return 0
            return 1
        written = write_labs(solutions_dir, labs_dir, root, force=force)
    except LabError as error:
        print(f"error: {error}")
        return 1
    for path in written:
        print(f"wrote {path.relative_to(root)}")
    print(f"labs/ is up to date with solutions/ ({len(solution_paths(solutions_dir))} labs, {len(written)} written)")
    return 0
