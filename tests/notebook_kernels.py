"""The notebooks' kernels for nbval: started with their stderr kept, and started afresh once when one does not answer.

nbval starts each notebook's kernel with its stderr thrown away and waits `--nbval-kernel-startup-timeout`
seconds for its first reply; a kernel that is running but never answers then fails every cell of its notebook
and says nothing of why. Here a kernel that does not answer within FIRST_TRY_S is examined before it is
stopped (its process state and CPU time; the Python stack of every thread, dumped by faulthandler on
SIGABRT; the end of its stderr) and a fresh kernel gets the full timeout. What was found is issued as a
warning, so the run's summary shows it; if the fresh kernel does not answer either, the error carries both
reports. Only the kernel's start is tried twice: no cell ever runs twice.

Each pytest worker's kernels get their own IPython folder (history, profile), so the workers' kernels never
share one history database, and the tests leave nothing in the user's ~/.ipython.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import tempfile
import time
import warnings
from pathlib import Path

FIRST_TRY_S = 120  # a kernel answers in about a second on a quiet machine, in tens of seconds on a loaded one
STDERR_TAIL = 4000  # characters of a kernel's stderr (its thread stacks included) that a report keeps


@functools.cache
def kernels_folder() -> Path:
    """This process's folder for its kernels' stderr files and IPython folder (removed when it exits)."""
    folder = Path(tempfile.mkdtemp(prefix="nbval-kernels-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def start_kernel(startup_timeout: float = 60, kernel_name: str = "python", spec_manager=None, **kwargs):
    """nbval.kernel.start_new_kernel's contract (returns a started KernelManager and its ready client),
    with one fresh start when the first kernel does not answer within FIRST_TRY_S (or startup_timeout,
    if shorter)."""
    first = min(FIRST_TRY_S, startup_timeout)
    try:
        return _start_once(first, kernel_name, spec_manager, kwargs)
    except KernelDidNotAnswer as error:
        warnings.warn(f"a notebook's kernel did not answer within {first:g} s; a fresh kernel was started. "
                      f"What the first one was doing:\n{error.report}", RuntimeWarning, stacklevel=2)
        try:
            return _start_once(startup_timeout, kernel_name, spec_manager, kwargs)
        except KernelDidNotAnswer as again:
            raise RuntimeError(f"two kernels in a row did not answer (within {first:g} s, then {startup_timeout:g} s)."
                               f"\nThe first:\n{error.report}\nThe second:\n{again.report}") from None


class KernelDidNotAnswer(RuntimeError):
    def __init__(self, report: str):
        super().__init__(report)
        self.report = report


def _start_once(timeout: float, kernel_name: str, spec_manager, kwargs: dict):
    from jupyter_client.manager import KernelManager
    from nbval.kernel import NbvalKernelspecManager

    folder = kernels_folder()
    stderr_path = Path(tempfile.mkstemp(prefix="kernel-", suffix=".stderr", dir=folder)[1])
    env = {**kwargs.get("env", os.environ), "PYTHONFAULTHANDLER": "1",  # SIGABRT dumps every thread's stack
           "IPYTHONDIR": str(folder / "ipython")}
    options = {key: value for key, value in kwargs.items() if key not in ("env", "stderr")}  # both tries get them whole
    km = KernelManager(kernel_name=kernel_name, kernel_spec_manager=spec_manager or NbvalKernelspecManager())
    with open(stderr_path, "w") as stderr:
        km.start_kernel(env=env, stderr=stderr, **options)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=timeout)
    except RuntimeError as error:
        report = _examine(km, stderr_path, str(error))
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        raise KernelDidNotAnswer(report) from None
    return km, kc


def _examine(km, stderr_path: Path, why: str) -> str:
    """The kernel's process state and CPU time, then the end of its stderr after SIGABRT made it dump its stacks."""
    import psutil

    process = km.provisioner.process if km.provisioner else None
    lines = [why]
    if process is not None and process.poll() is None:
        try:
            p = psutil.Process(process.pid)
            times = p.cpu_times()
            lines.append(f"process {p.pid}: {p.status()}, {p.num_threads()} threads, "
                         f"CPU {times.user:.1f} s user + {times.system:.1f} s system, "
                         f"running {time.time() - p.create_time():.0f} s")
            os.kill(p.pid, signal.SIGABRT)
            p.wait(timeout=10)
        except (psutil.Error, OSError) as error:
            lines.append(f"could not examine the process: {error!r}")
    elif process is not None:
        lines.append(f"process {process.pid} exited with status {process.poll()}")
    text = stderr_path.read_text(errors="replace")
    lines.append(f"its stderr{' (end)' if len(text) > STDERR_TAIL else ''}:\n{text[-STDERR_TAIL:] or '(empty)'}")
    return "\n".join(lines)


def install() -> None:
    """Make nbval start its kernels here (nbval's RunningKernel looks start_new_kernel up in its module)."""
    import nbval.kernel

    nbval.kernel.start_new_kernel = start_kernel
