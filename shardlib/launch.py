"""A cluster on a laptop: run one function on N ranks and get every rank's result back.

`launch(fn, world_size)` starts `world_size` processes, joins them into one
torch.distributed process group (gloo on CPU, NCCL on CUDA with one GPU per rank),
calls `fn(*args, **kwargs)` on each and returns the list of return values, ordered
by rank. Inside `fn` use the ordinary PyTorch calls: `dist.get_rank()`,
`dist.get_world_size()`, collectives, and `current_device()` for the tensor device.

The environment of each rank is exactly the one `torchrun` sets (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so the same `fn` runs unchanged under
`torchrun` (several nodes included) through `init_from_env()`:

    torchrun --nproc-per-node 2 -m shardlib.examples.ring_allreduce

Faults never hang the caller:
- a rank that raises ends the launch within about a second, naming the rank and
  carrying its traceback; every other rank is ended;
- a rank that blocks (a collective that another rank never joins) ends when the
  process group's timeout, or the launch's, runs out, with an error saying so;
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
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["launch", "LaunchError", "RankError", "LaunchTimeout", "current_device", "init_from_env"]


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


# ---------------------------------------------------------------------------------
# the environment a rank sees (same as torchrun's)


def current_device() -> torch.device:
    """The device this rank computes on: cuda:LOCAL_RANK under NCCL, else cpu."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_from_env(backend: str | None = None, timeout: float = 300.0) -> None:
    """Join the process group described by torchrun's environment variables.

    Use it at the top of a script run by `torchrun` or `accelerate launch`; a function
    called by `launch()` finds the group already initialised.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise LaunchError(
            f"init_from_env() needs the variables torchrun sets; missing: {', '.join(missing)}. "
            "Start the script with `torchrun --nproc-per-node N script.py`, or call shardlib.launch(fn, N)."
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


# ---------------------------------------------------------------------------------
# what runs in each child


class _ForwardedStream:
    """Stands in for sys.stdout/sys.stderr in a rank: sends what is written to the caller.

    Whole lines are sent (print writes the text and its newline separately, and another rank's
    line must not land in between); flush() sends a partial line, e.g. a progress bar's.
    """

    def __init__(self, channel, rank: int, name: str):
        self.channel, self.rank, self.name = channel, rank, name
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, _, self.pending = self.pending.rpartition("\n")
            self.channel.put(("out", self.rank, self.name, lines + "\n"))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.channel.put(("out", self.rank, self.name, self.pending))
            self.pending = ""

    def isatty(self) -> bool:
        return False


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
    try:
        init_from_env(backend, timeout)
        dist.barrier()  # gloo group creation does not synchronise: a fast rank could exit mid-connect
        result = fn(*args, **kwargs)
        payload = pickle.dumps(result)  # plain bytes: no shared-memory handles to outlive the rank
        _flush_output()  # before the result: the caller stops reading once it has every result
        channel.put(("ok", rank, payload))
    except BaseException:  # noqa: BLE001 - everything goes back to the caller
        _flush_output()
        channel.put(("error", rank, (time.time(), traceback.format_exc())))
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


def _check_arguments(fn, world_size, device, backend, start_method) -> tuple[str, str]:
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "gloo" and not dist.is_gloo_available():
        raise LaunchError("this PyTorch build has no gloo backend; install a standard torch wheel")
    if backend == "nccl":
        if device != "cuda":
            raise ValueError("backend 'nccl' runs on CUDA only: pass device='cuda', or use backend='gloo' on CPU")
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise LaunchError("backend 'nccl' needs CUDA GPUs and an NCCL build of torch; on CPU use device='cpu' (gloo)")
        if torch.cuda.device_count() < world_size:
            raise LaunchError(
                f"world_size={world_size} needs one GPU per rank but {torch.cuda.device_count()} are visible; "
                f"lower world_size to {torch.cuda.device_count()} or use device='cpu'"
            )
    elif backend != "gloo":
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    methods = mp.get_all_start_methods()
    start_method = start_method or ("fork" if "fork" in methods else "spawn")
    if start_method not in methods:
        raise LaunchError(
            f"start method {start_method!r} is not available here (available: {methods}). "
            "On Windows use start_method='spawn' with a function imported from a .py module."
        )
    if start_method == "fork" and device == "cuda" and torch.cuda.is_initialized():
        raise LaunchError(
            "CUDA is already initialised in this process, and forked ranks cannot use it. "
            "Restart the kernel and call launch() before any CUDA work in the notebook, "
            "or use start_method='spawn' with a function imported from a .py module."
        )
    return backend, start_method


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
    device: str = "cpu",
    backend: str | None = None,
    timeout: float = 300.0,
    start_method: str | None = None,
    prefix_output: bool = True,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results.

    device: "cpu" (processes over gloo) or "cuda" (NCCL, one GPU per rank).
    timeout: seconds; both the process group's collective timeout and the limit on
        the whole call. A job that runs past it is ended and LaunchTimeout raised.
    start_method: "fork" (default where available) or "spawn".
    prefix_output: prefix each line a rank prints with "[rank r] ".
    """
    backend, start_method = _check_arguments(fn, world_size, device, backend, start_method)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    context = mp.get_context(start_method)
    channel = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(fn, tuple(args), dict(kwargs or {}), rank, world_size, port, backend, timeout, channel, start_method),
            name=f"shardlib-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    printer = _OutputPrinter(prefix_output and world_size > 1)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout + 1.0  # a little past the group timeout, so its error wins
    try:
        while len(results) < world_size:
            try:
                message = channel.get(timeout=0.05)
            except queue.Empty:
                message = None
            if message is not None:
                kind, rank = message[0], message[1]
                if kind == "out":
                    printer(rank, message[2], message[3])
                elif kind == "ok":
                    results[rank] = pickle.loads(message[2])
                else:
                    raise _first_failure({rank: message[2]}, channel, printer, processes, results)
                continue
            for rank, p in enumerate(processes):
                if rank not in results and not p.is_alive() and p.exitcode is not None:
                    failures = _drain_output(channel, printer, results)
                    if failures:
                        raise _first_failure(failures, channel, printer, processes, results)
                    if rank in results:
                        continue
                    raise LaunchError(
                        f"rank {rank} died without a Python error (exit code {p.exitcode}"
                        f"{', killed by signal ' + str(-p.exitcode) if p.exitcode < 0 else ''}); "
                        "it may have run out of memory or crashed in native code"
                    )
            if time.monotonic() > deadline:
                running = [r for r in range(world_size) if r not in results]
                raise LaunchTimeout(
                    f"the job ran past its timeout of {timeout:g} s; ranks still running: {running}. "
                    "A rank may be waiting in a collective or recv that another rank never joins; "
                    "raise `timeout=` if the work is simply long."
                )
    finally:
        _end(processes)
        channel.close()
    return [results[rank] for rank in range(world_size)]


def _drain_output(channel, printer, results: dict | None = None, wait: float = 0.2) -> dict:
    """Print what ranks wrote before they stopped; keep late results; return failures seen."""
    failures = {}
    while True:
        try:
            message = channel.get(timeout=wait)
        except (queue.Empty, OSError, ValueError):
            return failures
        if message[0] == "out":
            printer(message[1], message[2], message[3])
        elif message[0] == "ok" and results is not None:
            results[message[1]] = pickle.loads(message[2])
        elif message[0] == "error":
            failures[message[1]] = message[2]


_TIMEOUT_MARKERS = ("timed out", "Timed out", "timeout", "Timeout")


def _first_failure(failures: dict, channel, printer, processes, results) -> LaunchError:
    """When one rank fails, its peers soon fail too (connection closed); blame the first."""
    failures.update(_drain_output(channel, printer, results, wait=0.5))
    for rank, p in enumerate(processes):
        silent_death = rank not in failures and rank not in results and p.exitcode not in (None, 0)
        if silent_death:  # died in native code or was killed: the likeliest cause of the rest
            return LaunchError(
                f"rank {rank} died without a Python error (exit code {p.exitcode}); "
                f"ranks {sorted(failures)} failed after it. It may have run out of memory or been killed."
            )
    rank = min(failures, key=lambda r: failures[r][0])
    error = RankError(rank, failures[rank][1])
    others = sorted(set(failures) - {rank})
    if others:
        error.args = (error.args[0] + f"\n(ranks {others} failed after it, most likely because rank {rank} stopped.)",)
    exception_line = failures[rank][1].strip().splitlines()[-1]  # not the code lines quoted above it
    if any(m in exception_line for m in _TIMEOUT_MARKERS):
        error.args = (
            f"rank {rank} timed out in a collective or point-to-point call: a peer never joined it "
            "(ranks calling different collectives, or a recv with no matching send). "
            + error.args[0],
        )
    return error
