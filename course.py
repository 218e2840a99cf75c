#!/usr/bin/env python3
"""Set up the course and open it, or run every test. Needs only Python 3.10+.

    python3 course.py             set up .venv if needed, then open JupyterLab at lesson 00
    python3 course.py test [ARGS] set up .venv if needed, then run all tests
                                  (pytest over tests/, nbval over notebooks/; the lab solutions run in tests/test_labs.py);
                                  ARGS go to pytest, e.g. `-x`, `-k ring`, or paths to run only those
    python3 course.py labs [ARGS] regenerate labs/ from solutions/ (`python -m shardlib labs`)

Set-up: creates the virtual environment .venv from pyproject.toml when it is missing, and
reinstalls the project (`pip install -e .`) whenever pyproject.toml has changed since the last
install (its hash is kept in .venv/course-stamp.txt). Extra arguments after `python3 course.py`
(no command) go to `jupyter lab`, e.g. `--no-browser --port 8890`.
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / "course-stamp.txt"
MIN_PYTHON = (3, 10)
MIN_PIP = (21, 3)  # first pip that installs a pyproject project in editable mode (PEP 660)

TEST_PATHS = ["tests", "notebooks"]  # solutions/ run in tests/test_labs.py, beside their stubs
PYTEST_OPTIONS = [
    "--nbval-lax",  # notebooks: a cell fails only if it raises; checks are asserts in cells
    "--nbval-current-env",  # run notebooks with this environment's Python, whatever kernel they name
    "--nbval-cell-timeout=900",
    "--nbval-kernel-startup-timeout=300",
]
TEST_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg"}


def say(message: str) -> None:
    print(f"[course] {message}", flush=True)


def venv_python() -> Path:
    if os.name == "nt":
        return VENV / "Scripts" / "python.exe"
    return VENV / "bin" / "python"


def run(command: list, **kwargs) -> None:
    say("$ " + " ".join(str(part) for part in command))
    subprocess.run([str(part) for part in command], check=True, cwd=ROOT, **kwargs)


def pyproject_hash() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def pip_version(python: Path) -> tuple:
    out = subprocess.run(
        [str(python), "-m", "pip", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode != 0:
        return (0,)
    version = out.stdout.split()[1]  # "pip 23.2.1 from ..."
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def create_venv() -> None:
    say(f"creating the virtual environment {VENV.relative_to(ROOT)} (Python {sys.version.split()[0]})")
    try:
        run([sys.executable, "-m", "venv", *(["--clear"] if VENV.exists() else []), VENV])
    except subprocess.CalledProcessError:
        sys.exit(
            "[course] could not create a virtual environment. On Debian/Ubuntu install the venv "
            "module first (`sudo apt install python3-venv`), then run this command again."
        )


def ensure_environment() -> Path:
    """Create .venv and install the project into it, unless that is already up to date."""
    if sys.version_info < MIN_PYTHON:
        sys.exit(f"[course] this course needs Python {'.'.join(map(str, MIN_PYTHON))} or newer; "
                 f"this is {sys.version.split()[0]}. Run it with a newer python3.")
    python = venv_python()
    if not python.exists():
        create_venv()
    wanted = pyproject_hash()
    if STAMP.exists() and STAMP.read_text().strip() == wanted:
        say(f"environment {VENV.relative_to(ROOT)} is up to date with pyproject.toml")
        return python
    say("installing the course package and its dependencies (the first time takes a few minutes)")
    if pip_version(python) < MIN_PIP:
        run([python, "-m", "pip", "install", "--upgrade", "pip"])
    run([python, "-m", "pip", "install", "-e", "."])
    STAMP.write_text(wanted + "\n")
    say("installation done")
    return python


def first_lesson() -> str:
    lessons = sorted(glob.glob(str(ROOT / "notebooks" / "00_*.ipynb")))
    return os.path.relpath(lessons[0], ROOT) if lessons else "notebooks"


def open_course(python: Path, extra: list) -> int:
    target = first_lesson()
    say(f"opening JupyterLab at {target} (stop it with Ctrl-C)")
    return call([python, "-m", "jupyter", "lab", target, *extra])


def uses_own_paths(extra: list) -> bool:
    """True when the extra pytest arguments name tests to run (a path or path::test)."""
    return any(not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists() for arg in extra)


def run_tests(python: Path, extra: list) -> int:
    paths = [] if uses_own_paths(extra) else TEST_PATHS
    env = dict(os.environ)
    for name, value in TEST_ENV.items():
        env.setdefault(name, value)
    say("running the tests: pytest over tests/ (lab solutions included), nbval over notebooks/"
        if paths else "running the tests you named")
    return call([python, "-m", "pytest", *paths, *PYTEST_OPTIONS, *extra], env=env)


def call(command: list, **kwargs) -> int:
    say("$ " + " ".join(str(part) for part in command))
    try:
        return subprocess.call([str(part) for part in command], cwd=ROOT, **kwargs)
    except KeyboardInterrupt:
        return 130


def main(argv: list) -> int:
    if argv[:1] in (["help"], ["-h"], ["--help"]):
        print(__doc__)
        return 0
    command, extra = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("lab", argv)
    if command not in ("lab", "test", "labs"):
        print(__doc__)
        say(f"unknown command {command!r}: use no command, `test` or `labs`")
        return 2
    try:
        python = ensure_environment()
    except subprocess.CalledProcessError as error:
        say(f"set-up failed (exit code {error.returncode}); the output above says why. "
            "Fix it and run this command again: the set-up resumes where it stopped.")
        return 1
    if command == "test":
        return run_tests(python, extra)
    if command == "labs":
        return call([python, "-m", "shardlib", "labs", *extra])
    return open_course(python, extra)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
