"""shardlib.launch: results come back in rank order, output reaches the caller, faults never hang.

Every fault test bounds its wall time well below the launch's own timeout, so a launcher
that waited for the timeout instead of noticing the fault fails the test.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardlib
from shardlib import LaunchError, LaunchTimeout, RankError, devices, launch

launch_module = sys.modules["shardlib.launch"]  # `shardlib.launch` the attribute is the function

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


def rank_1_is_killed():
    if dist.get_rank() == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    dist.barrier()  # rank 0 loses its connection to rank 1
    return 0


def a_lost_connection_reported_before_its_cause():
    """Rank 0 reports a lost connection at once; the cause, rank 1's error, comes a second later."""
    if dist.get_rank() == 0:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    time.sleep(1.5)
    raise ValueError("rank 1 is the root cause")


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
    launch(last_words_without_newline, 2, device="cpu")
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


@pytest.mark.slow
def test_a_rank_blocked_in_recv_ends_in_an_error_soon_after_the_timeout():
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(everyone_receives_nobody_sends, 2, timeout=3)
    elapsed = time.monotonic() - started
    message = str(caught.value)  # the group's timeout fired in recv, or the launch's own
    assert "timed out in a collective or point-to-point call" in message or "timeout of 3 s" in message, message
    assert elapsed < 3 + 8, f"took {elapsed:.1f} s for a 3 s timeout"
    assert multiprocessing.active_children() == []


@pytest.mark.slow
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


def test_a_killed_rank_is_named_not_the_peer_that_lost_its_connection():
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(rank_1_is_killed, 2, timeout=60)
    message = str(caught.value)
    assert "rank 1 died" in message and "killed by signal 9" in message, message
    assert time.monotonic() - started < 20, "the launcher waited for the timeout instead of noticing the death"
    assert multiprocessing.active_children() == []


def test_a_lost_connection_is_never_blamed_while_its_cause_is_on_the_way():
    with pytest.raises(RankError) as caught:
        launch(a_lost_connection_reported_before_its_cause, 2, timeout=60)
    assert caught.value.rank == 1, str(caught.value)
    assert "ValueError: rank 1 is the root cause" in caught.value.remote_traceback
    assert "ranks [0] failed too" in str(caught.value)
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------------------------
# the root cause, decided from the evidence and never from the clock alone

GLOO_TIMEOUT = ("RuntimeError: [third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 3000ms for recv operation to complete")
GLOO_CLOSED = "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41000"
GLOO_RESET = "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:41000: Connection reset by peer"
PORT_TAKEN = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
              "address. port: 41000, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


def failure(at: float, exception_line: str, phase: str = "run"):
    return launch_module._Failure(at, f'Traceback (most recent call last):\n  File "x.py", line 1\n{exception_line}\n', phase)


def test_the_flake_case_a_timeout_outranks_an_earlier_lost_connection():
    # rank 1 timed out in recv and gloo closed its connection; rank 0's recv then failed, with an earlier clock
    error = launch_module._root_cause({0: failure(100.0, GLOO_CLOSED), 1: failure(100.2, GLOO_TIMEOUT)},
                                      [0, 0], {})
    assert isinstance(error, RankError) and error.rank == 1, str(error)
    assert "timed out in a collective or point-to-point call" in str(error)


@pytest.mark.parametrize("failures, exitcodes, blamed, words", [
    # a rank that died without a word outranks the peer that lost its connection to it
    ({0: failure(1.0, GLOO_RESET)}, [0, -9], None, "rank 1 died without a Python error (exit code -9, killed by signal 9)"),
    # an error raised outranks a timeout, even an earlier one (the timeout waited for the raiser)
    ({0: failure(2.0, "ValueError: bad shape"), 1: failure(1.0, GLOO_TIMEOUT)}, [0, 0], 0, "ValueError: bad shape"),
    # ... and a lost connection, even an earlier one
    ({0: failure(1.0, GLOO_RESET), 1: failure(2.0, "ValueError: late")}, [0, 0], 1, "ValueError: late"),
    # among equals the earlier failure, then the lower rank
    ({0: failure(2.0, "KeyError: 'a'"), 1: failure(1.0, "KeyError: 'b'")}, [0, 0], 1, "KeyError: 'b'"),
    ({0: failure(1.0, "KeyError: 'a'"), 1: failure(1.0, "KeyError: 'b'")}, [0, 0], 0, "KeyError: 'a'"),
    # nothing but lost connections (the patience ran out): say so
    ({0: failure(1.0, GLOO_CLOSED), 1: failure(2.0, GLOO_RESET)}, [0, 0], 0, "lost its connection to a peer"),
])
def test_root_cause_order(failures, exitcodes, blamed, words):
    error = launch_module._root_cause(failures, exitcodes, {})
    assert words in str(error), str(error)
    if blamed is None:
        assert not isinstance(error, RankError), str(error)
    else:
        assert isinstance(error, RankError) and error.rank == blamed, str(error)


def test_no_root_cause_when_every_exited_rank_left_its_result():
    assert launch_module._root_cause({}, [0, None], {0: "done"}) is None


def test_a_taken_port_while_joining_is_retried_not_reported():
    error = launch_module._root_cause({0: failure(1.0, PORT_TAKEN, phase="join")}, [0, None], {})
    assert isinstance(error, launch_module._PortTaken), str(error)
    error = launch_module._root_cause({0: failure(1.0, PORT_TAKEN, phase="run")}, [0, None], {})
    assert isinstance(error, RankError), "inside fn the same words are the user's own error"


def test_launch_chooses_another_port_when_the_first_is_taken(monkeypatch):
    with socket.socket(socket.AF_INET6) as taken:  # a wildcard listener: rank 0 cannot bind this port
        taken.bind(("::", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real_free_port = launch_module._free_port

        def taken_first():
            port = ports.pop(0) if ports else real_free_port()
            chosen.append(port)
            return port

        chosen = []
        monkeypatch.setattr(launch_module, "_free_port", taken_first)
        assert launch(rank_and_size, 2, device="cpu", timeout=60) == [(0, 2), (1, 2)]
        taken_port = taken.getsockname()[1]
    assert len(chosen) == 2 and chosen[0] == taken_port != chosen[1], f"ports tried: {chosen}"
    assert multiprocessing.active_children() == []


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
    ({"device": "tpu"}, ValueError, "device must be 'auto', 'cpu' or 'cuda'"),
    ({"backend": "mpi"}, ValueError, "unknown backend 'mpi'"),
    ({"backend": "nccl", "device": "cpu"}, ValueError, "nccl' runs on CUDA only"),
    ({"backend": "gloo", "device": "cuda"}, ValueError, "backend 'gloo' means CPU ranks"),
    ({"timeout": 0}, ValueError, "timeout must be positive"),
    ({"start_method": "teleport"}, LaunchError, "start method 'teleport' is not available"),
])
def test_bad_options_are_rejected_before_starting(no_process_may_start, kwargs, error, words):
    with pytest.raises(error, match=words):
        launch(rank_and_size, 2, **kwargs)


def fake_gpus(monkeypatch, count: int, capability=(8, 0)):
    """Make this process see `count` NVIDIA GPUs (NVML answers faked; CUDA itself is never asked)."""
    physical = tuple({"name": "Fake GPU", "uuid": f"GPU-{i:08d}", "total_memory": 80 << 30, "capability": capability}
                     for i in range(count))
    monkeypatch.setattr(devices, "_nvml_inventory",
                        lambda: (physical, {"driver": "999.1", "cuda": (99, 0)}, "" if count else "no GPU (faked)"))
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(launch_module, "_announced", set())


def test_cuda_without_gpus_is_rejected_before_starting(no_process_may_start, monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(LaunchError, match="world_size=2 but 0 GPUs are usable here: no GPU"):
        launch(rank_and_size, 2, device="cuda")
    with pytest.raises(LaunchError, match="world_size=2 but 0 GPUs are usable here"):
        launch(rank_and_size, 2, backend="nccl")  # NCCL means CUDA


def test_more_ranks_than_gpus_is_rejected_before_starting(no_process_may_start, monkeypatch):
    fake_gpus(monkeypatch, 1)
    with pytest.raises(LaunchError, match="world_size=2 but 1 GPU is visible. Lower world_size to 1"):
        launch(rank_and_size, 2, device="cuda")
    fake_gpus(monkeypatch, 3)
    with pytest.raises(LaunchError, match="world_size=4 but 3 GPUs are visible"):
        launch(rank_and_size, 4, device="cuda")


def test_auto_picks_one_gpu_per_rank_when_they_suffice_and_says_so(no_process_may_start, monkeypatch, capsys):
    fake_gpus(monkeypatch, 2)
    choose = launch_module._device_and_backend
    assert choose("auto", None, 2, forking=False, say="shardlib.launch") == "nccl"
    assert choose("auto", None, 1, forking=False, say="shardlib.launch") == "nccl"
    assert choose("auto", None, 3, forking=False, say="shardlib.launch") == "gloo"
    assert choose("auto", None, 3, forking=False, say="shardlib.launch") == "gloo"
    assert choose("cpu", None, 1, forking=False, say="shardlib.launch") == "gloo"
    out, _ = capsys.readouterr()
    assert out.splitlines() == [  # one line per reason, however many launches
        "shardlib.launch: one GPU per rank over NCCL: 2 GPUs visible (Fake GPU).",
        "shardlib.launch: CPU ranks over gloo: 3 ranks need 3 GPUs (one per rank) and 2 are visible.",
    ], out


def test_auto_on_cpu_prints_its_reason_once_per_process(monkeypatch, capsys):
    fake_gpus(monkeypatch, 0)
    assert launch(rank_and_size, 2) == [(0, 2), (1, 2)]
    assert launch(rank_and_size, 3) == [(0, 3), (1, 3), (2, 3)]
    launch(rank_and_size, 2, device="cpu")  # asked for: nothing to explain
    out, _ = capsys.readouterr()
    assert out == "shardlib.launch: CPU ranks over gloo: no GPU (faked).\n", out


def test_in_a_notebook_the_line_is_said_on_import_before_anything_else(no_process_may_start, monkeypatch, capsys):
    """In a kernel the set-up cell's `import shardlib` says it; the first launch then adds nothing, so
    the line can never land between a table's header and its rows. Elsewhere the import says nothing."""
    fake_gpus(monkeypatch, 0)
    kernel = type("Kernel shell", (), {"kernel": object()})()
    monkeypatch.setitem(sys.modules, "IPython", type(sys)("IPython"))
    monkeypatch.setattr(sys.modules["IPython"], "get_ipython", lambda: None, raising=False)
    launch_module.announce_in_notebook()  # a script, or a plain IPython shell: no kernel
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(sys.modules["IPython"], "get_ipython", lambda: kernel)
    launch_module.announce_in_notebook()
    print("header of a table")
    assert launch_module._device_and_backend("auto", None, 3, forking=True, say="shardlib.launch") == "gloo"
    assert capsys.readouterr().out == "shardlib.launch: CPU ranks over gloo: no GPU (faked).\nheader of a table\n"


def test_whole_lines_pass_on_a_print_as_one_write():
    sent = []
    stream = launch_module.WholeLines(sent.append)
    print("one", file=stream)
    print("two", file=stream, flush=True)
    stream.write("\rframe 3/10")  # a progress bar's frame: passed on at flush
    stream.flush()
    assert sent == ["one\n", "two\n", "\rframe 3/10"], sent


def test_not_a_function_is_rejected_before_starting(no_process_may_start):
    with pytest.raises(TypeError, match="needs a function"):
        launch("rank_and_size", 2)


def test_init_from_env_outside_a_launcher_says_how_to_start(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="torchrun --nproc-per-node"):
        shardlib.init_from_env()


@pytest.mark.parametrize("environment, backend, said", [
    ({"RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "nccl", "shardlib.init_from_env: one GPU per rank over NCCL: 2 GPUs"),
    ({"RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "nccl", ""),  # one rank speaks for all
    ({"RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "gloo", "CPU ranks over gloo: 4 ranks need 4 GPUs"),
    ({"RANK": "0", "LOCAL_WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "True"}, "gloo", ""),  # accelerate launch --cpu
])
def test_init_from_env_chooses_the_device_as_launch_does(monkeypatch, capsys, environment, backend, said):
    fake_gpus(monkeypatch, 2)
    for name, value in {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **environment}.items():
        monkeypatch.setenv(name, value)
    if "ACCELERATE_USE_CPU" not in environment:
        monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    joined = []
    monkeypatch.setattr(launch_module, "_join_group", lambda backend, timeout: joined.append(backend))
    shardlib.init_from_env()
    assert joined == [backend]
    out, _ = capsys.readouterr()
    assert (said in out) if said else out == "", out


# ---------------------------------------------------------------------------------
# the same function under PyTorch's own launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
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
