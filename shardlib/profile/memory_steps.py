"""Memory over time, traced: ZeRO-3's gathered-and-freed parameters, a pipeline's stash (lesson 13, tests).

    zero3_memory(prefetch, out_dir)      on each rank: n Linear units, fully_shard-ed, one traced forward
                                         and backward with profile_memory; returns what the prediction needs
    pipeline_memory(schedule, out_dir)   on each rank: one stage of a GPT, one traced pipeline step

Predictions (held against the traces' peaks by the tests and lesson 13):

    ZeRO-3 forward   shardlib.memory.zero3_forward_peak_bytes: one gathered unit (two with prefetch),
                     gloo's staging copy of the unit being gathered, the activations (b w e per unit)
    pipeline stage   stash_formula(p, m, s) micro-batches, each L_s layers of activation_elements(...,
                     attention="sdpa") plus the (b/m) s h output sent on, and the stage's gradients (Psi_s e)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from shardlib.launch import current_device
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.profile.record import trace

__all__ = ["ZERO3_UNITS", "PIPELINE_GPT", "zero3_memory", "pipeline_memory", "pipeline_stash_bytes"]

ZERO3_UNITS = dict(n_units=4, width=512, batch=4)  # 4 units of 1 MiB (fp32): the parameters dominate
PIPELINE_GPT = GPTConfig(seq_len=128, n_layer=16, n_head=4, n_embd=32)  # activations dominate the parameters


def zero3_memory(prefetch: bool, out_dir: str, n_units: int = 4, width: int = 512, batch: int = 4) -> dict:
    from shardlib.parallel.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n_units)]).to(current_device())
    for unit in model:
        fully_shard(unit, prefetch=prefetch)
    fully_shard(model, prefetch=prefetch)  # the root records the order prefetch follows
    x = torch.randn(batch, width, device=current_device())  # (b, w)
    for _ in range(2):  # the second step prefetches in the order of the first
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    with trace(out_dir, memory=True) as files:
        with record_function("forward"):
            loss = model(x).square().mean()
        with record_function("backward"):
            loss.backward()
    return {"merged": str(files.merged), "unit_numels": [width * width] * n_units, "element_size": 4,
            "activation_bytes": n_units * batch * width * 4}


def pipeline_memory(schedule: str, out_dir: str, n_microbatches: int = 4, batch_per_microbatch: int = 2) -> dict:
    from shardlib.parallel.pipeline import gpt_stage, pipeline_step

    s, p = dist.get_rank(), dist.get_world_size()
    stage = gpt_stage(build_gpt(PIPELINE_GPT, seed=0).to(current_device()), s, p)
    batch = random_token_batches(PIPELINE_GPT, batch_per_microbatch * n_microbatches, 1)[0]
    batch = tuple(t.to(current_device()) for t in batch)
    pipeline_step(stage, batch, n_microbatches, schedule, measure_memory=False)  # warm-up
    stage.zero_grad(set_to_none=True)
    with trace(out_dir, memory=True) as files:
        pipeline_step(stage, batch, n_microbatches, schedule, measure_memory=False)
    return {"merged": str(files.merged), "layers": len(stage.blocks), "params": sum(q.numel() for q in stage.parameters()),
            "is_last": stage.is_last}


def pipeline_stash_bytes(schedule: str, p: int, m: int, stage_index: int, layers: int, params: int,
                         batch_per_microbatch: int = 2, config: GPTConfig = PIPELINE_GPT, element_size: int = 4) -> int:
    """The predicted peak of a (non-last) stage: its stash of micro-batches, their outputs sent on, its gradients."""
    from shardlib.parallel.recompute import activation_elements
    from shardlib.parallel.schedules import stash_formula

    s, b, h, a = config.seq_len, batch_per_microbatch, config.n_embd, config.n_head
    per_microbatch = layers * activation_elements(s, b, h, a, None, attention="sdpa") + s * b * h  # + the output sent
    return stash_formula(p, m, stage_index, schedule) * per_microbatch * element_size + params * element_size
