"""Lesson 08's fine-tune on the GPUs of this machine, through Accelerate's FSDP2 plugin (marked gpu).

`python3 course.py test -m gpu` on a machine with NVIDIA GPUs; skipped elsewhere. The run goes the
way the lesson goes: run_in_notebook(config, N) from a fresh process that never starts CUDA itself
(N = every GPU: notebook_launcher forks one rank per GPU; one GPU: shardlib.launch forks the one
rank). Held against independent references: the ZeRO formulas for the fp32 shards FSDP2 keeps, the
GPU's compute capability (read through NVML) for the mixed precision, 1/N for each rank's share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlib.devices import visible_gpus, why_no_gpu
from shardlib.memory import zero_model_state_bytes

REPO_ROOT = Path(__file__).resolve().parent.parent
GPUS = [] if why_no_gpu() else visible_gpus()  # NVML: this process does not start CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not GPUS, reason=f"needs an NVIDIA GPU: {why_no_gpu() or 'none visible'}")]

RUN = """
import json, sys
from shardlib.finetune import FinetuneConfig, run_in_notebook
config = FinetuneConfig(**json.loads(sys.argv[1]))
summary = run_in_notebook(config, int(sys.argv[2]))
print("SUMMARY " + json.dumps(summary))
"""


def run_on_gpus(tmp_path: Path, world_size: int, **overrides) -> dict:
    config = {"device": "cuda", "strategy": "FULL_SHARD", "max_length": 32, "max_steps": 36,
              "batch_size": 32 if 32 % world_size == 0 else 4 * world_size, "checkpoint_every": 12,
              "max_eval_examples": 200, "measure_memory": 30, "progress": "none",
              "output_dir": str(tmp_path / "run"), **overrides}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(config), str(world_size)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    line = next(l for l in done.stdout.splitlines() if l.startswith("SUMMARY "))
    return json.loads(line[len("SUMMARY "):])


def test_finetune_through_accelerates_fsdp2_plugin_on_every_gpu_here(tmp_path):
    n = len(GPUS)
    summary = run_on_gpus(tmp_path, n)
    expected_precision = "bf16" if all(g.native_bf16 for g in GPUS) else "fp16"
    assert summary["device"].startswith("cuda") and summary["world_size"] == n
    assert summary["mixed_precision"] == expected_precision, (summary["mixed_precision"], [g.sm for g in GPUS])
    blocks = [u for u in summary["units"] if u.startswith("bert.encoder.layer.")]
    assert len(blocks) == 6 and summary["units"][-1] == "", summary["units"]
    assert abs(summary["shard_check"]["fraction"] - 1 / n) < 1e-3, summary["shard_check"]
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 36 and sum(losses[-6:]) / 6 < sum(losses[:6]) / 6, losses
    assert summary["test"]["accuracy"] > 0.5, summary["test"]  # chance is 0.2
    # FSDP2 keeps fp32 gradient and Adam shards: the ZeRO-3 formula's terms, 1/N each
    predicted = zero_model_state_bytes(summary["n_params"], n, 3, recipe="fp32_adam")
    after_step = summary["memory"]["after_step"]
    for key in ("grads", "optimizer"):
        held = max(summary["memory"][m][key] for m in ("after_forward", "after_backward", "after_step"))
        assert held == pytest.approx(predicted[key], rel=0.01), (key, held, predicted[key])
    peak = summary["max_memory_allocated"]
    assert after_step["total"] <= peak < after_step["total"] + 4e9, (peak, after_step)
    print(f"{n} x {GPUS[0].name}: {summary['mixed_precision']}, step {summary['step_time_s']:.3f} s, "
          f"peak {peak / 1e6:.0f} MB per rank (states at rest {after_step['total'] / 1e6:.0f} MB, "
          f"formula {predicted['total'] / 1e6:.0f} MB), test accuracy {summary['test']['accuracy']:.3f}")


def test_bf16_on_a_gpu_without_it_fails_before_launch_naming_fp16(tmp_path):
    if all(g.native_bf16 for g in GPUS):
        pytest.skip(f"every GPU here has native bf16 ({', '.join(g.sm for g in GPUS)})")
    with pytest.raises(AssertionError, match="has no native bf16.*fp16"):
        run_on_gpus(tmp_path, 1, mixed_precision="bf16", max_steps=2)
