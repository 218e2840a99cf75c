"""The bootstrap (course.py), the Makefile and .ci/run agree with the README.

The set-up logic runs here with its commands recorded instead of executed; the real
thing (a fresh clone, its own .venv, the whole suite) is what `.ci/run` does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_course():
    spec = importlib.util.spec_from_file_location("course", REPO_ROOT / "course.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def course(tmp_path: Path, monkeypatch):
    """course.py pointed at a temporary project whose commands are recorded, not run."""
    module = load_course()
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "VENV", tmp_path / ".venv")
    monkeypatch.setattr(module, "STAMP", tmp_path / ".venv" / "course-stamp.txt")
    monkeypatch.setattr(module, "LOCK", tmp_path / "course-lock.txt")  # none unless a test writes one
    module.commands = []

    def run(command, **kwargs):
        command = [str(part) for part in command]
        module.commands.append(command)
        if command[1:3] == ["-m", "venv"]:  # make the interpreter the venv would hold
            module.venv_python().parent.mkdir(parents=True)
            module.venv_python().touch()

    monkeypatch.setattr(module, "run", run)
    monkeypatch.setattr(module, "pip_version", lambda python: (20, 2))
    return module


def test_fresh_checkout_creates_venv_upgrades_old_pip_installs_and_stamps(course, tmp_path: Path):
    python = course.ensure_environment()
    assert python == course.venv_python()
    assert [command[1:] for command in course.commands] == [
        ["-m", "venv", str(tmp_path / ".venv")],
        ["-m", "pip", "install", "--upgrade", "pip"],
        ["-m", "pip", "install", "-e", "."],
    ]
    stamp = (tmp_path / ".venv" / "course-stamp.txt").read_text().strip()
    assert stamp == hashlib.sha256((tmp_path / "pyproject.toml").read_bytes()).hexdigest()


def test_nothing_to_do_when_stamp_matches_and_reinstall_when_pyproject_changes(course, tmp_path: Path):
    course.ensure_environment()
    course.commands.clear()
    course.ensure_environment()
    assert course.commands == []
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\ndependencies = ['tqdm']\n")
    course.ensure_environment()
    assert [command[-3:] for command in course.commands][-1] == ["install", "-e", "."]
    assert not any("venv" in command for command in course.commands)  # same venv, reinstalled


def test_recent_pip_is_not_upgraded(course, monkeypatch):
    monkeypatch.setattr(course, "pip_version", lambda python: (23, 2))
    course.ensure_environment()
    assert not any("--upgrade" in command for command in course.commands)


def test_windows_interpreter_path(course, monkeypatch, tmp_path: Path):
    monkeypatch.setattr(course.os, "name", "nt")
    assert course.venv_python() == tmp_path / ".venv" / "Scripts" / "python.exe"


def test_test_command_runs_everything_unless_given_paths():
    course = load_course()
    assert course.TEST_PATHS == ["tests", "notebooks"]
    assert "--nbval-current-env" in course.PYTEST_OPTIONS and "--nbval-lax" in course.PYTEST_OPTIONS
    assert not course.uses_own_paths(["-x", "-k", "ring"])
    assert course.uses_own_paths(["tests/test_course.py::test_windows_interpreter_path"])


def test_minimum_python_is_pyprojects():
    text = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    requires = re.search(r'requires-python\s*=\s*"([^"]+)"', text)[1]
    major, minor = load_course().MIN_PYTHON
    assert SpecifierSet(requires) == SpecifierSet(f">={major}.{minor}")


def test_ci_and_make_call_the_readme_commands():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    ci = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 course.py test" in readme and "python3 course.py\n" in readme
    assert re.search(r"^exec python3 course\.py test\b", ci, re.M)
    assert os.access(REPO_ROOT / ".ci" / "run", os.X_OK) or os.name == "nt"
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    for target, command in [("course", "course.py"), ("test", "course.py test"), ("labs", "course.py labs")]:
        assert re.search(rf"^{target}:.*\n\t\$\(PYTHON\) {re.escape(command)}$", makefile, re.M), target


def test_k_with_a_folder_name_keeps_every_test_path():
    """`course.py test -k tests`: "tests" is -k's expression, not a path; notebooks still run."""
    course = load_course()
    assert course.named_paths(["-k", "tests"]) == []
    assert course.named_paths(["-m", "not slow", "-x"]) == []
    assert course.named_paths(["-k", "ring", "tests/test_course.py::test_windows_interpreter_path"]) == [
        "tests/test_course.py::test_windows_interpreter_path"]
    assert course.named_paths(["-knotebooks", "notebooks"]) == ["notebooks"]  # a value inside its option
    assert course.named_paths(["--maxfail=1", "tests"]) == ["tests"]


def test_test_command_with_k_still_runs_tests_and_notebooks(monkeypatch):
    course = load_course()
    called = []
    monkeypatch.setattr(course, "call", lambda command, **kwargs: called.append([str(p) for p in command]) or 0)
    assert course.run_tests(Path("python"), ["-k", "tests"]) == 0
    assert called[0][:5] == ["python", "-m", "pytest", "tests", "notebooks"] and called[0][-2:] == ["-k", "tests"]


def test_cpu_torch_installs_pytorchs_cpu_build_at_pyprojects_version_first(course, tmp_path: Path):
    import tomllib

    (tmp_path / "pyproject.toml").write_text((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    torch_requirement = next(r for r in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
                             ["dependencies"] if r.startswith("torch"))
    course.ensure_environment(cpu_torch=True)
    pips = [command[1:] for command in course.commands if command[1:3] == ["-m", "pip"]]
    assert pips[-2:] == [["-m", "pip", "install", torch_requirement, "--index-url", "https://download.pytorch.org/whl/cpu"],
                         ["-m", "pip", "install", "-e", "."]]
    course.commands.clear()
    course.ensure_environment(cpu_torch=True)  # remembered: nothing to do
    course.ensure_environment()  # and a plain run keeps the CPU build
    assert course.commands == []


def test_default_setup_never_reaches_the_cpu_index(course):
    course.ensure_environment()
    assert not any("download.pytorch.org" in " ".join(command) for command in course.commands)


def test_cpu_torch_flag_is_not_passed_to_jupyter(monkeypatch):
    course = load_course()
    seen = {}
    monkeypatch.setattr(course, "ensure_environment",
                        lambda cpu_torch=False, use_lock=True: seen.setdefault("cpu", cpu_torch) and Path("py"))
    monkeypatch.setattr(course, "open_course", lambda python, extra: seen.setdefault("extra", extra) and 0)
    course.main(["--cpu-torch", "--no-browser"])
    assert seen == {"cpu": True, "extra": ["--no-browser"]}


@pytest.mark.parametrize("root", [True, False])
def test_lab_as_root_passes_allow_root_and_says_so(monkeypatch, capsys, root):
    course = load_course()
    called = []
    monkeypatch.setattr(course, "running_as_root", lambda: root)
    monkeypatch.setattr(course, "call", lambda command, **kwargs: called.append([str(p) for p in command]) or 0)
    course.open_course(Path("python"), ["--no-browser"])
    assert ("--allow-root" in called[0]) == root
    assert ("passing --allow-root" in capsys.readouterr().out) == root


def test_a_reinstall_keeps_the_cpu_build_once_chosen(course, tmp_path: Path):
    course.ensure_environment(cpu_torch=True)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\ndependencies = ['torch>=2.7']\n")
    course.commands.clear()
    course.ensure_environment()  # pyproject changed, no flag given
    assert [c[4:7] for c in course.commands if "--index-url" in c] == [["torch>=2.7", "--index-url",
                                                                        "https://download.pytorch.org/whl/cpu"]]


# ---------------------------------------------------------------------------------
# the lock: the same versions for a whole class


def this_python() -> str:
    return load_course().this_python()


def write_lock(tmp_path: Path, python: str, pins: str = "torch==2.14.1\n") -> None:
    (tmp_path / "course-lock.txt").write_text(f"# header\n# python {python} (Linux x86_64)\n{pins}")


def test_the_setup_installs_the_locked_versions(course, tmp_path: Path):
    write_lock(tmp_path, this_python())
    course.ensure_environment()
    assert course.commands[-1][1:] == ["-m", "pip", "install", "-e", ".", "-c", "course-lock.txt"]


def test_a_changed_lock_reinstalls_and_no_lock_installs_the_newest(course, tmp_path: Path, capsys):
    write_lock(tmp_path, this_python())
    course.ensure_environment()
    course.commands.clear()
    course.ensure_environment()
    assert course.commands == [], "nothing changed, yet the set-up reinstalled"
    write_lock(tmp_path, this_python(), "torch==2.14.1\nnumpy==2.4.6\n")
    course.ensure_environment()
    assert course.commands[-1][-2:] == ["-c", "course-lock.txt"], "a new lock did not reinstall"
    course.commands.clear()
    course.ensure_environment(use_lock=False)
    assert course.commands[-1][1:] == ["-m", "pip", "install", "-e", "."]
    assert "--no-lock" in capsys.readouterr().out


def test_a_lock_made_with_another_python_is_not_applied_and_that_is_said(course, tmp_path: Path, capsys):
    write_lock(tmp_path, "2.7")
    course.ensure_environment()
    assert course.commands[-1][1:] == ["-m", "pip", "install", "-e", "."]
    assert "made with Python 2.7" in capsys.readouterr().out


def test_the_cpu_build_is_installed_within_the_lock_too(course, tmp_path: Path):
    write_lock(tmp_path, this_python())
    course.ensure_environment(cpu_torch=True)
    cpu = next(c for c in course.commands if "--index-url" in c)
    assert cpu[-2:] == ["-c", "course-lock.txt"], "the CPU build would ignore the locked torch version"


def locked_versions() -> dict:
    from packaging.requirements import Requirement

    pins = {}
    for line in (REPO_ROOT / "course-lock.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            requirement = Requirement(line)
            pins[requirement.name.lower().replace("_", "-")] = next(iter(requirement.specifier)).version
    return pins


def direct_dependencies() -> list:
    """pyproject's requirements that apply to this Python, as (normalised name, Requirement)."""
    import tomllib

    from packaging.requirements import Requirement

    requirements = [Requirement(text) for text in
                    tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    return [(r.name.lower().replace("_", "-"), r) for r in requirements if r.marker is None or r.marker.evaluate()]


def test_the_committed_lock_pins_every_dependency_within_pyproject():
    header = (REPO_ROOT / "course-lock.txt").read_text(encoding="utf-8").splitlines()[:5]
    assert any(line.startswith("# python ") for line in header), "the lock must say which Python made it"
    pins = locked_versions()
    problems = []
    for name, requirement in direct_dependencies():
        if name not in pins:
            problems.append(f"{name} is not pinned")
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{name}=={pins[name]} is outside pyproject's {requirement.specifier}")
    assert not problems, f"course-lock.txt disagrees with pyproject.toml ({problems}): run `python3 course.py lock`"


def test_this_environment_runs_the_locked_versions_of_the_direct_dependencies():
    """What the suite runs on is what the lock pins (a set-up made with --no-lock or another Python is exempt)."""
    import sys
    from importlib.metadata import version

    stamp = Path(sys.prefix) / "course-stamp.txt"
    if not stamp.exists() or "no-lock" in stamp.read_text() or f"# python {this_python()}" not in \
            (REPO_ROOT / "course-lock.txt").read_text(encoding="utf-8"):
        pytest.skip("this environment was not set up from the lock by course.py")
    pins = locked_versions()
    differ = []
    for name, requirement in direct_dependencies():
        if version(requirement.name).split("+")[0] != pins[name]:
            differ.append(f"{name} {version(requirement.name)} (lock {pins[name]})")
    assert not differ, f"installed versions differ from course-lock.txt: {differ}"
