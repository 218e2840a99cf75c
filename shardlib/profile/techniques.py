"""One traced training step of each technique `verify` knows, for `python -m shardlib trace TECHNIQUE`.

Each rank builds the technique on the model its check uses (shardlib.checks: the same models, the
same world sizes), runs one untraced step (two for ZeRO-3 with prefetch, which follows the order of
the step before), then one step inside `shardlib.trace(DIR)` and a ledger. Each returns the ledger's
calls per kind, the trace's files, and the technique's own timers where it keeps them (DDP's bucket
timeline, ZeRO-3's all-gather log, a pipeline's forwards and backwards) for `shardlib.profile.agree`.
"""

from __future__ import annotations

import functools
import importlib
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardlib.checks.harness import BATCH, adamw, build_check_model, check_batches, on_device
from shardlib.comm import comm_ledger
from shardlib.launch import current_device
from shardlib.models import build_gpt, random_token_batches
from shardlib.profile.record import trace
from shardlib.reference import model_loss, rank_slice

__all__ = ["TECHNIQUES", "DEFAULT_WORLD_SIZE", "traced_step", "traced_steps", "world_size_error"]

PIPELINES = {"pp-naive": "naive", "pp-gpipe": "gpipe", "pp-1f1b": "1f1b", "pp-interleaved": "interleaved",
             "pp-zero-bubble": "zero-bubble"}


def _data_parallel(technique: str):
    from shardlib.parallel.ddp import DistributedDataParallel, all_reduce_gradients
    from shardlib.parallel.fsdp import _units, fully_shard
    from shardlib.parallel.zero_stages import apply_zero

    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_check_model("gpt").to(current_device())
    timers = {}
    if technique == "ddp":
        model = DistributedDataParallel(model, bucket_cap_mb=0.05, record_timeline=True)
        optimizer, timers["buckets"] = adamw(model.parameters()), model.timeline
    elif technique in ("zero3", "zero3-prefetch"):
        for block in model.blocks:
            fully_shard(block, prefetch=technique == "zero3-prefetch")
        fully_shard(model, prefetch=technique == "zero3-prefetch")
        optimizer, timers["gathers"] = adamw(model.parameters()), []
        for _, unit in _units(model):
            unit.gather_log = timers["gathers"]
    elif technique in ("zero1", "zero2"):
        optimizer = apply_zero(model, int(technique[-1]), adamw, bucket_cap_mb=0.1 if technique == "zero2" else None)
    else:
        optimizer = adamw(model.parameters())
    batches = iter(check_batches("gpt", 3))

    def step():
        for log in (timers.get("buckets"), timers.get("gathers")):
            if log is not None:
                log.clear()  # only this step's events
        batch = rank_slice(on_device(next(batches)), rank, n)
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = model_loss(model, batch)
        with record_function("backward"):
            started = time.perf_counter()  # inside the label: the same moment in the trace
            loss.backward()
            if technique == "dp":
                all_reduce_gradients(model)
        timers["backward"] = (started, time.perf_counter())
        with record_function("optimizer step"):
            optimizer.step()

    return step, timers


def _tensor(technique: str):
    from shardlib.checks.tensor import CHECK_GPT, build_check_gpt
    from shardlib.parallel.tensor_gpt import parallelize_gpt, sync_sequence_parallel_grads

    model = parallelize_gpt(build_check_gpt().to(current_device()), sequence_parallel=technique == "tp-sp")
    optimizer, batches = adamw(model.parameters()), iter(random_token_batches(CHECK_GPT, BATCH, 3))

    def step():
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = model_loss(model, on_device(next(batches)))
        with record_function("backward"):
            loss.backward()
            sync_sequence_parallel_grads(model)
        with record_function("optimizer step"):
            optimizer.step()

    return step, {}


def _pipeline(technique: str):
    from shardlib.checks.time import PIPELINE_GPT, VIRTUAL_STAGES
    from shardlib.parallel.pipeline import gpt_stage, pipeline_step
    from shardlib.parallel.schedules import schedule_interleaved_1f1b
    from shardlib.parallel.split_backward import split_weight_gradients

    s, p = dist.get_rank(), dist.get_world_size()
    model = build_gpt(PIPELINE_GPT, seed=0).to(current_device(), torch.float64)
    schedule = PIPELINES[technique]
    if schedule == "interleaved":
        stage = [gpt_stage(model, c * p + s, VIRTUAL_STAGES * p) for c in range(VIRTUAL_STAGES)]
        schedule = functools.partial(schedule_interleaved_1f1b, virtual_stages=VIRTUAL_STAGES)
    else:
        stage = gpt_stage(model, s, p)
        if schedule == "zero-bubble":
            split_weight_gradients(stage)
    chunks = stage if isinstance(stage, list) else [stage]
    optimizer = adamw([q for chunk in chunks for q in chunk.parameters()])
    m = 2 * p
    batches = iter(random_token_batches(PIPELINE_GPT, 2 * m, 3))
    timers = {}

    def step():
        optimizer.zero_grad(set_to_none=True)
        result = pipeline_step(stage, on_device(next(batches)), m, schedule)
        with record_function("optimizer step"):
            optimizer.step()
        timers.update(timeline=result.timeline, peak_stashed_bytes=result.peak_stashed_bytes)

    return step, timers


def _context(technique: str):
    from shardlib.checks.context import CHECK_GPT, METHODS, check_batches as cp_batches
    from shardlib.parallel.context_gpt import context_parallel_loss, sync_context_parallel_grads

    group = dist.group.WORLD
    model = build_gpt(CHECK_GPT, seed=0).to(current_device())
    optimizer, batches = adamw(model.parameters()), iter(cp_batches(3))

    def step():
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            share = context_parallel_loss(model, on_device(next(batches), torch.float32), group=group,
                                          method=METHODS[technique])
        with record_function("backward"):
            share.backward()
            sync_context_parallel_grads(model, group=group)
        with record_function("optimizer step"):
            optimizer.step()

    return step, {}


def _experts(technique: str):
    from shardlib.checks.experts import CHECK_GPT, check_batches as ep_batches, sizes
    from shardlib.mesh import Mesh
    from shardlib.parallel.experts import parallelize_gpt_experts, sync_expert_parallel_grads

    rank, world = dist.get_rank(), dist.get_world_size()
    ep, dp = sizes(technique, world)
    mesh = Mesh((dp, ep), ("dp", "ep"))
    model = parallelize_gpt_experts(build_gpt(CHECK_GPT, seed=0).to(current_device()), group=mesh.group("ep"))
    optimizer, batches = adamw(model.parameters()), iter(ep_batches(3))

    def step():
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = model_loss(model, rank_slice(on_device(next(batches), torch.float32), rank, world))
        with record_function("backward"):
            loss.backward()
            sync_expert_parallel_grads(model, group=dist.group.WORLD, data_group=mesh.group("dp") if dp > 1 else None)
        with record_function("optimizer step"):
            optimizer.step()

    return step, {}


TECHNIQUES = {**{name: _data_parallel for name in ("dp", "ddp", "zero1", "zero2", "zero3", "zero3-prefetch")},
              "tp": _tensor, "tp-sp": _tensor, **{name: _pipeline for name in PIPELINES},
              "cp-ring": _context, "cp-ulysses": _context, "ep": _experts, "ep-dp": _experts}
DEFAULT_WORLD_SIZE = {name: 4 if name == "ep-dp" else 2 for name in TECHNIQUES}
CHECK_FAMILY = {**{name: "ddp" for name in ("dp", "ddp")}, **{name: "zero" for name in ("zero1", "zero2", "zero3")},
                **{name: "time" for name in ("zero3-prefetch", "pp-interleaved", "pp-zero-bubble")},
                "tp": "tensor", "tp-sp": "tensor", **{name: "pipeline" for name in ("pp-naive", "pp-gpipe", "pp-1f1b")},
                "cp-ring": "context", "cp-ulysses": "context", "ep": "experts", "ep-dp": "experts"}


def world_size_error(technique: str, world_size: int) -> str | None:
    """Why `technique` cannot run on `world_size` ranks (its check's rule: the same models), or None."""
    if world_size < 1:
        return f"world size must be >= 1, got {world_size}"
    family = importlib.import_module(f"shardlib.checks.{CHECK_FAMILY[technique]}")
    rule = getattr(family, "world_size_error", None)
    return rule(technique, world_size) if rule else None


def traced_step(technique: str, out_dir: str, memory: bool = False) -> dict:
    """On each rank: build `technique`, warm up, trace one step into `out_dir`. Returns the ledger's calls
    per kind, the own timers, and the files."""
    step, timers = TECHNIQUES[technique](technique)
    for _ in range(2 if technique == "zero3-prefetch" else 1):
        step()
    dist.barrier()
    with trace(out_dir, memory=memory) as files:
        with comm_ledger() as ledger:
            step()
    return {"calls": {kind: row["calls"] for kind, row in ledger.summary().items()}, "timers": timers,
            "rank_file": str(files.rank_file), "merged": str(files.merged)}


def traced_steps(techniques: list[str], out_root: str, memory: bool = False) -> dict:
    """traced_step for each technique in turn, in one launch: {technique: result}, traces in out_root/technique."""
    return {name: traced_step(name, f"{out_root}/{name}", memory) for name in techniques}
