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
    monkeypatch.setattr(module, "no_nvidia_gpu", lambda: False)  # tests that need no GPU say so
    monkeypatch.setattr(module, "index_reachable", lambda url: True)
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
    assert re.search(r"^(exec )?python3 course\.py test\b", ci, re.M)
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


def test_the_tests_run_on_two_workers_unless_the_arguments_ask_for_one_process(monkeypatch):
    """pytest-xdist's options come before the user's (a later `-n 0` wins); `-p no:xdist` and a debugger
    would make pytest refuse them, so then they are left out."""
    course = load_course()
    called = []
    monkeypatch.setattr(course, "call", lambda command, **kwargs: called.append([str(p) for p in command]) or 0)
    for extra in ([], ["-x", "-k", "ring"], ["-m", "gpu"], ["tests/test_course.py"], ["-n", "0"], ["-p", "no:cacheprovider"]):
        course.run_tests(Path("python"), extra)
        at = called[-1].index("-n")
        assert called[-1][at:at + len(course.WORKERS)] == course.WORKERS and called[-1][-len(extra) or len(called[-1]):] == extra
    for extra in (["-p", "no:xdist"], ["-pno:xdist"], ["-x", "--pdb"], ["--trace"]):
        course.run_tests(Path("python"), extra)
        assert not set(course.WORKERS) & set(called[-1][:len(called[-1]) - len(extra)]), called[-1]
    assert course.WORKERS[:2] == ["-n", "3"] and "loadfile" in course.WORKERS


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


def test_default_setup_with_an_nvidia_gpu_never_reaches_the_cpu_index(course):
    course.ensure_environment()
    assert not any("download.pytorch.org" in " ".join(command) for command in course.commands)


def test_first_setup_without_an_nvidia_gpu_installs_the_cpu_build_and_says_so(course, monkeypatch, capsys):
    monkeypatch.setattr(course, "no_nvidia_gpu", lambda: True)
    course.ensure_environment()
    pips = [command[1:] for command in course.commands if command[1:3] == ["-m", "pip"]]
    assert pips[-2][-2:] == ["--index-url", "https://download.pytorch.org/whl/cpu"] and pips[-1][-2:] == ["-e", "."]
    assert "no NVIDIA GPU here" in capsys.readouterr().out
    assert "cpu-torch" in (course.STAMP.read_text()).split(), "the choice must be kept for later reinstalls"


def test_an_unreachable_cpu_index_falls_back_to_the_default_build_and_says_why(course, monkeypatch, capsys):
    monkeypatch.setattr(course, "no_nvidia_gpu", lambda: True)
    asked = []
    monkeypatch.setattr(course, "index_reachable", lambda url: asked.append(url) or False)
    course.ensure_environment()
    assert asked == ["https://download.pytorch.org/whl/cpu/torch/"]
    assert not any("--index-url" in command for command in course.commands)
    assert course.commands[-1][1:] == ["-m", "pip", "install", "-e", "."]
    out = capsys.readouterr().out
    assert "cannot be reached" in out and "https://download.pytorch.org/whl/cpu" in out and "remove .venv" in out
    assert "cpu-torch" not in course.STAMP.read_text().split()


def test_the_index_probe_tells_an_answering_server_from_a_closed_port():
    """index_reachable against this machine: a closed port (no answer) and a server answering 404."""
    import http.server
    import socket
    import threading

    course = load_course()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nobody listens once the socket is closed
    assert course.index_reachable(f"http://127.0.0.1:{closed}/whl/cpu/torch/", timeout=5) is False
    assert course.index_reachable("not a url") is False
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # BaseHTTPRequestHandler answers every request with an error status: still an answer
        assert course.index_reachable(f"http://127.0.0.1:{server.server_port}/whl/cpu/torch/", timeout=5) is True
    finally:
        server.shutdown()
        server.server_close()


def test_test_and_site_install_their_extras_and_later_setups_keep_them(course, tmp_path: Path):
    course.ensure_environment(extras=course.EXTRAS["site"])
    assert course.commands[-1][1:] == ["-m", "pip", "install", "-e", ".[site]"]
    course.ensure_environment(extras=course.EXTRAS["test"])
    assert course.commands[-1][1:] == ["-m", "pip", "install", "-e", ".[browser,site]"]
    course.commands.clear()
    course.ensure_environment()  # a plain set-up afterwards: nothing to reinstall
    course.ensure_environment(extras=course.EXTRAS["site"])
    assert course.commands == []


def test_the_extras_course_py_installs_are_pyprojects():
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {name for names in load_course().EXTRAS.values() for name in names}
    assert wanted <= set(extras), f"course.py installs extras pyproject.toml lacks: {wanted - set(extras)}"
    assert not any(r.split("[")[0].startswith(("sphinx", "myst", "playwright")) for r in
                   tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]), \
        "the website's and the browser tests' tools belong in the extras, not in the course's dependencies"


def test_cpu_torch_flag_is_not_passed_to_jupyter(monkeypatch):
    course = load_course()
    seen = {}
    monkeypatch.setattr(course, "ensure_environment",
                        lambda cpu_torch=False, use_lock=True, extras=(): seen.setdefault("cpu", cpu_torch) and Path("py"))
    monkeypatch.setattr(course, "open_course", lambda python, extra: seen.setdefault("extra", extra) and 0)
    course.main(["--cpu-torch", "--no-browser"])
    assert seen == {"cpu": True, "extra": ["--no-browser"]}


@pytest.mark.parametrize("root", [True, False])
def test_lab_as_root_passes_allow_root_and_says_so(monkeypatch, capsys, root):
    course = load_course()
    called = []
    monkeypatch.setattr(course, "running_as_root", lambda: root)
    monkeypatch.setattr(course, "serve", lambda command: called.append([str(p) for p in command]) or 0)
    course.open_course(Path("python"), ["--no-browser"])
    assert ("--allow-root" in called[0]) == root
    assert ("passing --allow-root" in capsys.readouterr().out) == root


def test_jupyterlab_serves_the_course_folder_and_opens_lesson_00(monkeypatch):
    course = load_course()
    monkeypatch.setattr(course, "running_as_root", lambda: False)
    command = [str(part) for part in course.lab_command(Path("python"), ["--no-browser", "--port", "8890"])]
    assert command[:4] == ["python", "-m", "jupyter", "lab"] and command[-3:] == ["--no-browser", "--port", "8890"]
    assert f"--ServerApp.root_dir={REPO_ROOT}" in command, "labs/ and solutions/ must be reachable"
    assert f"--LabApp.default_url=/lab/tree/{course.FIRST_LESSON}" in command
    assert (REPO_ROOT / course.FIRST_LESSON).is_file()
    assert not any(part.endswith(".ipynb") and not part.startswith("--") for part in command), \
        "a notebook given as an argument makes its folder JupyterLab's root"


SERVER = """
import pathlib, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda *frame: got.append("INT"))
def stop(*frame):
    pathlib.Path(sys.argv[1]).write_text(" ".join(got + ["TERM"]))
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "stubborn" else stop)
pathlib.Path(sys.argv[1]).write_text("ready")
while True:
    time.sleep(0.05)
"""


def serve_and_interrupt(course, tmp_path: Path, behaviour: str) -> tuple:
    """course.serve() running a stand-in server, given Ctrl-C (SIGINT to this process) once it is up."""
    import signal
    import sys
    import threading
    import time

    (tmp_path / "server.py").write_text(SERVER)
    log = tmp_path / "signals.txt"

    def interrupt():
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text() == "ready") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    code = course.serve([sys.executable, tmp_path / "server.py", log, behaviour])
    return code, log.read_text()


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals and process groups")
def test_ctrl_c_reaches_the_server_as_its_clean_stop(tmp_path: Path, capsys):
    """Ctrl-C in course.py becomes SIGTERM for JupyterLab (its shutdown without questions); the server,
    in its own process group, never sees the SIGINT itself."""
    code, seen = serve_and_interrupt(load_course(), tmp_path, "stops")
    assert (code, seen) == (0, "TERM"), f"the server exited {code} after receiving {seen!r}"
    assert "stopping JupyterLab (SIGINT)" in capsys.readouterr().out


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals and process groups")
def test_a_server_that_ignores_the_stop_is_killed_after_the_timeout(tmp_path: Path, monkeypatch, capsys):
    import signal

    course = load_course()
    monkeypatch.setattr(course, "STOP_TIMEOUT", 1)
    code, seen = serve_and_interrupt(course, tmp_path, "stubborn")
    assert code == -signal.SIGKILL and seen == "ready"
    assert "did not stop within 1 s: killing it" in capsys.readouterr().out


# ---------------------------------------------------------------------------------
# the notebooks open unmodified: saved with the environment's kernelspec


def kernelspec_mismatches(paths: list, expected: dict) -> list:
    import json

    return [f"{path.parent.name}/{path.name}: {kernelspec}" for path in paths
            if (kernelspec := json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get("kernelspec"))
            != expected]


def test_every_committed_notebook_carries_the_environments_kernelspec(tmp_path: Path):
    import ipykernel.kernelspec

    from shardlib.course.labgen import KERNELSPEC

    native = ipykernel.kernelspec.get_kernel_dict()
    expected = {"display_name": native["display_name"], "language": native["language"],
                "name": ipykernel.kernelspec.KERNEL_NAME}
    assert KERNELSPEC == expected, "labgen's kernelspec differs from the environment's"
    paths = [path for folder in ("notebooks", "labs", "solutions") for path in sorted((REPO_ROOT / folder).glob("*.ipynb"))]
    assert len(paths) > 30
    wrong = kernelspec_mismatches(paths, expected)
    assert not wrong, ("notebooks whose kernelspec differs from the environment's (JupyterLab opens them "
                       "modified):\n  " + "\n  ".join(wrong))
    (tmp_path / "old.ipynb").write_text('{"metadata": {"kernelspec": {"display_name": "Python 3", '
                                        '"language": "python", "name": "python3"}}}')
    assert kernelspec_mismatches([tmp_path / "old.ipynb"], expected), "the check misses an old display name"


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
