"""Where the learner's code runs, with what limits, and how every process it started is ended.

    bubblewrap (bwrap, Debian's package `bubblewrap`), used whenever it is installed and works:
        the kernel runs in new PID, network, IPC and UTS namespaces, with every capability dropped,
        the whole file system read-only except its own scratch folder, and hidden (empty in its view):
        the submissions, the release, the results, the course's solutions, the course's checkouts that
        the grader knows of (all but the Python and the shardlib it runs: their solutions/, .git, tests/,
        build/...) and the grader's home (except the Python it runs). Processes in the PID namespace end with it, `setsid` or not.
    none, where bubblewrap is missing: the kernel runs as the grader's own user, in a scratch folder.

In both, the kernel is started through LAUNCHER, which sets resource limits before it starts: a
process's data segment (RLIMIT_DATA, the memory limit; allocations past it fail in that process),
no core files, and, for a user other than root, the number of processes (RLIMIT_NPROC; root is not
bound by it). A watch thread sums the memory (PSS) and counts the processes of the kernel's whole
tree twice a second and kills the tree past either limit. The grader is a child subreaper
(PR_SET_CHILD_SUBREAPER, no root needed), so a process that leaves its parent (`setsid`, a daemon's
double fork) is adopted by the grader instead of init, and is still found and killed at the end.

Root is needed only where the system asks it for user namespaces (bubblewrap works unprivileged on
Debian and most distributions); limits, the subreaper and the watch need no privilege.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import psutil

from shardlib.course.grading.notebook import GradeInputError
from shardlib.course.labgen import REPO_ROOT

DEFAULT_MEMORY_GIB = 6.0
DEFAULT_PROCESSES = 256
WATCH_S = 0.5
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
# the first program the kernel's command runs: limits, then the rest of the command
LAUNCHER = """\
import ctypes, os, resource, signal, sys
memory, processes = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))
if processes:
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed if the grader dies
except Exception:
    pass
os.environ.pop("JPY_PARENT_PID", None)  # in a PID namespace the kernel's parent is not the grader's pid
os.execvp(sys.argv[3], sys.argv[3:])
"""
ENV_KEPT = {"PATH", "PYTHONPATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
ENV_PREFIXES = ("SHARDLIB_", "HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "GLOO_", "NVIDIA_")


def become_subreaper() -> bool:
    """Adopt every orphaned descendant (Linux); False where the system has no such thing."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=1)
def bubblewrap() -> str | None:
    """The bwrap program, if it is installed and can make the namespaces the sandbox needs here."""
    found = shutil.which("bwrap")
    if not found:
        return None
    try:
        probe = subprocess.run([found, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
                                "--unshare-net", "--die-with-parent", "--cap-drop", "ALL", "true"],
                               capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return found if probe.returncode == 0 else None


def needed_paths() -> list[Path]:
    """What the kernel must still see: this Python, its libraries, everything on its path, and shardlib."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, Path(sys.executable).resolve().parent, *sys.path,
             Path(__file__).resolve().parents[2]]
    return [Path(p).resolve() for p in paths if p and Path(p).exists()]


def needed_under_fresh_folders() -> list[Path]:
    """The needed paths that the sandbox's fresh /tmp and /dev/shm would hide, outermost only."""
    fresh = [Path("/tmp").resolve(), Path("/dev/shm").resolve()]
    under = sorted({p for p in needed_paths() if any(f in p.parents for f in fresh)}, key=lambda p: len(p.parts))
    return [p for i, p in enumerate(under) if not any(q == p or q in p.parents for q in under[:i])]


def hideable(paths, needed: list[Path]) -> list[Path]:
    """The existing paths of `paths` that hold nothing the kernel needs (none is above a needed path)."""
    out = []
    for path in paths:
        path = Path(path).resolve()
        if path.exists() and not any(path == n or path in n.parents for n in needed) and path not in out:
            out.append(path)
    return out


def home_entries() -> list[Path]:
    try:
        return [entry for entry in Path.home().iterdir() if not entry.is_symlink()]
    except OSError:
        return []


def course_checkouts() -> list[Path]:
    """The course's source folders on this machine that the grader knows of: the one it runs from, and an
    editable install's (each has the solutions, and its git history has them too)."""
    found = [REPO_ROOT]
    try:
        from importlib.metadata import distribution

        url = json.loads(distribution("shardlib").read_text("direct_url.json") or "{}").get("url", "")
        if url.startswith("file://"):
            found.append(Path(unquote(url[len("file://"):])))
    except Exception:  # noqa: BLE001 - no such distribution, no such file: nothing more to hide
        pass
    return [p for p in found if (p / "pyproject.toml").is_file() and (p / "shardlib").is_dir()]


def checkout_entries() -> list[Path]:
    """Every entry of the course's checkouts (hideable() keeps what the kernel needs)."""
    entries = []
    for checkout in course_checkouts():
        try:
            entries += [entry for entry in checkout.iterdir() if not entry.is_symlink()]
        except OSError:
            pass
    return entries


@dataclass
class Sandbox:
    """The kernel's scratch folder, what it may not see, its limits; and its command and environment."""
    scratch: Path
    hidden: list[Path] = field(default_factory=list)
    memory_bytes: int = int(DEFAULT_MEMORY_GIB * 2 ** 30)
    processes: int = DEFAULT_PROCESSES
    bwrap: str | None = None
    workdir: Path | None = None  # the kernel's folder (default: scratch/work); without bubblewrap only

    @property
    def cwd(self) -> Path:
        return self.workdir or self.scratch / "work"

    def describe(self) -> str:
        limits = f"memory {self.memory_bytes / 2 ** 30:g} GiB, {self.processes} processes"
        if self.bwrap:
            return (f"bubblewrap: PID/network/IPC namespaces, no capabilities, read-only file system, "
                    f"{len(self.hidden)} paths hidden; {limits}")
        return (f"none: the learner's code runs as this user (uid {os.getuid()}) without a sandbox "
                f"(install bubblewrap to isolate it); {limits}, every process killed at the end")

    def command(self, kernel_argv: list[str]) -> list[str]:
        nproc = 0 if os.getuid() == 0 else self.processes + len(psutil.pids())  # RLIMIT_NPROC counts all of them
        nproc = min(nproc, _hard_nproc()) if nproc else 0
        prefix = [sys.executable, "-I", "-S", "-c", LAUNCHER, str(self.memory_bytes), str(nproc)]
        return prefix + (self._bwrap_args() if self.bwrap else []) + kernel_argv

    def _bwrap_args(self) -> list[str]:
        args = [self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                "--tmpfs", "/dev/shm"]
        for path in needed_under_fresh_folders():  # a course cloned into /tmp keeps its Python and shardlib
            args += ["--ro-bind", str(path), str(path)]
        for device in sorted(Path("/dev").glob("nvidia*")):  # GPUs stay usable
            args += ["--dev-bind", str(device), str(device)]
        for path in self.hidden:
            args += ["--tmpfs", str(path)] if path.is_dir() else ["--ro-bind", "/dev/null", str(path)]
        args += ["--bind", str(self.scratch), str(self.scratch), "--chdir", str(self.cwd),
                 "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--die-with-parent",
                 "--new-session", "--cap-drop", "ALL", "--"]
        return args

    def environment(self) -> dict:
        env = {key: value for key, value in os.environ.items() if key in ENV_KEPT or key.startswith(ENV_PREFIXES)}
        for name in ("home", "tmp", "work"):
            (self.scratch / name).mkdir(parents=True, exist_ok=True)
        env.update(HOME=str(self.scratch / "home"), TMPDIR=str(self.scratch / "tmp"), MPLBACKEND="Agg",
                   SHARDLIB_PLAIN_RESULTS="1",  # the ranks' results come back as plain data (shardlib.plain_pickle)
                   MPLCONFIGDIR=str(self.scratch / "home"), IPYTHONDIR=str(self.scratch / "home" / ".ipython"),
                   PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.setdefault("PATH", os.defpath)
        return env


def _hard_nproc() -> int:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    return hard if hard != resource.RLIM_INFINITY else 1 << 30


def check_isolation(isolation: str) -> None:
    if isolation == "bwrap" and bubblewrap() is None:
        raise GradeInputError("--isolation bwrap: bubblewrap is not installed or cannot make namespaces here "
                              "(Debian/Ubuntu: apt-get install bubblewrap)")


def make_sandbox(scratch: Path, hide=(), memory_gib: float = DEFAULT_MEMORY_GIB,
                 processes: int = DEFAULT_PROCESSES, isolation: str = "auto") -> Sandbox:
    """isolation: auto (bubblewrap where it works), bwrap (insist), none."""
    bwrap = bubblewrap() if isolation in ("auto", "bwrap") else None
    check_isolation(isolation)
    packaged = Path(__file__).resolve().parents[1] / "solutions"
    hidden = hideable([*hide, packaged, *checkout_entries(), *home_entries()], needed_paths()) if bwrap else []
    return Sandbox(scratch, [p for p in hidden if p != scratch and p not in scratch.parents],
                   int(memory_gib * 2 ** 30), processes, bwrap)


class ProcessTree:
    """The kernel's process and all its descendants, with the orphans the grader adopted since it started."""

    def __init__(self, root_pid: int, before: set[int]):
        self.root_pid, self.before = root_pid, before

    @staticmethod
    def children_now() -> set[int]:
        return {child.pid for child in psutil.Process().children()}

    def members(self) -> list[psutil.Process]:
        found = {}
        roots = [self.root_pid] + [pid for pid in self.children_now() if pid not in self.before]
        for pid in roots:
            try:
                process = psutil.Process(pid)
                for member in [process, *process.children(recursive=True)]:
                    found[member.pid] = member
            except psutil.Error:
                continue
        return list(found.values())

    def signal(self, number: int, skip_sandbox: bool = True) -> None:
        for process in self.members():
            try:
                if not (skip_sandbox and process.name() == "bwrap"):
                    process.send_signal(number)
            except psutil.Error:
                pass

    def kill(self, timeout: float = 10) -> None:
        """Stop every member (so none can fork), then kill them all and reap those that are the grader's."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while time.monotonic() < deadline:
            members = [m for m in self.members() if m.pid not in seen]
            if not members:
                break
            for member in members:
                seen.add(member.pid)
                try:
                    member.send_signal(signal.SIGSTOP)
                except psutil.Error:
                    pass
        everyone = self.members()
        for member in everyone:
            try:
                member.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(everyone, timeout=max(0.5, deadline - time.monotonic()))
        for pid in self.children_now() - self.before:  # adopted orphans that are zombies now
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


class Watch(threading.Thread):
    """Kills the tree when it holds more memory or more processes than allowed; says which."""

    def __init__(self, tree: ProcessTree, memory_bytes: int, processes: int):
        super().__init__(daemon=True)
        self.tree, self.memory_bytes, self.processes = tree, memory_bytes, processes
        self.reason = ""
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(WATCH_S) and not self.reason:
            members = self.tree.members()
            if len(members) > self.processes:
                self.reason = f"too many processes: more than {self.processes}"
            elif _total(members, "rss") > self.memory_bytes and _total(members, "pss") > self.memory_bytes:
                self.reason = (f"out of memory: the kernel and its processes held more than "
                               f"{self.memory_bytes / 2 ** 30:g} GiB")
            if self.reason:
                self.tree.kill()

    def stop(self):
        self.stopped.set()


def _total(members, kind: str) -> int:
    total = 0
    for member in members:
        try:
            info = member.memory_info() if kind == "rss" else member.memory_full_info()
            total += getattr(info, kind, info.rss)
        except psutil.Error:
            pass
    return total
