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

SETUP_CELL is the first code cell of every lesson: on a cloud notebook without the course it
installs it; where shardlib imports, it does nothing.
"""

from __future__ import annotations

import shutil
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


def _files(target: Path) -> list[tuple[Path, Path]]:
    """(source, destination) pairs of everything `lessons` writes."""
    from shardlib.resources import config_names, config_path

    pairs = [(path, target / name / path.name) for name in FOLDERS
             for path in sorted(course_folder(name).glob("*.ipynb"))]
    pairs += [(config_path(name), target / "configs" / name) for name in config_names()]
    return pairs


def write_lessons(target: str | Path, force: bool = False) -> tuple[list[Path], list[Path]]:
    """Copy the course into `target`; return (written, kept): kept files differ and were not overwritten."""
    target = Path(target)
    written, kept = [], []
    for source, destination in _files(target):
        if destination.exists() and destination.read_bytes() == source.read_bytes():
            continue
        if destination.exists() and not force:
            kept.append(destination)
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, destination)
        written.append(destination)
    return written, kept


def main(target: str, force: bool = False) -> int:
    try:
        written, kept = write_lessons(target, force)
    except (FileNotFoundError, OSError) as error:
        print(f"error: {error}")
        return 1
    root = Path(target)
    for path in kept:
        print(f"kept {path.relative_to(root)}: it differs from the course's copy (your work?); --force overwrites it")
    lessons = sorted((root / "notebooks").glob("*.ipynb"))
    print(f"wrote {len(written)} files into {target}: {len(lessons)} lessons in notebooks/, labs/, solutions/, configs/")
    if lessons:
        print(f"open {root / 'notebooks' / lessons[0].name} to start (jupyter lab {root})")
    return 0
