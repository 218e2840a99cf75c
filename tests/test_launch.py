"""shardlib.launch: results come back in rank order, output reaches the caller, faults never hang.

Every fault test bounds its wall time well below the launch's own timeout, so a launcher
that waited for the timeout instead of noticing the fault fails the test.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardlib
from shardlib import LaunchError, LaunchTimeout, RankError, launch

REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------
# functions run on the ranks (module level: fork does not need it, spawn would)


def rank_and_size():
    return dist.get_rank(), dist.get_world_size()


def finish_in_reverse_rank_order():
    """Rank 0 finishes last, so results arriving in finishing order would come back reversed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    time.sleep(0.15 * (n - 1 - rank))
    return rank


def echo_arguments(a, b, *, scale=1, label="none"):
    return dist.get_rank(), (a + b) * scale, label


def sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def talk():
    rank = dist.get_rank()
    print(f"hello from {rank}")
    print(f"first line {rank}\nsecond line {rank}")
    print(f"to stderr {rank}", file=sys.stderr)
    return rank


def chatter():
    rank = dist.get_rank()
    for i in range(100):
        print(f"rank {rank} says line {i}")
    return rank


def last_words_without_newline():
    if dist.get_rank() == 1:
        print("no newline at the end", end="")


def raise_on_rank_1_while_others_wait():
    if dist.get_rank() == 1:
        time.sleep(0.2)
        raise ValueError("rank 1 gives up on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 1 never joins: the others wait here
    return t.item()


def everyone_receives_nobody_sends():
    t = torch.empty(1)
    peer = (dist.get_rank() + 1) % dist.get_world_size()
    dist.recv(t, peer)  # both ranks wait for a message that never comes
    return t.item()


def sleep_for(seconds):
    time.sleep(seconds)
    return dist.get_rank()


def rank_1_exits_without_error():
    if dist.get_rank() == 1:
        time.sleep(0.2)
        os._exit(3)
    dist.barrier()  # rank 0 waits for a rank that is gone
    return 0


# ---------------------------------------------------------------------------------
# results and arguments


def test_results_are_ordered_by_rank():
    assert launch(finish_in_reverse_rank_order, 3) == [0, 1, 2]


def test_ranks_see_torchrun_environment_and_a_working_group():
    assert launch(rank_and_size, 3) == [(0, 3), (1, 3), (2, 3)]
    assert launch(sum_of_ranks, 4) == [6.0] * 4  # 0+1+2+3 on every rank


def test_args_and_kwargs_reach_every_rank():
    results = launch(echo_arguments, 2, args=(3, 4), kwargs={"scale": 10, "label": "x"})
    assert results == [(0, 70, "x"), (1, 70, "x")]
    assert launch(echo_arguments, 1, args=(1, 1)) == [(0, 2, "none")]


def test_can_be_called_many_times_in_one_process():
    for world_size in (1, 2, 3, 2, 1, 2):
        assert launch(rank_and_size, world_size) == [(r, world_size) for r in range(world_size)]
    assert not dist.is_initialized(), "the caller must not join the ranks' process group"
    assert multiprocessing.active_children() == [], "every rank process is ended and joined"


def test_child_output_reaches_the_caller_prefixed(capsys):
    launch(talk, 2)
    out, err = capsys.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] hello from {rank}\n" in out
        assert f"[rank {rank}] first line {rank}\n" in out  # each line of a multi-line print is prefixed
        assert f"[rank {rank}] second line {rank}\n" in out
        assert f"[rank {rank}] to stderr {rank}\n" in err
    assert "to stderr" not in out


def test_lines_of_different_ranks_never_mix(capsys):
    launch(chatter, 4)
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 4 * 100
    for rank in range(4):
        assert [line for line in lines if line.startswith(f"[rank {rank}] ")] == [
            f"[rank {rank}] rank {rank} says line {i}" for i in range(100)], out


def test_a_last_line_without_newline_still_arrives(capsys):
    launch(last_words_without_newline, 2)
    out, _ = capsys.readouterr()
    assert out == "[rank 1] no newline at the end"


def test_output_is_not_prefixed_for_one_rank_or_when_asked(capsys):
    launch(talk, 1)
    out, _ = capsys.readouterr()
    assert "hello from 0\n" in out and "[rank" not in out
    launch(talk, 2, prefix_output=False)
    out, _ = capsys.readouterr()
    assert "hello from 1\n" in out and "[rank" not in out


# ---------------------------------------------------------------------------------
# faults


def test_a_raising_rank_is_named_with_its_traceback_while_others_wait_in_a_collective():
    started = time.monotonic()
    with pytest.raises(RankError) as caught:
        launch(raise_on_rank_1_while_others_wait, 3, timeout=60)
    elapsed = time.monotonic() - started
    assert caught.value.rank == 1
    assert "rank 1 failed" in str(caught.value)
    assert "ValueError: rank 1 gives up on purpose" in caught.value.remote_traceback
    assert "raise_on_rank_1_while_others_wait" in caught.value.remote_traceback  # a real traceback
    assert elapsed < 15, f"took {elapsed:.1f} s: the launcher waited instead of ending the job"
    assert multiprocessing.active_children() == [], "the waiting ranks were not ended"


def test_a_rank_blocked_in_recv_ends_in_an_error_soon_after_the_timeout():
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(everyone_receives_nobody_sends, 2, timeout=3)
    elapsed = time.monotonic() - started
    message = str(caught.value)  # the group's timeout fired in recv, or the launch's own
    assert "timed out in a collective or point-to-point call" in message or "timeout of 3 s" in message, message
    assert elapsed < 3 + 8, f"took {elapsed:.1f} s for a 3 s timeout"
    assert multiprocessing.active_children() == []


def test_a_job_longer_than_its_timeout_raises_launch_timeout():
    started = time.monotonic()
    with pytest.raises(LaunchTimeout, match="timeout of 1 s"):
        launch(sleep_for, 2, args=(60,), timeout=1)
    assert time.monotonic() - started < 1 + 8
    assert multiprocessing.active_children() == []


def test_a_rank_that_exits_without_an_error_is_named():
    with pytest.raises(LaunchError) as caught:
        launch(rank_1_exits_without_error, 2, timeout=60)
    message = str(caught.value)
    assert "rank 1 died" in message and "exit code 3" in message, message
    assert not isinstance(caught.value, RankError) or caught.value.rank == 1


# ---------------------------------------------------------------------------------
# bad arguments fail before any process starts


@pytest.fixture
def no_process_may_start(monkeypatch):
    def refuse(self):
        raise AssertionError("a rank process was started before the arguments were checked")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.mark.parametrize("world_size", [0, -2, 2.0, "2", True, None])
def test_bad_world_size_is_rejected_before_starting(no_process_may_start, world_size):
    with pytest.raises(ValueError, match="world_size"):
        launch(rank_and_size, world_size)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"device": "tpu"}, ValueError, "device must be 'cpu' or 'cuda'"),
    ({"backend": "mpi"}, ValueError, "unknown backend 'mpi'"),
    ({"backend": "nccl"}, ValueError, "nccl' runs on CUDA only"),
    ({"timeout": 0}, ValueError, "timeout must be positive"),
    ({"start_method": "teleport"}, LaunchError, "start method 'teleport' is not available"),
])
def test_bad_options_are_rejected_before_starting(no_process_may_start, kwargs, error, words):
    with pytest.raises(error, match=words):
        launch(rank_and_size, 2, **kwargs)


def test_cuda_without_gpus_is_rejected_before_starting(no_process_may_start, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LaunchError, match="needs CUDA GPUs"):
        launch(rank_and_size, 2, device="cuda")


def test_more_ranks_than_gpus_is_rejected_before_starting(no_process_may_start, monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(LaunchError, match="world_size=2 needs one GPU per rank but 1 are visible"):
        launch(rank_and_size, 2, device="cuda")


def test_not_a_function_is_rejected_before_starting(no_process_may_start):
    with pytest.raises(TypeError, match="needs a function"):
        launch("rank_and_size", 2)


def test_init_from_env_outside_a_launcher_says_how_to_start(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="torchrun --nproc-per-node"):
        shardlib.init_from_env()


# ---------------------------------------------------------------------------------
# the same function under PyTorch's own launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_example_runs_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    command += ["--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "shardlib.examples.ring_allreduce"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 ranks" in done.stdout
    assert done.stdout.count("   ok") == 2 and "MISMATCH" not in done.stdout, done.stdout


def test_example_runs_with_shardlib_launch(capsys):
    from shardlib.examples import ring_allreduce

    assert ring_allreduce.main(["--world-size", "3", "--numel", "10"]) == 0
    out, _ = capsys.readouterr()
    # 10 elements on 3 ranks: chunks of 4, 2(N-1) = 4 messages of 16 bytes each
    assert out.count("sent 64 bytes") == 3 and "MISMATCH" not in out, out
