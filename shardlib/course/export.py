"""`python -m shardlib lessons DIR`: write the course's notebooks and launch configs into a folder.

Wherever shardlib is installed (a wheel, `pip install git+URL` on a cloud notebook, a checkout),
this writes

    DIR/notebooks/   the lessons, with their saved outputs
    DIR/labs/        the exercises (generated from the solutions)
    DIR/solutions/   the worked answers
    DIR/configs/     the Accelerate configs and the Slurm script of lesson 08

A wheel carries the notebooks inside the package (shardlib/course/notebooks, ...: see setup.py);
a checkout reads them from the repository's own folders. A file that already exists with other
content (someone's work) is left alone unless `force`.

Without the solutions (`--no-solutions`, or an install built without them: a classroom install,
`SHARDLIB_WITHOUT_SOLUTIONS=1 pip install ...`, see setup.py) nothing is written into solutions/ and
each lab's note on top names no solution (labgen.RELEASED_NOTE), so no link in the release points
at a file it does not have.

SETUP_CELL is the first code cell of every lesson: on a cloud notebook without the course it
installs it; where shardlib imports, it does nothing.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

SETUP_CELL = '''\
# Set-up: on a cloud notebook without the course, install it; where it is installed this does nothing.
try:
    import shardlib
except ImportError:
    %pip install --quiet "shardlib @ git+https://github.com/sharding-course/sharding-course"
    import shardlib'''

FOLDERS = ("notebooks", "labs", "solutions")


def is_setup_cell(source: str) -> bool:
    """Whether a code cell is meant as the set-up cell (it may still differ from SETUP_CELL)."""
    return source.lstrip().startswith("# Set-up") or ("%pip install" in source and "import shardlib" in source)


def course_folder(name: str) -> Path:
    """notebooks, labs or solutions: the copy inside an installed package, else the checkout's folder."""
    if name not in FOLDERS:
        raise ValueError(f"unknown course folder {name!r}: one of {', '.join(FOLDERS)}")
    packaged = resources.files("shardlib.course").joinpath(name)
    if isinstance(packaged, Path) and any(packaged.glob("*.ipynb")):
        return packaged
    checkout = Path(__file__).resolve().parents[2] / name  # shardlib/course/export.py -> the repository
    if any(checkout.glob("*.ipynb")):
        return checkout
    raise FileNotFoundError(f"this shardlib install carries no {name}/ (looked in {packaged} and {checkout}); "
                            "install it from a wheel or from the repository (pip install git+URL)")


def has_solutions() -> bool:
    try:
        course_folder("solutions")
    except FileNotFoundError:
        return False
    return True


def _released_lab(path: Path) -> bytes:
    from shardlib.course import labgen

    return labgen.dumps(labgen.released(json.loads(path.read_text(encoding="utf-8")))).encode("utf-8")


def _files(target: Path, solutions: bool) -> list[tuple[Path, Path, bytes]]:
    """(destination, source, content) of everything `lessons` writes."""
    from shardlib.resources import config_names, config_path

    files = []
    for name in FOLDERS if solutions else ("notebooks", "labs"):
        for path in sorted(course_folder(name).glob("*.ipynb")):
            content = _released_lab(path) if name == "labs" and not solutions else path.read_bytes()
            files.append((target / name / path.name, path, content))
    files += [(target / "configs" / name, config_path(name), config_path(name).read_bytes()) for name in config_names()]
    return files


def write_lessons(target: str | Path, force: bool = False,
                  solutions: bool | None = None) -> tuple[list[Path], list[Path]]:
    """Copy the course into `target`; return (written, kept): kept files differ and were not overwritten.
    solutions: write them (default: when this install has them); without, the labs' notes name none."""
    target = Path(target)
    solutions = has_solutions() if solutions is None else solutions and has_solutions()
    written, kept = [], []
    for destination, _, content in _files(target, solutions):
        if destination.exists() and destination.read_bytes() == content:
            continue
        if destination.exists() and not force:
            kept.append(destination)
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(content)
        written.append(destination)
    return written, kept


def main(target: str, force: bool = False, solutions: bool = True) -> int:
    try:
        written, kept = write_lessons(target, force, solutions=None if solutions else False)
    except (FileNotFoundError, OSError) as error:
        print(f"error: {error}")
        return 1
    root = Path(target)
    for path in kept:
        print(f"kept {path.relative_to(root)}: it differs from the course's copy (your work?); --force overwrites it")
    lessons = sorted((root / "notebooks").glob("*.ipynb"))
    folders = "notebooks/, labs/, solutions/, configs/" if (root / "solutions").is_dir() else \
        "notebooks/, labs/, configs/ (no solutions)"
    print(f"wrote {len(written)} files into {target}: {len(lessons)} lessons in {folders}")
    if lessons:
        print(f"open {root / 'notebooks' / lessons[0].name} to start (jupyter lab {root})")
    return 0
