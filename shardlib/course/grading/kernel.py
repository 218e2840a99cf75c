"""One kernel of this Python, started inside a Sandbox, that runs code and says how each run ended.

How a run ended comes from the kernel's execute_reply (its status, and the exception's name and
text), never from the outputs: outputs are only read for the last line a cell printed, and at most
OUTPUT_KEPT characters of them are kept, however much a cell prints. A run ends as

    ok | error          the reply's status
    timed out           no reply within the limit: the kernel and its processes got SIGINT, and the
                        reply came within INTERRUPT_GRACE_S
    unresponsive        no reply even INTERRUPT_GRACE_S after SIGINT (a cell that ignores it): the caller
                        kills the kernel
    died                the kernel's process ended (a crash, os._exit, killed for memory)
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from shardlib.course.grading.sandbox import ProcessTree, Sandbox, Watch
from shardlib.course.grading.stopping import raise_if_stopped

INTERRUPT_GRACE_S = 10
STARTUP_TIMEOUT_S = 120
OUTPUT_KEPT = 4096  # characters of a run's stdout kept (its end)
POLL_S = 0.1


@dataclass
class Run:
    status: str  # ok | error | timed out | unresponsive | died
    ename: str = ""
    evalue: str = ""
    stdout: str = ""  # its last OUTPUT_KEPT characters
    user_expressions: dict | None = None
    seconds: float = 0.0

    def last_line(self) -> str:
        lines = [line.strip() for line in self.stdout.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def _spec_manager(argv: list[str]):
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

    class SandboxedSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(argv=argv, display_name="graded", language="python", interrupt_mode="signal")

    return SandboxedSpecs()


class Kernel:
    """Use as a context manager: the kernel and every process it started are killed on exit."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.km = self.kc = self.tree = self.watch = None
        self.answered: set[str] = set()  # requests already replied to
        self.anomalies: list[str] = []  # replies the kernel should never send (a forged one, then the real one)

    def __enter__(self) -> "Kernel":
        from jupyter_client import KernelManager

        scratch = self.sandbox.scratch
        argv = self.sandbox.command([sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"])
        self.km = KernelManager(kernel_name="graded", kernel_spec_manager=_spec_manager(argv), transport="ipc",
                                ip=str(scratch / "kernel"), connection_file=str(scratch / "connection.json"))
        before = ProcessTree.children_now()
        env = self.sandbox.environment()
        self.km.start_kernel(cwd=str(self.sandbox.cwd), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.tree = ProcessTree(self.km.provisioner.process.pid, before)
        self.watch = Watch(self.tree, self.sandbox.memory_bytes, self.sandbox.processes)
        self.watch.start()
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=STARTUP_TIMEOUT_S)
        except RuntimeError as error:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the kernel did not start: {error}") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.kc is not None:
            self.kc.stop_channels()
        if self.tree is not None:
            self.tree.kill()
        if self.km is not None:
            try:
                self.km.cleanup_resources()
            except Exception:
                pass

    def alive(self) -> bool:
        return self.km.is_alive()

    def died_why(self) -> str:
        if self.watch.reason:
            return self.watch.reason
        code = self.km.provisioner.process.poll() if self.km.provisioner else None
        if code is not None and (code < 0 or code > 128):
            number = -code if code < 0 else code - 128
            name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
            return f"the kernel was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
        return f"the kernel exited (status {code}: os._exit, sys.exit in a thread, or a crash)"

    def run(self, code: str, timeout: float, silent: bool = False, user_expressions: dict | None = None) -> Run:
        """Execute `code`; wait at most `timeout` s for its reply (then SIGINT, and INTERRUPT_GRACE_S more)."""
        started = time.monotonic()
        msg_id = self.kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False,
                                 stop_on_error=False, user_expressions=user_expressions or {})
        run, deadline, interrupted = Run("ok"), started + timeout, False
        reply = None
        while reply is None:
            raise_if_stopped()  # a stop whose exception was dropped where the signal landed (stopping.py)
            if time.monotonic() > deadline:
                if interrupted:
                    run.status = "unresponsive"
                    break
                self.tree.signal(signal.SIGINT)  # the kernel and its ranks, as Ctrl-C in a terminal
                interrupted, deadline = True, time.monotonic() + INTERRUPT_GRACE_S
            self._drain_iopub(msg_id, run)
            try:
                message = self.kc.get_shell_msg(timeout=POLL_S)
            except queue.Empty:
                if not self.alive():
                    run.status = "died"
                    break
                continue
            parent = message.get("parent_header", {}).get("msg_id")
            if parent == msg_id:
                reply = message["content"]
                self.answered.add(msg_id)
            elif parent in self.answered:
                self.anomalies.append("a second reply to one request (one of them forged)")
        if reply is not None:
            self._drain_iopub(msg_id, run, settle=1.0)
            run.status = "timed out" if interrupted else ("ok" if reply.get("status") == "ok" else "error")
            run.ename, run.evalue = str(reply.get("ename", "")), str(reply.get("evalue", ""))[:100_000]
            run.user_expressions = reply.get("user_expressions") or {}
        run.seconds = time.monotonic() - started
        return run

    def _drain_iopub(self, msg_id: str, run: Run, settle: float = 0.0) -> None:
        """Read the output messages waiting; with settle, until the run's idle status (at most settle s)."""
        end = time.monotonic() + settle
        while True:
            try:
                message = self.kc.get_iopub_msg(timeout=0.05 if settle else 0)
            except queue.Empty:
                if time.monotonic() >= end:
                    return
                continue
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream" and content.get("name") == "stdout":
                run.stdout = (run.stdout + str(content.get("text", ""))[-OUTPUT_KEPT:])[-OUTPUT_KEPT:]
            elif kind == "status" and content.get("execution_state") == "idle" and settle:
                return
