#!/usr/bin/env python3
"""Set up the course and open it, or run every test. Needs only Python 3.10+.

    python3 course.py             set up .venv if needed, then open JupyterLab on the course folder at lesson 00
                                  (Ctrl-C stops it: its kernels are shut down and its runtime files removed)
    python3 course.py test [ARGS] set up .venv if needed, then run all tests
                                  (pytest over tests/, nbval over notebooks/; the lab solutions run in tests/test_labs.py);
                                  ARGS go to pytest, e.g. `-x`, `-k ring`, `-m "not slow"` (the fast tier),
                                  or paths to run only those; three workers share the files (pytest-xdist),
                                  `-n 0` or `-p no:xdist` runs them one at a time in one process
    python3 course.py labs [ARGS] regenerate labs/ from solutions/ (`python -m shardlib labs`)
    python3 course.py site [DIR]  build the course's website from the executed notebooks into DIR
                                  (default build/site; open DIR/index.html); installs the `site` extra
    python3 course.py lock        refresh course-lock.txt: install pyproject.toml's newest allowed versions
                                  into a fresh environment and write down every version (instructors)

    --cpu-torch                   (with any command) install PyTorch's CPU-only build (about 200 MB)
                                  instead of the default CUDA build (several GB). The first set-up on Linux
                                  without an NVIDIA GPU does so unasked; when https://download.pytorch.org/whl/cpu
                                  cannot be reached it says so and installs the default build instead.
    --no-lock                     (with any command) install the newest versions pyproject.toml allows
                                  instead of the ones course-lock.txt pins

Versions: the set-up installs the versions course-lock.txt pins (pip's constraints file), so a class
that installs on different days gets the same stack, the one the course was tested with. The lock
was made with one Python minor version (its header says which); with another Python, or with
--no-lock, pip picks the newest versions pyproject.toml allows, and says so.

Set-up: creates the virtual environment .venv from pyproject.toml when it is missing, and
reinstalls the project (`pip install -e .`) whenever pyproject.toml or course-lock.txt has changed
since the last install (their hash is kept in .venv/course-stamp.txt). `test` also installs the
`site` and `browser` extras (the website's build tools, Playwright for the browser tests), `site` the
first; once installed, later set-ups keep them. Extra arguments after `python3 course.py` (no command)
go to `jupyter lab`, e.g. `--no-browser --port 8890`; run as root (as in many cloud containers), it
passes `--allow-root` to JupyterLab and says so.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / "course-stamp.txt"
MIN_PYTHON = (3, 10)
MIN_PIP = (21, 3)  # first pip that installs a pyproject project in editable mode (PEP 660)
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU-only wheels (pytorch.org/get-started)
CPU_TORCH_FLAG = "--cpu-torch"
NO_LOCK_FLAG = "--no-lock"
LOCK = ROOT / "course-lock.txt"
EXTRAS = {"test": ("site", "browser"), "site": ("site",)}  # pyproject's optional extras each command needs
FIRST_LESSON = "notebooks/00_memory_wall.ipynb"
SITE_CONFIG = "docs"  # conf.py and the site's own pages
SITE_FOLDERS = ("notebooks", "labs")  # the notebooks the site shows, at their repository paths; never solutions/
STOP_TIMEOUT = 60  # seconds JupyterLab gets to shut its kernels down after Ctrl-C

TEST_PATHS = ["tests", "notebooks"]  # solutions/ run in tests/test_labs.py, beside their stubs
PYTEST_OPTIONS = [
    "--nbval-lax",  # notebooks: a cell fails only if it raises; checks are asserts in cells
    "--nbval-current-env",  # run notebooks with this environment's Python, whatever kernel they name
    "--nbval-cell-timeout=900",
    "--nbval-kernel-startup-timeout=300",
]
# Three workers (pytest-xdist) on the 2-core machine the suite is sized for: much of the suite waits
# (kernels and ranks starting, timeouts, emulated devices): on two workers the cores were busy 54% of the
# wall time (user + system 26 min in 24 min on 2 cores, quiet), so a third worker runs meanwhile (the same
# suite then took 23 min). Each file runs whole on one worker, in its order (a notebook's cells share one kernel, a
# module's fixtures are made once); tests/conftest.py hands the files out longest first.
WORKERS = ["-n", "3", "--dist", "loadfile", "--no-loadscope-reorder"]
SERIAL = {"-pno:xdist", "--pdb", "--trace"}  # pytest-xdist off (also `-p no:xdist`), a debugger at the terminal

# OMP_NUM_THREADS: the workers, their kernels and their ranks outnumber the cores; a process with two OpenMP
# threads then waits for the one descheduled (tests/conftest.py: 144 s against 1.4 s for one set of generations)
TEST_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}


def worker_options(extra: list) -> list:
    """WORKERS, unless the arguments run the tests serially (`-p no:xdist`, a debugger); `-n 0` needs
    nothing here: it comes after WORKERS, and pytest takes the last."""
    pairs = zip(extra, [*extra[1:], ""])
    return [] if any(arg in SERIAL or (arg, value) == ("-p", "no:xdist") for arg, value in pairs) else WORKERS


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
    """The hash of what decides the installed versions: pyproject.toml and the lock, when there is one."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    if LOCK.exists():
        digest.update(LOCK.read_bytes())
    return digest.hexdigest()


def this_python() -> str:
    """This interpreter's minor version, as the lock's header writes it ("3.11")."""
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def lock_python() -> str | None:
    """The Python minor version the lock was made with ("3.11"), from its header; None without a lock."""
    if not LOCK.exists():
        return None
    found = re.search(r"^# python (\d+\.\d+)", LOCK.read_text(encoding="utf-8"), re.M)
    return found[1] if found else None


def lock_options(use_lock: bool) -> list:
    """pip's `-c course-lock.txt` when the lock applies to this Python, else nothing (and why)."""
    here, made_with = this_python(), lock_python()
    if not use_lock:
        say(f"{NO_LOCK_FLAG}: installing the newest versions pyproject.toml allows")
        return []
    if made_with is None:
        say(f"no {LOCK.name}: installing the newest versions pyproject.toml allows")
        return []
    if made_with != here:
        say(f"{LOCK.name} was made with Python {made_with}, this is {here}: installing the newest versions "
            f"pyproject.toml allows (`python3 course.py lock` makes a lock for this Python)")
        return []
    return ["-c", LOCK.name]


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


def torch_requirement() -> str:
    """pyproject.toml's requirement on torch (e.g. "torch>=2.6"), read without a TOML parser (Python 3.10)."""
    found = re.search(r"""["'](torch(?:\s*[<>=!~][^"';]*)?)["']""", (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return found[1] if found else "torch"


def cpu_torch_command(python: Path) -> list:
    """pip installing PyTorch's CPU-only build, at pyproject's version; `pip install -e .` keeps it."""
    return [python, "-m", "pip", "install", torch_requirement(), "--index-url", CPU_TORCH_INDEX]


def no_nvidia_gpu() -> bool:
    """Linux without an NVIDIA driver (no /proc/driver/nvidia, no nvidia-smi): where the default (CUDA)
    PyTorch wheel is several GB for nothing. Reads no GPU library, so it starts nothing."""
    return (sys.platform.startswith("linux") and not Path("/proc/driver/nvidia").exists()
            and shutil.which("nvidia-smi") is None)


def index_reachable(url: str, timeout: float = 10) -> bool:
    """Whether a package index answers at all (any HTTP status counts), within `timeout` seconds."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False
    return True


def choose_cpu_torch(asked: bool, stamp: list) -> bool:
    """Whether to install PyTorch's CPU-only build: when asked (--cpu-torch, or an earlier set-up's
    choice kept in the stamp) or, on a first set-up, on Linux without an NVIDIA GPU; never when its
    index cannot be reached (then the default build, and why)."""
    wanted = asked or "cpu-torch" in stamp
    if not wanted and not stamp and no_nvidia_gpu():
        say("no NVIDIA GPU here (Linux): installing PyTorch's CPU-only build (about 200 MB) instead of the "
            "CUDA build (several GB)")
        wanted = True
    if wanted and not index_reachable(CPU_TORCH_INDEX + "/torch/"):
        say(f"PyTorch's CPU index {CPU_TORCH_INDEX} cannot be reached from here: installing PyTorch from the "
            "default index instead (on Linux that is the CUDA build, several GB). For the CPU build later, "
            f"remove {VENV.name} and run this command again once the index can be reached")
        wanted = False
    return wanted


def stamp_extras(stamp: list) -> set:
    return {token.split(":", 1)[1] for token in stamp if token.startswith("extra:")}


def ensure_environment(cpu_torch: bool = False, use_lock: bool = True, extras: tuple = ()) -> Path:
    """Create .venv and install the project into it, unless that is already up to date.
    cpu_torch: install PyTorch's CPU-only build first (and remember it in the stamp); see choose_cpu_torch.
    use_lock: install the versions course-lock.txt pins (see lock_options).
    extras: pyproject's optional extras to install too; once installed, later set-ups keep them."""
    if sys.version_info < MIN_PYTHON:
        sys.exit(f"[course] this course needs Python {'.'.join(map(str, MIN_PYTHON))} or newer; "
                 f"this is {sys.version.split()[0]}. Run it with a newer python3.")
    python = venv_python()
    if not python.exists():
        create_venv()
    stamp = STAMP.read_text().split() if STAMP.exists() else []
    extras = sorted(set(extras) | stamp_extras(stamp))
    flags = (["cpu-torch"] if cpu_torch or "cpu-torch" in stamp else []) + ([] if use_lock else ["no-lock"])
    if stamp == [pyproject_hash(), *flags, *(f"extra:{name}" for name in extras)]:
        say(f"environment {VENV.relative_to(ROOT)} is up to date with pyproject.toml")
        return python
    say("installing the course package and its dependencies (the first time takes a few minutes)")
    cpu_torch = choose_cpu_torch(cpu_torch, stamp)
    if pip_version(python) < MIN_PIP:
        run([python, "-m", "pip", "install", "--upgrade", "pip"])
    constraints = lock_options(use_lock)
    if cpu_torch:
        say(f"installing PyTorch's CPU-only build from {CPU_TORCH_INDEX}")
        run(cpu_torch_command(python) + constraints)
    run([python, "-m", "pip", "install", "-e", f".[{','.join(extras)}]" if extras else ".", *constraints])
    flags = (["cpu-torch"] if cpu_torch else []) + ([] if use_lock else ["no-lock"])
    STAMP.write_text(" ".join([pyproject_hash(), *flags, *(f"extra:{name}" for name in extras)]) + "\n")
    say("installation done")
    return python


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_command(python: Path, extra: list) -> list:
    """`jupyter lab` serving the course's top folder (lessons, labs and solutions all reachable), its
    printed URL and the page it opens lesson 00."""
    if running_as_root() and "--allow-root" not in extra:
        say("running as root (as in many cloud containers): passing --allow-root to JupyterLab, "
            "which refuses to start as root without it")
        extra = [*extra, "--allow-root"]
    return [python, "-m", "jupyter", "lab", f"--ServerApp.root_dir={ROOT}",
            f"--LabApp.default_url=/lab/tree/{FIRST_LESSON}", *extra]


def serve(command: list) -> int:
    """Run JupyterLab until it stops. Ctrl-C (SIGINT), SIGTERM or a closed terminal (SIGHUP) reach it as
    SIGTERM, its clean stop (kernels shut down, runtime files removed), which it gets STOP_TIMEOUT
    seconds to finish. It runs in its own process group, so that a terminal's Ctrl-C reaches it through
    this process only: its own Ctrl-C handler asks a question on the terminal and gives up after 5 s."""
    if os.name == "nt":  # no process groups nor SIGTERM there: the console sends Ctrl-C to both of us
        return call(command)
    say("$ " + " ".join(str(part) for part in command))
    process = subprocess.Popen([str(part) for part in command], cwd=ROOT, start_new_session=True)
    stopping = []  # when each stop signal came

    def stop(signum, frame):
        if not stopping and signum != signal.SIGHUP:  # after a hang-up there is no terminal to write to
            say(f"stopping JupyterLab ({signal.Signals(signum).name}): shutting its kernels down")
        stopping.append(time.monotonic())
        process.send_signal(signal.SIGTERM)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, stop) for signum in handled}
    try:
        while True:
            try:
                return process.wait(timeout=0.5)  # a wait that returns to look at the clock
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0] > STOP_TIMEOUT:
                    say(f"JupyterLab did not stop within {STOP_TIMEOUT} s: killing it")
                    process.kill()
                    return process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def open_course(python: Path, extra: list) -> int:
    say(f"opening JupyterLab on {ROOT.name}/ at {FIRST_LESSON} (stop it with Ctrl-C)")
    return serve(lab_command(python, extra))


def stage_site(root: Path, stage: Path) -> Path:
    """The site's source folder: the pages of docs/ and the notebooks of SITE_FOLDERS at their
    repository paths (copied with their times, so that a rebuild redoes only what changed)."""
    if stage.exists():
        shutil.rmtree(stage)
    shutil.copytree(root / SITE_CONFIG, stage, ignore=shutil.ignore_patterns("conf.py", "__pycache__"))
    for folder in SITE_FOLDERS:
        (stage / folder).mkdir(parents=True)
        for path in sorted((root / folder).glob("*.ipynb")):
            shutil.copy2(path, stage / folder / path.name)
    return stage


def site_command(python: Path, out: Path, root: Path = ROOT) -> list:
    """sphinx-build of the staged site into `out`, every warning an error (broken link, missing image,
    a notebook in no table of contents); staging and caches beside `out`."""
    stage = stage_site(root, out.parent / f"{out.name}-source")
    return [python, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-c", root / SITE_CONFIG,
            "-d", out.parent / f"{out.name}-doctrees", stage, out]


def build_site(python: Path, extra: list) -> int:
    out = Path(extra[0]).resolve() if extra else ROOT / "build" / "site"
    say(f"building the website from the saved notebooks into {os.path.relpath(out, ROOT)}")
    code = call(site_command(python, out))
    if code == 0:
        say(f"done: open {out / 'index.html'} in a browser")
    return code


# pytest options whose value is the next argument (`-k tests` names no path); `-kring` and
# `--maxfail=1` carry theirs inside.
OPTIONS_WITH_VALUE = {
    "-k", "-m", "-p", "-c", "-o", "-W", "-r", "--maxfail", "--deselect", "--ignore", "--ignore-glob", "--rootdir",
    "--confcutdir", "--basetemp", "--durations", "--durations-min", "--tb", "--junitxml", "--junit-xml",
    "--log-level", "--log-cli-level", "--log-file", "--capture", "--color", "--import-mode", "--override-ini",
    "--timeout", "--nbval-cell-timeout", "--nbval-kernel-startup-timeout",
    "--nbval-kernel-name", "--nbval-sanitize-with", "--config-file", "--inifile",
}


def named_paths(extra: list) -> list:
    """The tests the extra pytest arguments name (paths or path::test), not option values."""
    paths, skip = [], False
    for arg in extra:
        if skip:
            skip = False
        elif arg in OPTIONS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists():
            paths.append(arg)
    return paths


def uses_own_paths(extra: list) -> bool:
    """True when the extra pytest arguments name tests to run (a path or path::test)."""
    return bool(named_paths(extra))


def run_tests(python: Path, extra: list) -> int:
    paths = [] if uses_own_paths(extra) else TEST_PATHS
    env = dict(os.environ)
    for name, value in TEST_ENV.items():
        env.setdefault(name, value)
    say("running the tests: pytest over tests/ (lab solutions included), nbval over notebooks/"
        if paths else "running the tests you named")
    return call([python, "-m", "pytest", *paths, *PYTEST_OPTIONS, *worker_options(extra), *extra], env=env)


def refresh_lock() -> int:
    """Install the project, unconstrained, into a fresh environment and write down every version."""
    import platform
    import tempfile

    with tempfile.TemporaryDirectory(prefix="course-lock-") as folder:
        python = Path(folder) / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        run([sys.executable, "-m", "venv", folder])
        run([python, "-m", "pip", "install", "--upgrade", "pip"])
        run([python, "-m", "pip", "install", f".[{','.join(sorted(set(sum(EXTRAS.values(), ()))))}]"])
        frozen = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude", "shardlib"], check=True,
                                capture_output=True, text=True, cwd=ROOT).stdout
    here = this_python()
    LOCK.write_text(f"# The versions the course is tested with: pip's constraints file, used by `python3 course.py`.\n"
                    f"# Made by `python3 course.py lock` from pyproject.toml's requirements.\n"
                    f"# python {here} ({platform.system()} {platform.machine()})\n" + frozen, encoding="utf-8")
    say(f"wrote {LOCK.name}: {sum(1 for line in frozen.splitlines() if '==' in line)} pinned packages, Python {here}")
    return 0


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
    cpu_torch, use_lock = CPU_TORCH_FLAG in argv, NO_LOCK_FLAG not in argv
    argv = [arg for arg in argv if arg not in (CPU_TORCH_FLAG, NO_LOCK_FLAG)]
    command, extra = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("lab", argv)
    if command not in ("lab", "test", "labs", "lock", "site"):
        print(__doc__)
        say(f"unknown command {command!r}: use no command, `test`, `labs`, `site` or `lock`")
        return 2
    if command == "lock":
        try:
            return refresh_lock()
        except subprocess.CalledProcessError as error:
            say(f"the lock was not refreshed: a step failed (exit code {error.returncode}); the output above says why")
            return 1
    try:
        python = ensure_environment(cpu_torch=cpu_torch, use_lock=use_lock, extras=EXTRAS.get(command, ()))
    except subprocess.CalledProcessError as error:
        say(f"set-up failed (exit code {error.returncode}); the output above says why. "
            "Fix it and run this command again: the set-up resumes where it stopped.")
        return 1
    if command == "test":
        return run_tests(python, extra)
    if command == "labs":
        return call([python, "-m", "shardlib", "labs", *extra])
    if command == "site":
        return build_site(python, extra)
    return open_course(python, extra)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
