"""Several nodes, simulated on one machine: 2 nodes x 2 CPU processes.

Two `torchrun --nnodes 2 --nproc-per-node 2` invocations meet through a c10d rendezvous on
localhost, exactly as two machines would through the first node's address (the README's
multi-node route). On them run:

- the hsdp check (shardlib/checks/hybrid.py): the course GPT on a (replicate=2, shard=2) mesh,
  held against one device with the harness's policy, its ledger against the formulas, and the
  shard dimension inside each node;
- the Slurm script (shardlib/configs/slurm_2node.sbatch) with fake SLURM_* variables and stand-ins
  for `srun` and `scontrol`: its accelerate route for 2 nodes x 8 GPUs (not runnable here) has each
  node's command recorded and parsed by Accelerate; where Slurm is not installed, its torchrun
  route runs the HYBRID_SHARD fine-tune for real, stopped by SIGUSR1 (the time-limit warning) and
  requeued, held against a single-process run. Where Slurm is installed, tests/test_slurm.py
  submits the script to a real cluster instead, and that test is skipped.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from shardlib import launch
from shardlib.checks.harness import compare_run, reference_run
from shardlib.checks.hybrid import LAYOUTS, build_check_gpt_in_dtype
from shardlib.finetune import FinetuneConfig, train
from shardlib.finetune.cli import parse_args
from shardlib.lessons.hybrid_traffic import global_batches
from shardlib.resources import config_path

REPO_ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TINY = ["--device", "cpu", "--max-steps", "3", "--max-length", "16", "--batch-size", "8", "--dropout", "0",
        "--max-eval-examples", "48", "--no-progress"]

HSDP_ON_RANK = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    from shardlib import init_from_env
    from shardlib.checks.hybrid import LAYOUTS, _train_on_rank

    init_from_env(device="cpu")
    result = _train_on_rank(*LAYOUTS["hsdp"])
    result["node"] = int(os.environ["GROUP_RANK"])
    torch.save(result, os.path.join(sys.argv[1], f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELERATE_", "FSDP_"))}
    return {**env, "PYTHONPATH": str(REPO_ROOT), "PATH": f"{BIN}{os.pathsep}{env['PATH']}", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", **extra}


def _two_nodes(command: list, cwd: Path, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Run `command` twice at once (node 0 and node 1); both must succeed."""
    nodes = [subprocess.Popen(command, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = []
    for node in nodes:
        try:
            out, err = node.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(command, node.returncode, out, err))
    for i, result in enumerate(done):
        assert result.returncode == 0, f"node {i} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return done


def _torchrun(port: int, run_id: str) -> list:
    return [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]


@pytest.mark.slow
def test_hsdp_check_on_two_nodes_of_two_processes(tmp_path):
    script = tmp_path / "hsdp_on_rank.py"
    script.write_text(HSDP_ON_RANK)
    _two_nodes([*_torchrun(_free_port(), "hsdp"), str(script), str(tmp_path)], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for r in ranks:  # shard inside a node, replicate across nodes
        assert r["coords"]["replicate"] == r["node"], (r["coords"], r["node"])
    reference = reference_run(build_check_gpt_in_dtype, global_batches())
    # each rank's loss is that of its own quarter of the global batch: their mean is the batch's loss
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(reference["losses"]))]
    replicas = {}
    for r in ranks:
        replicas.setdefault(r["coords"]["replicate"], {}).update(r["state"])
    for replica, state in replicas.items():
        comparison = compare_run(state, losses, reference["state"], reference["losses"])
        assert comparison["passed"], f"replica {replica} (node {replica}) against one device: {comparison}"
    for r in ranks:
        assert r["ledger"] == r["expected"], f"rank {r['coords']}: ledger {r['ledger']} != formula {r['expected']}"
    assert LAYOUTS["hsdp"][0] == (2, 2)


# ---------------------------------------------------------------------------------
# the Slurm script, without Slurm

FAKE_SRUN = """#!/bin/bash
# srun stand-in: the task command once per node, all at once, each with its SLURM_NODEID
while [[ "$1" == -* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_NNODES - 1))); do
  SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
# scontrol stand-in: `show hostnames LIST` prints one host per line, `show node NAME` its address;
# `requeue JOB` is recorded
case "$1 $2" in
  "show hostnames") printf 'node-a\\nnode-b\\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$3" ;;
  "requeue "*) echo "$@" > "$RECORD_DIR/scontrol.args" ;;
esac
"""
# tests/test_slurm.py runs the script on a real Slurm where its packages are installed (it needs root)
REAL_SLURM = os.name == "posix" and os.geteuid() == 0 and all(shutil.which(c) for c in ("sbatch", "slurmctld", "slurmd"))
RECORDING_ACCELERATE = """#!/bin/bash
# accelerate stand-in: record the command line of each node
printf '%s\\n' "$@" > "$RECORD_DIR/node$SLURM_NODEID.args"
"""


def _fake_slurm(tmp_path: Path, **scripts) -> dict:
    """A folder of stand-ins put first on PATH, and the SLURM_* variables of a 2-node job."""
    fake = tmp_path / "fake_bin"
    fake.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, **scripts}.items():
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = _env(SLURM_JOB_NAME="shardlib-finetune", SLURM_JOB_ID="4242", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="node-[a-b]", SLURM_CPUS_PER_TASK="4", PYTHON=sys.executable)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    return env


@pytest.mark.slow
@pytest.mark.skipif(REAL_SLURM, reason="Slurm is installed: tests/test_slurm.py runs this route on a real cluster")
def test_slurm_script_torchrun_route_runs_hybrid_shard_on_two_fake_nodes_and_stops_on_sigusr1(tmp_path):
    out, script, steps = tmp_path / "run", ["bash", str(config_path("slurm_2node.sbatch"))], [*TINY, "--max-steps", "6"]
    env = _fake_slurm(tmp_path)
    env.update(LAUNCHER="torchrun", GPUS_PER_NODE="2", MAIN_PORT=str(_free_port()), OUTPUT_DIR=str(out),
               FINETUNE_ARGS=shlex.join(steps), RECORD_DIR=str(tmp_path))
    first = subprocess.Popen(script, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not (out / "log.jsonl").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGUSR1)  # what Slurm sends the batch shell near the time limit (--signal=B:USR1)
    output, _ = first.communicate(timeout=600)
    assert first.returncode == 0, output[-4000:]
    stopped = json.loads((out / "summary.json").read_text())
    assert not stopped["finished"] and stopped["end_step"] < 6, stopped["history"]
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"], output[-2000:]

    done = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)  # requeued
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start_step"] == stopped["end_step"] and summary["finished"], summary["start_step"]
    assert (summary["strategy"], summary["world_size"]) == ("HYBRID_SHARD", 4)
    # FULL_SHARD inside a node of 2 ranks: rank 0 holds half of every parameter; the other node holds a replica
    assert abs(summary["shard_check"]["fraction"] - 0.5) < 1e-3, summary["shard_check"]
    assert summary["units"][-1] == "" and len(summary["units"]) == 8, summary["units"]
    one = launch(train, 1, args=(parse_args([*steps, "--strategy", "FULL_SHARD", "--output-dir", str(tmp_path / "one")]),),
                 device="cpu", timeout=600, prefix_output=False)[0]
    ours = [h["loss"] for h in stopped["history"] + summary["history"]]
    reference = [h["loss"] for h in one["history"]]
    assert ours == pytest.approx(reference, abs=1e-5), (ours, reference)
    assert summary["test"]["accuracy"] == one["test"]["accuracy"]


@pytest.mark.slow
def test_slurm_script_accelerate_route_gives_each_node_its_machine_rank(tmp_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from shardlib.finetune.model import strategy_from_launch_env

    env = _fake_slurm(tmp_path, accelerate=RECORDING_ACCELERATE)
    port = _free_port()  # Accelerate checks that the main port is free on this machine
    env.update(RECORD_DIR=str(tmp_path), MAIN_PORT=str(port))
    done = subprocess.run(["bash", str(config_path("slurm_2node.sbatch"))], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for node in (0, 1):
        argv = (tmp_path / f"node{node}.args").read_text().split("\n")[:-1]
        assert argv[0] == "launch", argv
        args = launch_command_parser().parse_args(argv[1:])
        args, _, _ = _validate_launch_command(args)
        assert (args.num_machines, args.num_processes, args.machine_rank) == (2, 16, node)
        assert (args.main_process_ip, args.main_process_port) == ("127.0.0.1", port)  # node-a's NodeAddr
        assert Path(args.config_file) == config_path("accelerate", "fsdp2_2node_8gpu_hybrid.yaml")
        env = prepare_multi_gpu_env(args)  # a mesh of 2 nodes x 8 GPUs: replicas across, shards within
        assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "8")
        assert strategy_from_launch_env(env) == "HYBRID_SHARD"
        assert args.training_script == "shardlib.finetune" and args.module
        config = parse_args(args.training_script_args)  # the fine-tune's own flags are valid
        out = "runs/finetune-shardlib-finetune"
        assert isinstance(config, FinetuneConfig) and config.output_dir == out
        assert (config.epochs, config.batch_size, config.resume, config.export) == (3, 256, "auto", True)
        assert config.stop_file == f"{out}/stop-requested"  # where the script's SIGUSR1 trap asks for a stop
