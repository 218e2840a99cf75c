"""Accelerate's DeepSpeed plugin run for real on CPU ranks, and why its FSDP plugin is not (lesson 09).

Accelerate (https://huggingface.co/docs/accelerate/usage_guides/deepspeed) wraps DeepSpeed behind
`Accelerator(deepspeed_plugin=...)`, or behind `accelerate launch --config_file` with
`distributed_type: DEEPSPEED`. Both routes here train the model and batches of shardlib's ZeRO checks
with DeepSpeed ZeRO (shardlib/configs/deepspeed/zero<stage>.json), the same losses as
shardlib/lessons/deepspeed_run.py and as one device. Memory and communication are DeepSpeed's (see
that module): ZeRO-3 holds 4 Psi/N params + 4 Psi/N grads + 12 Psi/N master and Adam bytes per rank.

Two things make it run on a machine without GPUs:
- `PartialState(backend="gloo")` before `Accelerator(...)`: without it Accelerate sets
  num_processes=1 on every rank of a CPU-only machine;
- DeepSpeed's shared-memory communication op is turned off before DeepSpeed initialises (it would
  be compiled on the spot, which needs g++).

Accelerate's FSDP plugin is another story: `fsdp_plugin_decision()` quotes the line of
accelerate/state.py that only lets GPU-like devices become `DistributedType.FSDP`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from shardlib.lessons.deepspeed_run import (
    GLOBAL_BATCH,
    ZERO_CHECK_GPT,
    disable_shm_comm_op,
    import_deepspeed,
)
from shardlib.models import build_gpt, random_token_batches
from shardlib.reference import model_loss, rank_slice
from shardlib.resources import config_path

__all__ = [
    "ACCELERATE_CONFIG",
    "fsdp_plugin_decision",
    "fsdp_plugin_on_cpu",
    "import_accelerate",
    "launch_with_config",
    "run_notebook_launcher",
    "train_with_accelerate",
]

ACCELERATE_CONFIG = "deepspeed_zero3_cpu_2proc.yaml"  # in shardlib/configs/accelerate/


def train_with_accelerate(stage: int = 3, steps: int = 3, lr: float = 3e-4, result_file: str | None = None) -> dict:
    """On each rank (notebook_launcher or accelerate launch): train with Accelerate + DeepSpeed ZeRO `stage`.

    Under `accelerate launch` with a DEEPSPEED config the plugin comes from the config file;
    otherwise it is built here from shardlib/configs/deepspeed/zero<stage>.json.
    """
    torch.set_num_threads(1)  # a forked rank: one thread (OpenMP's pool does not survive a fork; 2 cores)
    deepspeed = import_deepspeed()
    warnings.filterwarnings("ignore", category=FutureWarning)
    deepspeed.utils.logger.setLevel(logging.ERROR)  # e.g. "untested optimizer": torch's AdamW, on purpose
    disable_shm_comm_op(deepspeed)  # no C++ op to build
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    state = PartialState(backend="gloo")  # before Accelerator: else one process per rank on a CPU machine
    n, rank = state.num_processes, state.process_index
    from_config_file = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    plugin = None if from_config_file else DeepSpeedPlugin(
        hf_ds_config=str(config_path("deepspeed", f"zero{stage}.json")))
    accelerator = Accelerator(deepspeed_plugin=plugin)
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // n  # "auto" in the file: no data loader here
    model = build_gpt(ZERO_CHECK_GPT, seed=0)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))
    losses = []
    for batch in random_token_batches(ZERO_CHECK_GPT, GLOBAL_BATCH, steps):
        x, y = (t.to(accelerator.device) for t in rank_slice(batch, rank, n))  # (B/N, T) each
        loss = model_loss(model, (x, y))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())  # the global batch's mean loss
    result = {"losses": losses, "distributed_type": str(accelerator.distributed_type), "num_processes": n,
              "zero_stage": ds_config["zero_optimization"]["stage"], "engine": type(model).__name__}
    if result_file and rank == 0:  # notebook_launcher returns nothing: rank 0 leaves its result here
        Path(result_file).write_text(json.dumps(result))
    return result


def run_notebook_launcher(num_processes: int = 2, stage: int = 3, steps: int = 3) -> dict:
    """accelerate.notebook_launcher(train_with_accelerate, ...) from this process; rank 0's result.

    Its own message ("Launching training on N ...") is returned as `launcher_said`: it names the device
    type of the PyTorch build, while the ranks here are CPU processes over gloo.
    """
    from accelerate import notebook_launcher

    with tempfile.TemporaryDirectory() as folder:
        result_file = os.path.join(folder, "result.json")
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            notebook_launcher(train_with_accelerate, args=(stage, steps, 3e-4, result_file), num_processes=num_processes)
        result = json.loads(Path(result_file).read_text())
    return dict(result, launcher_said=said.getvalue().strip())


def import_accelerate():
    """Import Accelerate quietly (tqdm warns, in a notebook without ipywidgets, when it is first imported)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import accelerate
        import accelerate.utils
    return accelerate


def launch_with_config(config_name: str = ACCELERATE_CONFIG, steps: int = 3, timeout: float = 240) -> dict:
    """`accelerate launch --config_file shardlib/configs/accelerate/<config_name> -m shardlib.lessons.accelerate_run`.

    The config names its ds_config by a path relative to the folder that holds the shardlib package
    (the repository root, or site-packages): the command runs there. Returns rank 0's result.
    """
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    command = [accelerate, "launch", "--config_file", str(config_path("accelerate", config_name)),
               "-m", "shardlib.lessons.accelerate_run", str(steps)]
    package_parent = Path(__file__).resolve().parents[2]  # the repository root, or site-packages
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=package_parent,
                          env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    results = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not results:
        raise RuntimeError(f"accelerate launch failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(results[-1])


def fsdp_plugin_decision() -> dict:
    """Where Accelerate decides that an FSDP plugin is used: the guard around `DistributedType.FSDP`.

    Returns {"version", "file", "line" (of the guard), "guard" (its text, joined), "sets_fsdp_line"}.
    """
    import accelerate
    from accelerate import state

    lines, first = inspect.getsourcelines(state.AcceleratorState.__init__)
    sets = next(i for i, line in enumerate(lines) if "self.distributed_type = DistributedType.FSDP" in line)
    guard = next(i for i in range(sets, -1, -1) if lines[i].strip().startswith("elif self.distributed_type in"))
    end = next(i for i in range(guard, sets) if lines[i].strip().endswith("]:"))
    text = " ".join(line.strip() for line in lines[guard:end + 1]).replace("[ ", "[").replace(", ]", "]")
    return {"version": accelerate.__version__, "file": "accelerate/state.py", "line": first + guard,
            "guard": text, "sets_fsdp_line": first + sets}


def _fsdp_on_rank() -> dict:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    PartialState(backend="gloo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        model = accelerator.prepare(build_gpt(ZERO_CHECK_GPT, seed=0))
    numel = sum(p.numel() for p in model.parameters())
    return {"distributed_type": str(accelerator.distributed_type), "model": type(model).__name__,
            "params_on_rank": numel, "params_of_model": ZERO_CHECK_GPT.n_params}


def fsdp_plugin_on_cpu(world_size: int = 2) -> dict:
    """Accelerator(fsdp_plugin=...) on CPU ranks: what Accelerate chose, and how many parameters a rank keeps."""
    from shardlib.launch import launch

    return launch(_fsdp_on_rank, world_size, timeout=120, device="cpu")[0]


def _leave_in_step() -> None:
    """End a rank launched by `accelerate launch` without running C++ destructors.

    At interpreter exit a rank that still holds DeepSpeed's engine and the gloo group can abort
    ("terminate called without an active exception": a joinable thread destroyed), which fails the
    whole launch although training finished. So: wait for every rank, then leave at once.
    """
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()  # every rank is past its last collective
    os._exit(0)


if __name__ == "__main__":  # accelerate launch ... -m shardlib.lessons.accelerate_run [STEPS]
    result = train_with_accelerate(steps=int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
    _leave_in_step()
