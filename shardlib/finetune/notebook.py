"""Start the fine-tune from a notebook cell, on CPU ranks, one GPU or one GPU per rank, and read
how a launch failed.

    run_in_notebook(config, N)   checks everything it can first (data, model, batch split, GPU
                                 count, mixed precision), then starts N ranks and returns rank 0's
                                 summary. N >= 2: accelerate.notebook_launcher forks the ranks
                                 (PyTorch's elastic launcher). N = 1: shardlib.launch forks one
                                 rank, because notebook_launcher would run train() inside the
                                 kernel itself: CUDA would start there (no later fork could use
                                 it) and a killed rank would be the kernel.
    launch_failure(error)        what a failed launch reports, from its structured record.

The calling process never starts CUDA (GPUs are counted and described through NVML,
shardlib.devices), so the forked ranks can. Runs no collective itself.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

from shardlib.devices import DeviceUnavailable, resolve_device, visible_gpus
from shardlib.finetune.config import FinetuneConfig, resolve_mixed_precision
from shardlib.finetune.data import load_dataset
from shardlib.finetune.model import resolve_model_path


def check_before_launch(config: FinetuneConfig, world_size: int, device_type: str = "cpu") -> str:
    """Bad input fails here, in the caller, before any process starts. Returns the mixed precision
    the ranks will use ("no", "bf16" or "fp16"), decided from NVML's description of the GPUs."""
    config.check_world_size(world_size)
    load_dataset(config.data_dir)
    resolve_model_path(config.model_id, config.offline)
    if device_type != "cuda":
        return resolve_mixed_precision(config.mixed_precision, device_type)
    gpus = visible_gpus()[:world_size]
    oldest = min(gpus, key=lambda g: g.capability) if gpus else None  # every rank must support the format
    return resolve_mixed_precision(config.mixed_precision, "cuda", oldest.capability if oldest else None,
                                   f"{oldest.name} (cuda:{oldest.index})" if oldest else "this GPU")


def choose_device(device: str, num_processes: int) -> str:
    """"cpu" or "cuda" for `num_processes` forked ranks: device="cuda" with too few GPUs fails here,
    naming both counts; "auto" falls back to CPU ranks and says why."""
    try:
        choice = resolve_device(device, num_processes, forking=True)
    except DeviceUnavailable as error:
        raise ValueError(f"run_in_notebook(num_processes={num_processes}): {error}") from None
    if device == "auto":
        where = f"{num_processes} GPU(s), one per rank" if choice.device == "cuda" else "CPU ranks"
        print(f"device: {where}: {choice.reason}")
    return choice.device


def lesson_plan(device: str = "auto", num_processes: int | None = None) -> dict:
    """Where lesson 08 runs here, decided without starting CUDA (NVML): the main run's device and
    ranks, the (device, N) pairs of the memory table, another (device, N) to resume on, and a note.

    CPU: 2 ranks (or num_processes), memory table on 2 and 4, resume on 1. One GPU: the main run on
    it (one rank), the memory table on it and on 2 and 4 CPU ranks (sharding needs >= 2 ranks), resume
    on 2 CPU ranks. G >= 2 GPUs: one rank per GPU, memory table on 2 and G, resume on 1 GPU."""
    from shardlib.devices import why_no_gpu

    gpus = [] if device == "cpu" or why_no_gpu() else visible_gpus()
    if device == "cuda" and not gpus:
        raise ValueError(f"DEVICE='cuda' but no usable GPU here ({why_no_gpu() or 'none visible'}); "
                         "use DEVICE='auto' or 'cpu'")
    if gpus and num_processes and num_processes > len(gpus):
        if device == "cuda":
            raise ValueError(f"NUM_PROCESSES={num_processes} needs one GPU per rank and {len(gpus)} are visible; "
                             f"use NUM_PROCESSES <= {len(gpus)}, or DEVICE='cpu'")
        gpus = []  # "auto": CPU ranks, as shardlib.launch would choose
    if not gpus:
        return {"device": "cpu", "ranks": num_processes or 2, "measure": [("cpu", 2), ("cpu", 4)],
                "other": ("cpu", 1), "gpus": [], "note": "CPU processes over gloo"}
    ranks = num_processes or len(gpus)
    names = ", ".join(sorted({g.name for g in gpus}))
    if ranks == 1:
        return {"device": "cuda", "ranks": 1, "measure": [("cuda", 1), ("cpu", 2), ("cpu", 4)],
                "other": ("cpu", 2), "gpus": gpus,
                "note": f"one GPU ({names}): the main run on it, sharding shown on CPU ranks"}
    return {"device": "cuda", "ranks": ranks, "measure": [("cuda", n) for n in sorted({2, len(gpus)})],
            "other": ("cuda", 1), "gpus": gpus, "note": f"{len(gpus)} GPUs ({names}), one rank per GPU"}


def _free_port() -> int:
    with socket.socket() as s:  # other people may share this machine
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _quiet_launcher():
    """notebook_launcher without its banner (it names CUDA on a CPU machine) and without the elastic
    launcher's log lines: a failure reaches the caller as an exception, read with launch_failure."""
    import accelerate.launchers as launchers
    import torch.distributed.launcher.api  # noqa: F401 - creates the loggers silenced below

    names = [n for n in list(logging.root.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"))]
    loggers = [logging.getLogger(n) for n in names]
    levels = [logger.level for logger in loggers]

    def print_unless_banner(*args, **kwargs):
        if not (args and str(args[0]).startswith("Launching training on")):
            builtins.print(*args, **kwargs)

    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    launchers.print = print_unless_banner
    try:
        yield
    finally:
        del launchers.print
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# A collective that fails because a peer went away: a consequence of another rank's end, not a cause.
PEER_GONE = re.compile(r"connection (closed|reset) by peer|broken pipe|socket closed|remote process exit", re.IGNORECASE)
PEER_GRACE_S = 30.0  # the elastic launcher polls every 0.1 s: it ends this rank long before


def _ended_quietly(signum, frame):
    os._exit(128 + signum)  # ended by the launcher: no traceback, nothing to report


def rank_main(config: FinetuneConfig, fault=None) -> dict:
    """What each rank forked by notebook_launcher runs: train(), made to report the root cause.

    When a rank dies, the elastic launcher reports the first failed rank its 0.1 s poll finds, in
    rank order. A survivor whose collective failed on the lost connection ("Connection reset by
    peer") could exit first and be reported instead, and the launcher's SIGTERM could reach it
    while it formats its error (a traceback on the notebook's stderr). So a survivor that lost a
    peer waits to be ended (up to PEER_GRACE_S, then raises as before) and, when the launcher's
    SIGTERM comes, exits at once: the dead rank is the one reported, every time."""
    from shardlib.finetune.train import train
    from shardlib.launch import WholeLines

    signal.signal(signal.SIGTERM, _ended_quietly)
    sys.stdout, sys.stderr = WholeLines.around(sys.stdout), WholeLines.around(sys.stderr)  # no blank outputs
    try:
        return train(config, fault)  # the elastic launcher records an exception's message (errors.record)
    except Exception as error:  # noqa: BLE001 - only a lost peer waits; everything is raised
        if PEER_GONE.search(str(error)):
            time.sleep(PEER_GRACE_S)
        raise


def run_in_notebook(config: FinetuneConfig, num_processes: int, fault=None, timeout: float = 1800) -> dict:
    """Run train(config) on `num_processes` ranks from a notebook; return rank 0's summary.

    `fault`: a test hook (shardlib.finetune.faults.KillRank). `timeout` bounds the one-rank route
    (shardlib.launch); the elastic launcher ends every rank as soon as one fails."""
    from shardlib.finetune.train import train
    from shardlib.launch import launch

    device = choose_device(config.device, num_processes)
    mixed = check_before_launch(config, num_processes, device)
    config = dataclasses.replace(config, device=device)
    summary_path = Path(config.output_dir) / "summary.json"
    summary_path.unlink(missing_ok=True)
    on = f"{num_processes} " + {("cuda", True): "GPU", ("cuda", False): "GPUs", ("cpu", True): "CPU process",
                                 ("cpu", False): "CPU processes"}[device, num_processes == 1]
    if num_processes == 1:
        print(f"Launching training on {on} with shardlib.launch (mixed precision: {mixed})")
        return launch(train, 1, args=(config, fault), device=device, timeout=timeout, prefix_output=False)[0]
    from accelerate import notebook_launcher

    print(f"Launching training on {on} with accelerate.notebook_launcher (mixed precision: {mixed})")
    with _quiet_launcher():
        notebook_launcher(rank_main, (config, fault), num_processes=num_processes, use_port=str(_free_port()))
    return json.loads(summary_path.read_text())


def launch_failure(error: BaseException) -> dict:
    """{"error", "rank", "exitcode", "signal", "message"} of a failed launch, from its structured record
    (ChildFailedError.get_first_failure() for notebook_launcher and torchrun; shardlib.launch's errors).

    The elastic launcher polls its ranks every 0.1 s in rank order and reports the FIRST failed rank
    it finds. Under torchrun, when rank 1 is killed, rank 0's collective may fail on the broken
    connection before that poll, and rank 0 (exit code 1, "Connection reset by peer") is reported
    although it is a victim; run_in_notebook's ranks (rank_main) wait to be ended instead, so there
    the killed rank is reported."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from shardlib.launch import LaunchError, RankError

    if isinstance(error, ChildFailedError):
        rank, failure = error.get_first_failure()
        signal = failure.signal_name() if failure.exitcode < 0 else None
        return {"error": type(error).__name__, "rank": rank, "exitcode": failure.exitcode, "signal": signal,
                "message": _one_line(failure.message)}
    if isinstance(error, RankError):
        return {"error": type(error).__name__, "rank": error.rank, "exitcode": 1, "signal": None,
                "message": _one_line(error.remote_traceback.strip().splitlines()[-1])}
    if isinstance(error, LaunchError):  # shardlib.launch: "rank 0 died ... (exit code -9, killed by signal 9)"
        found = re.search(r"rank (\d+) died without a Python error \(exit code (-?\d+)", str(error))
        if found:
            code = int(found[2])
            return {"error": type(error).__name__, "rank": int(found[1]), "exitcode": code,
                    "signal": _signal_name(-code) if code < 0 else None, "message": _one_line(str(error))}
    return {"error": type(error).__name__, "rank": None, "exitcode": None, "signal": None,
            "message": _one_line(str(error))}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _one_line(text) -> str:
    """The message alone (an error file's record also holds the call stack), on one line."""
    text = text.get("message", "") if isinstance(text, dict) else str(text)
    return " ".join(text.split())[:300]
