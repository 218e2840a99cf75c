"""A cloud user, simulated: the course installed from a wheel, used from a folder outside the checkout.

The wheel is built from a copy of the checkout's files (what a clone would hold, uncommitted
work included), installed into a fresh virtual environment outside the checkout, and the lessons
are written into an empty folder with `python -m shardlib lessons`; lessons 00 and 03 then run
there under nbval, as CI runs them, and meanwhile lesson 08's route (FSDP2 over two ranks, the model
and the topic data read from the installed package) runs as `torchrun -m shardlib.finetune` for a
few steps. The whole of lesson 08 already runs in the main suite on the same code; running it again
here would add about four minutes to every CI run.

Dependencies: the fresh environment gets them from the course's own .venv through a .pth file
(one line: the .venv's site-packages), added AFTER the wheel is installed. Why not
--system-site-packages: the course's .venv is itself a virtual environment, and a venv made from
it inherits the base interpreter's site-packages, not the .venv's, so torch would be missing and
pip would download several GB. A .pth path is appended after the new environment's own
site-packages, so `import shardlib` finds the wheel's copy, and .pth files inside the appended
folder (the checkout's editable install) are not run. The test checks both.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import pytest

from shardlib.course.export import SETUP_CELL, is_setup_cell

REPO_ROOT = Path(__file__).resolve().parent.parent
LESSONS_RUN = ("00_", "03_")


def _sh(command: list, cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _start(command: list, cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """Start a command in the background, in a process group of its own (_stop ends all of it), its output
    into files (a pipe nobody reads would stall it)."""
    with log.with_suffix(".out").open("w") as out, log.with_suffix(".err").open("w") as err:
        return subprocess.Popen([str(c) for c in command], cwd=cwd, env=env, stdout=out, stderr=err,
                                start_new_session=True)


def _stop(started: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(started.pid, signal.SIGKILL)  # torchrun and its ranks
    started.wait()


def _finish(started: subprocess.Popen, command: list, timeout: float, log: Path) -> str:
    """The stdout of a command _start began, once it ends (ended past `timeout`); it must have succeeded."""
    try:
        started.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(started)
    out, err = (log.with_suffix(suffix).read_text() for suffix in (".out", ".err"))
    assert started.returncode == 0, f"{' '.join(map(str, command))} failed ({started.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    return out


def _clone(target: Path) -> None:
    """The checkout's files as a clone would hold them: tracked and untracked, without what git ignores."""
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(source.read_bytes())


def _fresh_environment(where: Path, wheel: Path) -> Path:
    """A venv holding the wheel, then the course's dependencies through a .pth; returns its python."""
    venv.EnvBuilder(with_pip=True).create(where)  # ensurepip: pip's bundled wheel, offline
    python = where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # the new environment's own pip, which sees only that environment (never the course's .venv)
    _sh([python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", wheel], where, 300)
    site = Path(_sh([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where, 60).stdout.strip())
    (site / "course_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow
def test_wheel_installed_outside_the_checkout_runs_lessons_00_03_and_finetunes(tmp_path):
    started = time.perf_counter()
    src, dist, env_dir, work = (tmp_path / name for name in ("src", "dist", "env", "work"))
    for folder in (src, dist, work):
        folder.mkdir()
    _clone(src)
    # --no-build-isolation: build with the course's setuptools, offline
    _sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src], src, 600)
    wheel = next(dist.glob("shardlib-*.whl"))
    assert_classroom_wheel_has_no_solutions(src, tmp_path / "classroom", wheel)
    python = _fresh_environment(env_dir, wheel)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg")

    where = _sh([python, "-c", "import shardlib, shardlib.resources as r; print(shardlib.__file__); "
                 "print(r.data_path('topics')); print(r.config_path('slurm_2node.sbatch'))"], work, 120, env).stdout
    assert all(str(env_dir) in line for line in where.split()), f"shardlib or its data not from the wheel:\n{where}"

    _sh([python, "-m", "shardlib", "lessons", "course"], work, 120, env)
    course = work / "course"
    lessons = sorted(p.name for p in (course / "notebooks").glob("*.ipynb"))
    assert lessons == sorted(p.name for p in (REPO_ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in (course / "labs").glob("*.ipynb")) == sorted(p.name for p in (REPO_ROOT / "labs").glob("*.ipynb"))
    assert (course / "configs" / "accelerate" / "fsdp2_1node_8gpu.yaml").is_file()
    generated = _sh([python, "-m", "shardlib", "labs"], course, 120, env).stdout  # lab generation works from there
    assert "labs/ is up to date with solutions/" in generated, generated

    copies = [name for name in lessons if (course / "notebooks" / name).read_bytes() != (REPO_ROOT / "notebooks" / name).read_bytes()]
    assert not copies, f"the package's lessons differ from the checkout's: {copies}"  # so the suite's nbval run covers them
    chosen = [course / "notebooks" / name for name in lessons if name.startswith(LESSONS_RUN)]
    assert len(chosen) == len(LESSONS_RUN)
    # the fine-tune runs while nbval does: each waits much of its time (kernels, ranks starting), two cores serve both
    finetune = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "shardlib.finetune",
                "--max-steps", "3", "--max-eval-examples", "32", "--progress", "none", "--device", "cpu",
                "--output-dir", work / "run"]
    tuning = _start(finetune, course, dict(env, OMP_NUM_THREADS="1"), work / "finetune")
    try:
        ran = _sh([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", course, "--nbval-lax",
                   "--nbval-current-env", "--nbval-cell-timeout=900", *chosen], course, 1800, env)
    except BaseException:
        _stop(tuning)
        raise
    assert " passed" in ran.stdout and "failed" not in ran.stdout, ran.stdout[-3000:]
    tuned = _finish(tuning, finetune, 600, work / "finetune")

    result = json.loads([line for line in tuned.splitlines() if line.startswith("{")][-1])
    assert 0.0 <= result["test_accuracy"] <= 1.0 and result["mixed_precision"] == "no", result
    print(f"packaging test: wheel built, installed, lessons written, 00 and 03 run, 2-rank fine-tune done in "
          f"{time.perf_counter() - started:.0f} s")


def test_the_set_up_cell_is_one_text_in_every_lesson_that_has_one():
    """Each lesson whose first code cell is a set-up cell carries exactly SETUP_CELL; lesson 08 has one."""
    firsts = {}
    for path in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
        source = "".join(cells[0]["source"]) if cells else ""
        if is_setup_cell(source):
            firsts[path.name] = source
    assert "08_finetune_accelerate_fsdp.ipynb" in firsts, "lesson 08's first code cell must be the set-up cell"
    wrong = [name for name, source in firsts.items() if source.strip() != SETUP_CELL]
    assert not wrong, f"set-up cells that differ from shardlib.course.export.SETUP_CELL: {wrong}"


def test_the_set_up_cell_installs_the_repository_named_in_pyproject():
    import tomllib

    urls = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
    assert f'"shardlib @ git+{urls["Repository"]}"' in SETUP_CELL
    assert is_setup_cell(SETUP_CELL) and not is_setup_cell("import shardlib\nprint(1)")


def test_lessons_writes_the_course_and_keeps_a_learners_changes(tmp_path, capsys):
    from shardlib.__main__ import main as cli
    from shardlib.course.export import write_lessons

    assert cli(["lessons", str(tmp_path / "course")]) == 0
    course = tmp_path / "course"
    for folder in ("notebooks", "labs", "solutions"):
        theirs = sorted(p.name for p in (REPO_ROOT / folder).glob("*.ipynb"))
        assert sorted(p.name for p in (course / folder).glob("*.ipynb")) == theirs and theirs, folder
    assert (course / "configs" / "slurm_2node.sbatch").is_file()
    mine = course / "labs" / "01_ring_allreduce.ipynb"
    mine.write_text("my work")
    written, kept = write_lessons(course)
    assert written == [] and kept == [mine] and mine.read_text() == "my work"
    written, kept = write_lessons(course, force=True)
    assert written == [mine] and kept == [] and mine.read_bytes() == (REPO_ROOT / "labs" / mine.name).read_bytes()


def test_lab_generation_finds_the_course_folder_it_runs_in(tmp_path, monkeypatch):
    """Outside a checkout (as from a wheel) `python -m shardlib labs` works in a folder written by
    `lessons`, from any folder below it, and elsewhere says where it looked."""
    from shardlib.course import labgen
    from shardlib.course.export import write_lessons

    write_lessons(tmp_path / "course")
    monkeypatch.setattr(labgen, "REPO_ROOT", tmp_path / "not-a-checkout")
    monkeypatch.chdir(tmp_path / "course" / "notebooks")
    assert labgen.find_root() == (tmp_path / "course").resolve()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(labgen.LabError, match=f"no solutions/ folder .* in {tmp_path}"):
        labgen.find_root()


def assert_classroom_wheel_has_no_solutions(src: Path, dist: Path, full_wheel: Path) -> None:
    """SHARDLIB_WITHOUT_SOLUTIONS=1: the same wheel as `full_wheel`, less the package's solutions/."""
    env = dict(os.environ, SHARDLIB_WITHOUT_SOLUTIONS="1")
    for stale in (src / "build", *src.glob("*.egg-info")):  # setuptools would reuse the first build's files
        shutil.rmtree(stale)
    _sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src], src, 600, env)
    names = zipfile.ZipFile(next(dist.glob("shardlib-*.whl"))).namelist()
    full = zipfile.ZipFile(full_wheel).namelist()
    assert any(n.startswith("shardlib/course/solutions/") for n in full), "the ordinary wheel carries the solutions"
    assert not any("solutions/" in n and n.endswith(".ipynb") for n in names), "a classroom wheel with solutions"
    assert {n for n in full if n.endswith(".ipynb") and "/solutions/" not in n} == \
        {n for n in names if n.endswith(".ipynb")}, "the classroom wheel lacks lessons or labs"


MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(folder: Path) -> list[str]:
    """Relative links in the markdown cells of the notebooks under `folder` whose target is not there."""
    broken = []
    for path in sorted(folder.rglob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for target in MARKDOWN_LINK.findall("".join(cell["source"])):
                if re.match(r"[a-z]+:|#", target):
                    continue
                if not (path.parent / target.split("#")[0]).exists():
                    broken.append(f"{path.relative_to(folder)}: {target}")
    return broken


def test_a_release_without_solutions_names_none_and_no_link_breaks(tmp_path, monkeypatch, capsys):
    from shardlib.__main__ import main as cli
    from shardlib.course import export

    assert not broken_links(REPO_ROOT / "notebooks") and not broken_links(REPO_ROOT / "labs")
    assert cli(["lessons", str(tmp_path / "release"), "--no-solutions"]) == 0
    release = tmp_path / "release"
    assert not (release / "solutions").exists() and "(no solutions)" in capsys.readouterr().out
    assert sorted(p.name for p in (release / "labs").glob("*.ipynb")) == \
        sorted(p.name for p in (REPO_ROOT / "labs").glob("*.ipynb"))
    assert not broken_links(release), broken_links(release)
    mentions = [p.name for p in (release / "labs").glob("*.ipynb") if "solutions/" in p.read_text(encoding="utf-8")]
    assert not mentions, f"released labs that still name a solution: {mentions}"
    # an install built without solutions: the same, without being asked
    real = export.course_folder
    monkeypatch.setattr(export, "course_folder", lambda name: (_ for _ in ()).throw(FileNotFoundError(name))
                        if name == "solutions" else real(name))
    written, _ = export.write_lessons(tmp_path / "classroom")
    assert written and not (tmp_path / "classroom" / "solutions").exists() and not broken_links(tmp_path / "classroom")
