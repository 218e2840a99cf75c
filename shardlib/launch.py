"""A cluster on a laptop: run one function on N ranks and get every rank's result back.

`launch(fn, world_size)` starts `world_size` processes, joins them into one
torch.distributed process group, calls `fn(*args, **kwargs)` on each and returns the list
of return values, ordered by rank. Inside `fn` use the ordinary PyTorch calls:
`dist.get_rank()`, `dist.get_world_size()`, collectives, and `current_device()` for the
device to build tensors on.

Where the ranks compute (`device=`): "auto" (the default) gives one GPU per rank over NCCL
when there are enough GPUs, else CPU processes over gloo, and prints one line saying which
and why (once per process and reason; in a notebook, as shardlib is imported); "cuda" insists on GPUs and fails before any process
starts when there are too few; "cpu" always uses CPU processes. The calling process never
starts CUDA (shardlib/devices.py counts GPUs through NVML), so the forked ranks can.

The environment of each rank is exactly the one `torchrun` sets (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so the same `fn` runs unchanged under
`torchrun` (several nodes included) through `init_from_env()`:

    torchrun --nproc-per-node 2 -m shardlib.examples.ring_allreduce

Faults never hang the caller, and the rank blamed is the root cause:
- a rank that raises ends the launch within about a second, naming the rank and
  carrying its traceback; every other rank is ended;
- a rank that blocks (a collective that another rank never joins) ends when the
  process group's timeout, or the launch's, runs out, with an error saying so;
- a rank whose error only says that a peer closed or reset the connection is a
  consequence: a rank that died, raised or timed out is blamed first, whatever the clock;
- bad arguments fail before any process starts.

Processes are forked on Linux and macOS, so `fn` may be defined in a notebook cell.
A forked rank computes with one CPU thread: OpenMP's thread pool does not survive a
fork (pytorch/pytorch#17199), and one thread per rank is what a simulated cluster wants.
Windows has no fork: put `fn` in a .py module, import it, and call
`launch(fn, n, start_method="spawn")` from under `if __name__ == "__main__":`
(or run the course under WSL2, where everything works as on Linux).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from shardlib import plain_pickle
from shardlib.devices import DEVICES, DeviceChoice, DeviceUnavailable, resolve_device

__all__ = ["launch", "LaunchError", "RankError", "LaunchTimeout", "current_device", "init_from_env", "WholeLines",
           "announce_in_notebook"]


class LaunchError(RuntimeError):
    """A launched job failed: bad arguments, or a rank that died."""


class RankError(LaunchError):
    """A rank raised an exception; `.rank` names it and `.remote_traceback` holds its traceback."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed; its traceback follows.\n\n{remote_traceback}")


class LaunchTimeout(LaunchError, TimeoutError):
    """The job ran past its timeout; the ranks still running were ended."""


class _PortTaken(LaunchError):
    """Another program bound the rendezvous port between its choice and rank 0's bind: try another."""


# ---------------------------------------------------------------------------------
# the environment a rank sees (same as torchrun's)


def current_device() -> torch.device:
    """The device this rank computes on: cuda:LOCAL_RANK under NCCL, else cpu."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


_announced: set[str] = set()  # lines already printed by this process: each is said once


def _announce(line: str) -> None:
    if line not in _announced:
        _announced.add(line)
        sys.stdout.write(line + "\n")  # one write: a notebook could otherwise show the newline as an output of its own
        sys.stdout.flush()


def announce_in_notebook() -> None:
    """In a notebook kernel, print now the line launch(device="auto") prints for one rank on this machine.

    shardlib calls it when it is imported (a lesson's set-up cell), so that the line stands above all the
    lesson prints, not between a table's header and its rows in the first cell that launches. A later
    launch that chooses otherwise (more ranks than GPUs) still says so. Outside a kernel: nothing."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if getattr(shell, "kernel", None) is None:
        return
    try:
        _device_and_backend("auto", None, 1, forking=False, say="shardlib.launch")
    except LaunchError:
        pass  # launch() raises it, with what to change, when it is called


def _device_and_backend(device: str, backend: str | None, ranks: int, *, forking: bool, say: str) -> str:
    """The one rule of launch() and init_from_env(): the backend for `ranks` ranks per machine.

    cuda goes with NCCL, cpu with gloo; "auto" says what it chose and why, after the name `say`
    (nothing when it is empty).
    """
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl" and device == "cpu":
        raise ValueError("backend 'nccl' runs on CUDA only: pass device='cuda', or use backend='gloo' on CPU")
    if backend == "gloo" and device == "cuda":
        raise ValueError("backend 'gloo' means CPU ranks here: drop backend= (device='cuda' uses NCCL), "
                         "or pass device='cpu'")
    if backend == "gloo" and not dist.is_gloo_available():
        raise LaunchError("this PyTorch build has no gloo backend; install a standard torch wheel")
    requested = {"gloo": "cpu", "nccl": "cuda"}.get(backend, device)
    try:
        choice = resolve_device(requested, ranks, forking=forking)
    except DeviceUnavailable as error:
        raise LaunchError(str(error)) from None
    if choice.device == "cuda" and not dist.is_nccl_available():
        if requested == "cuda":
            raise LaunchError("device='cuda' needs NCCL and this PyTorch build has none; use device='cpu'")
        choice = DeviceChoice("cpu", "this PyTorch build has no NCCL")
    if requested == "auto" and say:
        how = "one GPU per rank over NCCL" if choice.device == "cuda" else "CPU ranks over gloo"
        _announce(f"{say}: {how}: {choice.reason}.")
    return "nccl" if choice.device == "cuda" else "gloo"


def _join_group(backend: str, timeout: float) -> None:
    """Join the group torchrun's variables describe; under NCCL, bind this rank to cuda:LOCAL_RANK first."""
    limit = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", timeout=limit, device_id=gpu)
    else:
        dist.init_process_group(backend, timeout=limit)


def init_from_env(backend: str | None = None, timeout: float = 300.0, *, device: str = "auto") -> None:
    """Join the process group described by torchrun's environment variables.

    Use it at the top of a script run by `torchrun` or `accelerate launch`; a function
    called by `launch()` finds the group already initialised. The device is chosen as
    launch() chooses it, per machine: "auto" is one GPU per local rank (NCCL) when the
    machine has enough, else CPU ranks (gloo), and rank 0 says which; `accelerate launch
    --cpu` means "cpu".
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise LaunchError(
            f"init_from_env() needs the variables torchrun sets; missing: {', '.join(missing)}. "
            "Start the script with `torchrun --nproc-per-node N script.py`, or call shardlib.launch(fn, N)."
        )
    if device not in DEVICES:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto" and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        device = "cpu"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    say = "shardlib.init_from_env" if os.environ["RANK"] == "0" else ""  # one rank speaks for all
    backend = _device_and_backend(device, backend, local_ranks, forking=False, say=say)
    _join_group(backend, timeout)


class _Channel:
    """The ranks' messages to the caller: pickled in the rank, sent whole over one pipe (a lock keeps two
    ranks' messages apart), read back by pickle.loads; by shardlib.plain_pickle.loads where the ranks' code
    cannot be trusted (SHARDLIB_PLAIN_RESULTS=1: the grader, which runs the learner's code)."""

    def __init__(self, context):
        self.reader, self.writer = context.Pipe(duplex=False)
        self.lock = context.Lock()
        self.loads = plain_pickle.loads if os.environ.get(plain_pickle.ENV) == "1" else pickle.loads

    def put(self, message) -> None:
        data = pickle.dumps(message)
        with self.lock:
            self.writer.send_bytes(data)

    def get(self, timeout: float = 0.0):
        if not self.reader.poll(timeout):
            raise queue.Empty
        return self.loads(self.reader.recv_bytes())

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


# ---------------------------------------------------------------------------------
# what runs in each child


class WholeLines:
    """A text stream that passes on whole lines to `send`: print() writes the text and its newline
    separately, and from a forked process each write reaches a notebook as an output of its own (a blank
    one after every line), or another rank's line lands in between. flush() passes on a partial line,
    e.g. a progress bar's frame. `WholeLines.around(sys.stdout)` wraps a stream."""

    def __init__(self, send: Callable[[str], object]):
        self.send, self.pending = send, ""

    @classmethod
    def around(cls, stream) -> "WholeLines":
        return cls(lambda text: (stream.write(text), stream.flush()))

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, _, self.pending = self.pending.rpartition("\n")
            self.send(lines + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.send(self.pending)
            self.pending = ""

    def isatty(self) -> bool:
        return False


class _ForwardedStream(WholeLines):
    """Stands in for sys.stdout/sys.stderr in a rank: sends what is written to the caller, whole lines."""

    def __init__(self, channel, rank: int, name: str):
        super().__init__(lambda text: channel.put(("out", rank, name, text)))


class _Failure(NamedTuple):
    time: float  # the rank's clock when it caught the exception
    traceback: str
    phase: str  # "join" (setting up the group) or "run" (inside fn)


def _rank_main(fn, args, kwargs, rank, world_size, port, backend, timeout, channel, start_method):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    sys.stdout = _ForwardedStream(channel, rank, "stdout")
    sys.stderr = _ForwardedStream(channel, rank, "stderr")
    # A forked child inherits the parent's OpenMP thread pool, which is not fork-safe:
    # once the parent has computed with several threads, a child using several hangs
    # (pytorch/pytorch#17199). One thread per forked rank is safe, and it is what a
    # simulated cluster wants anyway: each rank is one small device.
    torch.set_num_threads(1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // world_size))
    phase = "join"
    try:
        _join_group(backend, timeout)
        dist.barrier()  # gloo group creation does not synchronise: a fast rank could exit mid-connect
        phase = "run"
        result = fn(*args, **kwargs)
        payload = pickle.dumps(result)  # plain bytes: no shared-memory handles to outlive the rank
        _flush_output()  # before the result: the caller stops reading once it has every result
        channel.put(("ok", rank, payload))
    except BaseException:  # noqa: BLE001 - everything goes back to the caller
        caught_at = time.time()
        _flush_output()
        channel.put(("error", rank, _Failure(caught_at, traceback.format_exc(), phase)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _flush_output() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


# ---------------------------------------------------------------------------------
# the caller's side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_arguments(fn, world_size, device, timeout, start_method) -> str:
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    methods = mp.get_all_start_methods()
    start_method = start_method or ("fork" if "fork" in methods else "spawn")
    if start_method not in methods:
        raise LaunchError(
            f"start method {start_method!r} is not available here (available: {methods}). "
            "On Windows use start_method='spawn' with a function imported from a .py module."
        )
    return start_method


def _end(processes: Sequence[mp.Process]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(1.0)


class _OutputPrinter:
    """Prints forwarded rank output in the caller, each line prefixed by its rank."""

    def __init__(self, prefix: bool):
        self.prefix = prefix
        self.at_line_start: dict[tuple[int, str], bool] = {}

    def __call__(self, rank: int, name: str, text: str) -> None:
        stream = sys.stdout if name == "stdout" else sys.stderr
        if self.prefix:
            tag = f"[rank {rank}] "
            start = self.at_line_start.get((rank, name), True)
            text = (tag if start and not text.startswith("\r") else "") + text
            self.at_line_start[(rank, name)] = text.endswith("\n")
            text = text.replace("\n", "\n" + tag)
            if text.endswith("\n" + tag):
                text = text[: -len(tag)]
        stream.write(text)
        stream.flush()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    device: str = "auto",
    backend: str | None = None,
    timeout: float = 300.0,
    start_method: str | None = None,
    prefix_output: bool = True,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results.

    device: "auto" (one GPU per rank over NCCL when there are enough GPUs, else CPU
        processes over gloo; one printed line says which and why), "cuda" (GPUs or an
        error before any process starts), or "cpu".
    timeout: seconds; both the process group's collective timeout and the limit on
        the whole call. A job that runs past it is ended and LaunchTimeout raised
        (within a few seconds more: a rank's own timeout error is awaited first).
    start_method: "fork" (default where available) or "spawn".
    prefix_output: prefix each line a rank prints with "[rank r] ".
    """
    start_method = _check_arguments(fn, world_size, device, timeout, start_method)
    forking = start_method == "fork"
    backend = _device_and_backend(device, backend, world_size, forking=forking, say="shardlib.launch")
    if forking:
        _import_before_forking()
    job = (fn, tuple(args), dict(kwargs or {}), world_size, backend, timeout, start_method, prefix_output)
    for _ in range(_PORT_ATTEMPTS - 1):
        try:
            return _run(*job)
        except _PortTaken:  # another program took the port before rank 0 bound it: choose again
            continue
    return _run(*job)


def _import_before_forking() -> None:
    """Import once, in the caller, what every forked rank would otherwise import for itself: torch.optim and
    torch.profiler import torch._dynamo on first use, about 1.4 s per rank per launch on a 2-core machine
    (0.01 s once the caller holds it). The import starts no CUDA (tests/test_devices.py forks after it)."""
    import torch._dynamo  # noqa: F401


_PORT_ATTEMPTS = 3
_DEADLINE_GRACE_S = 3.0  # past `timeout`: ranks start late on a busy machine, and their own timeout error says more
_SETTLE_S = 0.5  # after a rank fails, how long its peers' failures take to arrive
_PATIENCE_S = 10.0  # how long to wait for a root cause when every failure so far is a lost connection


def _run(fn, args, kwargs, world_size, backend, timeout, start_method, prefix_output) -> list[Any]:
    """One attempt: start the ranks, collect their results, end them."""
    context = mp.get_context(start_method)
    channel = _Channel(context)
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(fn, args, kwargs, rank, world_size, port, backend, timeout, channel, start_method),
            name=f"shardlib-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    job = _Job(processes, channel, _OutputPrinter(prefix_output and world_size > 1))
    deadline = time.monotonic() + timeout + _DEADLINE_GRACE_S
    try:
        while len(job.results) < world_size:
            job.read(wait=0.05)
            if job.failures or job.exited_without_result():
                job.read(wait=0.2)  # what an exited rank sent before exiting is in the pipe by now
                error = job.diagnose() if job.failures or job.exited_without_result() else None
                if error is not None:
                    raise error
            elif time.monotonic() > deadline:
                job.read(wait=0.5)  # a rank's own timeout error, if it is on its way, says more
                found = job.diagnose() if job.failures or job.exited_without_result() else None
                raise found or LaunchTimeout(
                    f"the job ran past its timeout of {timeout:g} s; ranks still running: "
                    f"{[r for r in range(world_size) if r not in job.results]}. "
                    "A rank may be waiting in a collective or recv that another rank never joins; "
                    "raise `timeout=` if the work is simply long."
                )
    finally:
        _end(processes)
        channel.close()
    return [job.results[rank] for rank in range(world_size)]


class _Job:
    """The caller's view of running ranks: their results, their failures, their exit codes."""

    def __init__(self, processes, channel, printer):
        self.processes, self.channel, self.printer = processes, channel, printer
        self.results: dict[int, Any] = {}
        self.failures: dict[int, _Failure] = {}

    def read(self, wait: float) -> None:
        """Wait up to `wait` s for a message, then take every one already there: print, keep results and failures."""
        while True:
            try:
                message = self.channel.get(timeout=wait)
            except (queue.Empty, OSError, ValueError):
                return
            kind, rank = message[0], message[1]
            if kind == "out":
                self.printer(rank, message[2], message[3])
            elif kind == "ok":
                self.results[rank] = self.channel.loads(message[2])
            else:
                self.failures[rank] = message[2]
            wait = 0.0

    def exited_without_result(self) -> bool:
        return any(p.exitcode is not None and r not in self.results and r not in self.failures
                   for r, p in enumerate(self.processes))

    def diagnose(self) -> LaunchError | None:
        """After a failure: gather the evidence that proves a root cause, then name it.

        A lost connection only ever follows another rank's end, so while every failure seen is
        one, wait (up to _PATIENCE_S) until every rank has reported or exited.
        """
        started = time.monotonic()
        while True:
            self.read(wait=0.05)
            waited = time.monotonic() - started
            settled = all(r in self.results or r in self.failures or p.exitcode is not None
                          for r, p in enumerate(self.processes))
            decisive = self.exited_without_result() or any(
                _failure_kind(f) != _PEER_GONE for f in self.failures.values())
            if settled or (decisive and waited >= _SETTLE_S) or waited >= _PATIENCE_S:
                break
        self.read(wait=0.2)  # what the exited ranks sent before they exited
        return _root_cause(self.failures, [p.exitcode for p in self.processes], self.results)


# What a failure says about its cause, in the order root causes are looked for.
_DIED, _RAISED, _TIMED_OUT, _PEER_GONE = range(4)
_PEER_GONE_WORDS = re.compile(r"connection (closed|reset) by peer|broken pipe|socket closed|"
                              r"communicator was aborted|remote process exit|ncclRemoteError", re.IGNORECASE)
_TIMEOUT_WORDS = re.compile(r"timed out|timeout", re.IGNORECASE)
_PORT_TAKEN_WORDS = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


def _exception_line(failure: _Failure) -> str:
    lines = failure.traceback.strip().splitlines()
    return lines[-1] if lines else ""  # the exception, not the code lines quoted above it


def _failure_kind(failure: _Failure) -> int:
    line = _exception_line(failure)
    return _PEER_GONE if _PEER_GONE_WORDS.search(line) else _TIMED_OUT if _TIMEOUT_WORDS.search(line) else _RAISED


def _root_cause(failures: dict[int, _Failure], exitcodes: list[int | None], results: dict) -> LaunchError | None:
    """The error to raise for a failed job, or None when every exited rank left a result.

    Root causes, first to last: a rank that exited without a word (killed, crashed in native code),
    a rank that raised, a rank that timed out, and only then a rank that lost its connection to a
    peer. Among equals, the earlier failure (then the lower rank) is named.
    """
    silent = [r for r, code in enumerate(exitcodes) if code is not None and r not in failures and r not in results]
    if silent:
        rank, code = silent[0], exitcodes[silent[0]]
        after = f"; ranks {sorted(failures)} failed after it" if failures else ""
        return LaunchError(
            f"rank {rank} died without a Python error (exit code {code}"
            f"{', killed by signal ' + str(-code) if code < 0 else ''}){after}. "
            "It may have run out of memory, crashed in native code, or been killed."
        )
    if not failures:
        return None
    rank = min(failures, key=lambda r: (_failure_kind(failures[r]), failures[r].time, r))
    failure = failures[rank]
    if failure.phase == "join" and _PORT_TAKEN_WORDS.search(_exception_line(failure)):
        return _PortTaken(f"rank {rank} could not bind the rendezvous port: another program holds it")
    error = RankError(rank, failure.traceback)
    message = error.args[0]
    others = sorted(set(failures) - {rank})
    if others:
        message += f"\n(ranks {others} failed too, most likely because rank {rank} stopped.)"
    kind = _failure_kind(failure)
    if kind == _TIMED_OUT:
        message = ("rank {0} timed out in a collective or point-to-point call: a peer never joined it "
                   "(ranks calling different collectives, or a recv with no matching send). ").format(rank) + message
    elif kind == _PEER_GONE:
        message = (f"rank {rank} lost its connection to a peer, and no rank reported why within "
                   f"{_PATIENCE_S:g} s. ") + message
    error.args = (message,)
    return error
