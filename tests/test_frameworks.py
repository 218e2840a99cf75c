"""Lesson 09's frameworks (DeepSpeed, Accelerate, Megatron-Core, JAX) against one device and the formulas.

References are independent of the code under test: a model trained on one device with torch's own
optimizer (`train_reference`, `jax_sharding.torch_reference`), ZeRO's byte counts written out here
per parameter, collective sizes worked out by hand from the layouts, and HLO text written by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from shardlib.checks import frameworks
from shardlib.checks.zero import CHECK_GPT
from shardlib.lessons import accelerate_run, deepspeed_run, jax_sharding
from shardlib.resources import config_path

PSI = CHECK_GPT.n_params  # 42,304


# ---------------------------------------------------------------------------------
# fast: configs, bookkeeping, parsing


def test_lesson_uses_the_zero_checks_model():
    assert deepspeed_run.ZERO_CHECK_GPT == CHECK_GPT
    assert PSI == 42_304  # V*h + T*h + L*(12h^2 + 12h) + 2h + h*V with V=256, T=16, L=2, h=32


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_files(stage):
    config = deepspeed_run.deepspeed_config(stage, micro_batch=6, micro_batches=2, bucket_numel=1000)
    assert config["zero_optimization"]["stage"] == stage
    assert config["train_micro_batch_size_per_gpu"] == 6 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's default (1.0) would clip
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000
    if stage == 3:
        assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    on_disk = json.loads(config_path("deepspeed", f"zero{stage}.json").read_text())
    assert on_disk["train_micro_batch_size_per_gpu"] == "auto"  # the file is not changed by filling it in


def test_deepspeed_config_refuses_a_bad_stage():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        deepspeed_run.deepspeed_config(4, micro_batch=6)


def test_accelerate_config_names_an_existing_ds_config():
    import yaml

    config = yaml.safe_load(config_path("accelerate", accelerate_run.ACCELERATE_CONFIG).read_text())
    assert config["distributed_type"] == "DEEPSPEED" and config["use_cpu"] is True
    ds_file = config["deepspeed_config"]["deepspeed_config_file"]  # relative to the package's parent folder
    root = config_path("deepspeed", "zero3.json").parents[3]
    assert (root / ds_file).is_file(), f"{ds_file} not found under {root}"


def test_held_bytes_counts_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:]]  # one storage, 400 bytes
    master = torch.zeros(50)  # 200 bytes
    held = deepspeed_run.held_bytes({"params": views, "grads": [torch.zeros(10)], "optimizer": [master, flat],
                                     "buckets": [torch.zeros(25)]})
    assert held == {"params": 400, "grads": 40, "optimizer": 200, "buckets": 100, "total": 640}


def test_count_collectives_reads_both_replica_group_forms():
    hlo = textwrap.dedent("""
        %all-reduce = f32[8,32]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
        %all-reduce.6 = (f32[], f32[32]{0}, f32[32,32]{1,0}) all-reduce(%a, %b, %c), replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, to_apply=%r
        %ag = f32[128,32]{1,0} all-gather(%w), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
        %rs = f32[2,16]{1,0} reduce-scatter(%g), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
        %add = f32[8,32]{1,0} add(%all-reduce, %all-reduce)
    """)
    found = jax_sharding.count_collectives(hlo)
    assert found == [{"kind": "all_reduce", "elements": 256, "group": 4},
                     {"kind": "all_reduce", "elements": 1 + 32 + 1024, "group": 2},
                     {"kind": "all_gather", "elements": 4096, "group": 8},
                     {"kind": "reduce_scatter", "elements": 8 * 32, "group": 8}]  # input = result x group


def test_expected_deepspeed_bytes_are_the_zero_table_with_a_master_copy():
    # fp32: params 4, grads 4, m and v 8, DeepSpeed's fp32 master partition 4 more; stage 1 with one
    # micro-batch keeps only its gradient partition (lesson 09)
    n = 4
    assert frameworks.expected_deepspeed_bytes(PSI, n, 1) == {"params": 4 * PSI, "grads": PSI, "optimizer": 3 * PSI}
    assert frameworks.expected_deepspeed_bytes(PSI, n, 3) == {"params": PSI, "grads": PSI, "optimizer": 3 * PSI}


def test_fsdp_plugin_guard_leaves_cpu_out():
    decision = accelerate_run.fsdp_plugin_decision()
    assert decision["guard"].startswith("elif self.distributed_type in [")
    assert "MULTI_GPU" in decision["guard"] and "MULTI_CPU" not in decision["guard"]
    assert decision["line"] < decision["sets_fsdp_line"]


def test_jax_device_count_too_late_says_what_to_do():
    code = ("import jax, jax.numpy as jnp; jnp.ones(1).block_until_ready(); "
            "from shardlib.lessons.jax_sharding import set_cpu_devices; set_cpu_devices(8)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode != 0
    assert "restart the kernel" in done.stderr and "cannot have 8" in done.stderr


# ---------------------------------------------------------------------------------
# slow: the frameworks run for real


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"])
def test_deepspeed_matches_one_device(technique):
    result = frameworks.verify_deepspeed(2, technique)
    assert result["passed"], result["detail"]


@pytest.mark.slow
def test_deepspeed_zero1_keeps_whole_gradients_between_micro_batches():
    run = deepspeed_run.compare_zero(2, 1, steps=2, micro_batches=2)[0]
    assert run["deepspeed"]["held"]["grads"] >= 4 * PSI  # stage 1 reduces only at the last micro-batch
    assert run["deepspeed"]["held"]["optimizer"] == pytest.approx(12 * PSI / 2, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["jax-dp", "jax-fsdp", "jax-tp"])
def test_jax_layouts_match_torch_on_one_device(technique):
    result = frameworks.verify_jax(4, technique)
    assert result["passed"], result["detail"]


@pytest.mark.slow
def test_jax_2d_layout_collectives():
    run = jax_sharding.run_in_subprocess("2d", 8, steps=1)
    d, k, b = jax_sharding.D, jax_sharding.K, jax_sharding.BATCH
    per_device = (2 * d * k + k) // 4 + d  # W1, b1, W2 split 4 ways over "model"; b2 whole
    assert sum(run["params_per_device"].values()) == per_device
    reduces = sorted(c["elements"] for c in run["collectives"] if c["kind"] == "all_reduce")
    assert reduces == sorted([b // 2 * d, per_device + 1])  # tp's partial sums on half the batch; dp's gradients + loss


@pytest.mark.slow
def test_megatron_layers_match_one_device_and_shardlib():
    result = frameworks.verify_megatron(2)
    assert result["passed"], result["detail"]


@pytest.mark.slow
def test_deepspeed_runs_without_a_compiler(tmp_path):
    """Every compiler on PATH fails: DeepSpeed must not need one (no op is built)."""
    for name in ("gcc", "g++", "cc", "c++", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++"):
        fake = tmp_path / name
        fake.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
        fake.chmod(0o755)
    code = ("from shardlib.lessons import deepspeed_run as d; d.import_deepspeed(); "
            "r = d.compare_zero(2, 3, steps=1)[0]; print(r['deepspeed']['losses'])")
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", CC=str(tmp_path / "gcc"), CXX=str(tmp_path / "g++"),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "extensions").exists(), "DeepSpeed tried to build an extension"
