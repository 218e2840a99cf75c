"""The course's batch script on a real Slurm: shardlib/configs/slurm_2node.sbatch submitted with sbatch.

tests/slurm/start_cluster.sh starts munged, slurmctld and two slurmd (node1, node2) on this machine
(Debian's Slurm is built to run several slurmd on one host); the fixture stops them at the end.
The script is submitted unchanged, with the #SBATCH lines its header says to adjust given on
sbatch's command line (no GPUs, 2 CPUs per node, a time limit): on each node one launcher starts
2 CPU ranks over gloo, HYBRID_SHARD over 2 nodes x 2 ranks, the fine-tune's smallest settings.

- Slurm's time limit: the script asks for SIGUSR1 120 s before it; the ranks finish their step,
  save a checkpoint, and the job requeues itself; the requeued run continues from that checkpoint.
- Through Accelerate the job ends COMPLETED with the losses of the same run launched by torchrun by
  hand (4 ranks, no Slurm), and those agree with one process.
- A rank killed mid-run (SIGKILL, as the out-of-memory killer does) ends the job FAILED within
  seconds, the log naming the rank; resubmitted through torchrun (LAUNCHER=torchrun) the job ends
  COMPLETED, continuing from its last checkpoint with the losses of the run by hand.

Every run shares one schedule (--max-steps 1000) and stops long before its end (--stop-after, or the
time limit), so one run by hand is the reference for all; the time-limit test comes first because
where its first run stops decides how long the run by hand must be.
Job states: `sacct --completion` (jobcomp/filetxt; without a database there is no job accounting).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlib import launch
from shardlib.finetune import train
from shardlib.finetune.cli import parse_args
from shardlib.resources import config_path

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parent.parent
CLUSTER = REPO_ROOT / "tests" / "slurm"
STATE = Path(os.environ.get("SHARDLIB_SLURM_DIR", "/tmp/shardlib-slurm"))
BIN = Path(sys.executable).parent
SCRIPT = config_path("slurm_2node.sbatch")
ADJUSTED = ["--gpus-per-node=0", "--cpus-per-task=2"]  # this cluster's nodes: 2 CPUs, no GPUs
TRAIN = ["--device", "cpu", "--max-steps", "1000", "--warmup-ratio", "0", "--max-length", "16", "--batch-size", "8",
         "--dropout", "0", "--no-evaluate", "--no-progress"]
SIX_STEPS = [*TRAIN, "--stop-after", "6"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(condition, seconds: float, what: str, log: Path | None = None):
    """Poll until condition() is truthy; fail after `seconds` saying what did not happen."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise AssertionError(f"{what}: not within {seconds:.0f} s\n{tail}")
        time.sleep(0.5)
    return value


def _environ(pid: str) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # ended meanwhile, or not ours to read
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _command(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""


def _steps(out: Path) -> list[dict]:
    log = out / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _losses(history: list[dict]) -> list[float]:
    return [h["loss"] for h in history]


class Slurm:
    """sbatch, scontrol, sacct and scancel against the cluster of tests/slurm/start_cluster.sh."""

    def __init__(self):
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELERATE_", "FSDP_"))}
        self.env.update(SLURM_CONF=str(STATE / "slurm.conf"), PATH=f"{BIN}{os.pathsep}{self.env['PATH']}",
                        PYTHONPATH=str(REPO_ROOT), PYTHON=sys.executable, GPUS_PER_NODE="2")

    def run(self, *command, cwd=None, env=None) -> str:
        done = subprocess.run(command, cwd=cwd, env=env or self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{shlex.join(command)}: {done.stderr}"
        return done.stdout

    def submit(self, folder: Path, out: Path, launcher: str, args: list, *sbatch) -> str:
        """The user's `LAUNCHER=... sbatch slurm_2node.sbatch`, its log in folder."""
        folder.mkdir(parents=True, exist_ok=True)
        env = {**self.env, "LAUNCHER": launcher, "OUTPUT_DIR": str(out), "FINETUNE_ARGS": shlex.join(args),
               "MAIN_PORT": str(_free_port())}
        return self.run("sbatch", "--parsable", *ADJUSTED, *sbatch, str(SCRIPT), cwd=folder, env=env).strip().split(";")[0]

    def job(self, job: str) -> dict:
        fields = self.run("scontrol", "-o", "show", "job", job).split()
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def ended(self, job: str, seconds: float, log: Path) -> str:
        return _wait(lambda: (state := self.job(job)["JobState"]) in ENDED and state, seconds, f"job {job} ending", log)

    def sacct(self, job: str) -> list[dict]:
        names = ["JobID", "State", "ExitCode", "Start", "End", "ElapsedRaw"]
        rows = self.run("sacct", "--completion", "-j", job, "-n", "-P", "-o", ",".join(names)).splitlines()
        return [dict(zip(names, row.split("|"))) for row in rows]

    def processes(self, job: str) -> dict[str, dict]:
        """pid: environment of every process of the job still running (step daemons, launchers, ranks)."""
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            env = _environ(pid)
            if env.get("SLURM_JOB_ID") == job or _command(pid).startswith(f"slurmstepd: [{job}."):
                found[pid] = env
        return found

    def ranks(self, job: str) -> dict[int, int]:
        return {int(env["RANK"]): int(pid) for pid, env in self.processes(job).items() if "RANK" in env}


class ByHand:
    """The same fine-tune launched by torchrun by hand: one torchrun, 4 ranks on this machine, no Slurm."""

    def __init__(self, folder: Path):
        self.folder, self.steps, self.process, self.done = folder, 0, None, None

    def start(self, steps: int) -> None:
        if steps <= self.steps:
            return
        if self.process and self.process[1].poll() is None:  # a shorter run: this one replaces it
            self.process[1].kill()
            self.process[1].wait(timeout=60)
        self.steps, self.done, out = steps, None, self.folder / f"steps{steps}"
        command = [str(BIN / "torchrun"), "--nproc-per-node", "4", "--master-port", str(_free_port()),
                   "-m", "shardlib.finetune", "--strategy", "HYBRID_SHARD", "--replicate-size", "2",
                   "--output-dir", str(out), *TRAIN, "--stop-after", str(steps)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELERATE_", "FSDP_"))}
        env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        out.mkdir(parents=True)
        with open(out / "torchrun.log", "w") as log:  # a file, not a pipe: nobody reads it while it runs
            self.process = (out, subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))

    def losses(self, steps: int) -> list[float]:
        self.start(steps)
        out, process = self.process
        if self.done is None:
            process.wait(timeout=600)
            assert process.returncode == 0, f"torchrun by hand failed:\n{(out / 'torchrun.log').read_text()[-3000:]}"
            self.done = _losses(json.loads((out / "summary.json").read_text())["history"])
        return self.done[:steps]


@pytest.fixture(scope="module")
def slurm():
    try:
        started = subprocess.run([str(CLUSTER / "start_cluster.sh")], capture_output=True, text=True, timeout=900)
    except FileNotFoundError as error:  # no bash (Windows)
        pytest.skip(f"the Slurm tests need bash: {error}")
    if started.returncode == 3:
        pytest.skip(f"Slurm cannot run here: {started.stderr.strip()}")
    try:
        assert started.returncode == 0, f"tests/slurm/start_cluster.sh failed:\n{started.stderr[-4000:]}"
        yield Slurm()
    finally:
        stopped = subprocess.run([str(CLUSTER / "stop_cluster.sh")], capture_output=True, text=True, timeout=180)
        assert stopped.returncode == 0 and not STATE.exists(), f"the cluster did not stop: {stopped.stderr}"


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory):
    reference = ByHand(tmp_path_factory.mktemp("by_hand"))
    yield reference
    if reference.process and reference.process[1].poll() is None:
        reference.process[1].kill()


def test_near_the_time_limit_the_ranks_checkpoint_and_the_requeued_job_resumes(slurm, by_hand, tmp_path):
    out = tmp_path / "run"
    # a 2-minute job: the script's 120 s of warning come at Slurm's first time-limit check (every 30 s)
    job = slurm.submit(tmp_path, out, "accelerate", TRAIN, "--time=2")
    log = tmp_path / f"shardlib-finetune-{job}.out"
    _wait(lambda: slurm.job(job).get("Restarts") == "1", 240, f"job {job} requeued after SIGUSR1", log)
    first = json.loads((out / "summary.json").read_text())
    stopped = first["end_step"]
    assert (first["start_step"], first["finished"]) == (0, False), first
    assert (out / "checkpoints" / f"step_{stopped:06d}" / "shardlib.json").is_file(), "no checkpoint at the stop"
    text = log.read_text()
    assert "SIGUSR1" in text and f"step {stopped}: {out}/stop-requested appeared" in text, text[-3000:]
    assert "requeueing" in text, text[-3000:]
    record = slurm.sacct(job)[0]  # the first run: it ended well inside its 120 s, not at the limit
    assert record["State"] != "TIMEOUT" and int(record["ElapsedRaw"]) < 120, record
    by_hand.start(max(6, stopped + 1))  # while the requeued job waits for its turn and starts

    _wait(lambda: any(s["step"] == stopped + 1 for s in _steps(out)), 240, f"step {stopped + 1} after the requeue",
          log)
    slurm.run("scancel", job)
    assert slurm.ended(job, 120, log) == "CANCELLED"
    text = log.read_text()
    assert "restart 1) on node[1-2]" in text and f"resumed from {out}/checkpoints/step_{stopped:06d}" in text
    print(f"\njob {job}: first run stopped at step {stopped} after SIGUSR1; sacct --completion: {slurm.sacct(job)}")
    steps = _steps(out)
    assert [s["step"] for s in steps][:stopped + 1] == list(range(1, stopped + 2)), steps
    reference = by_hand.losses(max(6, stopped + 1))
    ours = _losses(steps)[:len(reference)]
    assert ours == pytest.approx(reference[:len(ours)], rel=1e-9, abs=0), (ours, reference)
    _wait(lambda: not slurm.processes(job), 30, f"job {job}'s processes ending")


def test_sbatch_runs_the_fine_tune_to_completed_with_the_losses_of_torchrun_by_hand(slurm, by_hand, tmp_path):
    out = tmp_path / "run"
    job = slurm.submit(tmp_path, out, "accelerate", SIX_STEPS)
    log = tmp_path / f"shardlib-finetune-{job}.out"
    reference = by_hand.losses(6)
    one = launch(train, 1, args=(parse_args([*SIX_STEPS, "--strategy", "FULL_SHARD", "--output-dir",
                                             str(tmp_path / "one")]),), device="cpu", timeout=600, prefix_output=False)
    # HYBRID_SHARD on 4 ranks against one process: the same losses but for the order of float sums
    assert reference == pytest.approx(_losses(one[0]["history"]), abs=1e-5)
    assert slurm.ended(job, 300, log) == "COMPLETED", log.read_text()[-3000:]
    record = slurm.sacct(job)[-1]
    assert (record["State"], record["ExitCode"]) == ("COMPLETED", "0:0"), record
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"]) == ("HYBRID_SHARD", 4), summary
    # FULL_SHARD inside a node of 2 ranks: rank 0 holds half of every parameter
    assert abs(summary["shard_check"]["fraction"] - 0.5) < 1e-3, summary["shard_check"]
    print(f"\njob {job} (accelerate): {record}; losses {_losses(summary['history'])}, by hand {reference}")
    assert _losses(summary["history"]) == pytest.approx(reference, rel=1e-9, abs=0)


def test_a_killed_rank_fails_the_job_and_resubmitting_it_through_torchrun_resumes_with_the_same_losses(
        slurm, by_hand, tmp_path):
    out, args = tmp_path / "run", [*SIX_STEPS, "--checkpoint-every", "2"]
    job = slurm.submit(tmp_path, out, "accelerate", args)
    log = tmp_path / f"shardlib-finetune-{job}.out"
    _wait(lambda: (out / "checkpoints" / "step_000002" / "shardlib.json").is_file(), 300, "checkpoint of step 2", log)
    ranks = slurm.ranks(job)
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    os.kill(ranks[3], signal.SIGKILL)  # on node2, local rank 1
    killed = time.monotonic()
    assert slurm.ended(job, 120, log) == "FAILED"
    took = time.monotonic() - killed
    assert took < 60, f"the job took {took:.0f} s to end after its rank died"
    assert re.search(r"Root Cause.*?rank\s*: 3 \(local_rank: 1\)\s*exitcode\s*: -9", log.read_text(), re.S), \
        log.read_text()[-3000:]
    _wait(lambda: not slurm.processes(job), 30, f"job {job}'s processes ending")
    print(f"\njob {job}: {slurm.sacct(job)}, ended {took:.1f} s after rank 3 was killed")
    resumed_from = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step_??????"))

    again = slurm.submit(tmp_path, out, "torchrun", args)  # the same OUTPUT_DIR; the other launcher
    log = tmp_path / f"shardlib-finetune-{again}.out"
    assert slurm.ended(again, 300, log) == "COMPLETED", log.read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert resumed_from in (2, 4) and summary["start_step"] == resumed_from, (resumed_from, summary["start_step"])
    reference, ours = by_hand.losses(6), _losses(summary["history"])
    print(f"job {again}: {slurm.sacct(again)}, resumed at step {resumed_from}: {ours}, by hand {reference}")
    assert ours == pytest.approx(reference[resumed_from:], rel=1e-9, abs=0)
    # a run that had started again from scratch would show the first steps' losses instead
    assert ours != pytest.approx(reference[:len(ours)], abs=1e-6)
