"""Measure what each strategy costs a rank: model-state bytes (against the ZeRO formulas) and step time.

Per-rank model states, ZeRO (arXiv 1910.02054) with K bytes of optimizer state per
parameter. FSDP2 keeps fp32 shards, fp32 gradients and fp32 Adam moments on every device
(on GPUs it computes in bf16/fp16 from gathered 16-bit copies), so the states follow the
"fp32_adam" recipe, 4 + 4 + 8 bytes per parameter, at a step's peak:

    DDP (stage 0)            (4 + 4 + 8) Psi
    SHARD_GRAD_OP (stage 2)  g Psi + (4 + 4 + 8) Psi / N     g = 4 in fp32, 2 with 16-bit compute
    FULL_SHARD (stage 3)     (4 + 4 + 8) Psi / N

SHARD_GRAD_OP holds every unit's gathered parameters from its forward to its backward (ZeRO-2's
whole parameters, g Psi) and, beside them, the fp32 shards the optimizer steps (4 Psi / N): two
tensors, where ZeRO-2 in fp32 keeps only the whole parameters, its own master (4 Psi + 12 Psi / N).
After the backward FSDP2 reshards, so at rest (after the step) it holds what FULL_SHARD holds:
`rest_bytes` shows that. `fsdp2_model_state_bytes` is the formula.

The measurement counts real tensors on each rank (shardlib.finetune.rank.memory_snapshot: the
parameters the module holds and those the optimizer steps, local shards of DTensors, each storage
once) at three moments of the last step: after the forward (gathered parameters included), after
the backward (gradients), after the optimizer step (Adam's moments). Each category at its largest is
held against the formula. On GPUs `max_memory_allocated` adds the real peak: states, activations, buffers.
"""

from __future__ import annotations

import tempfile

from shardlib.launch import launch
from shardlib.memory import zero_model_state_bytes

MEASURED_STRATEGIES = ("DDP", "SHARD_GRAD_OP", "FULL_SHARD")
MOMENTS = ("after_forward", "after_backward", "after_step")


def fsdp2_model_state_bytes(n_params: float, world_size: int, strategy: str, gathered_bytes: int = 4) -> dict:
    """Model states one rank holds at a step's peak under `strategy` with FSDP2 (DDP: PyTorch's DDP): the
    ZeRO stage's fp32_adam states, plus, for SHARD_GRAD_OP, the fp32 parameter shards beside the gathered
    copies (gathered_bytes per parameter: 4 in fp32, 2 with 16-bit compute). dict(params, grads, optimizer, total)."""
    from shardlib.finetune.config import ZERO_STAGE

    stage = ZERO_STAGE[strategy]
    states = dict(zero_model_state_bytes(n_params, world_size, stage, recipe="fp32_adam"))
    if stage == 2:
        states["params"] = gathered_bytes * n_params + 4 * n_params / world_size  # gathered copies + fp32 shards
        states["total"] = states["params"] + states["grads"] + states["optimizer"]
    return states


def _peak_states(memory: dict) -> dict:
    """Each model state at its largest over the measured moments of a step."""
    peak = {key: max(memory[m][key] for m in MOMENTS) for key in ("params", "grads", "optimizer")}
    peak["total"] = sum(peak.values())
    return peak


def measure_strategy(strategy: str, world_size: int, steps: int = 4, max_length: int = 16, batch_size: int = 8,
                     seed: int = 0, device: str = "cpu", **overrides) -> dict:
    """Train `steps` steps on `world_size` ranks of `device` ("cpu", "cuda" or "auto"); return per-rank
    bytes, the prediction, step time, losses (and on GPUs the peak of torch.cuda.max_memory_allocated)."""
    from shardlib.finetune.config import FinetuneConfig
    from shardlib.finetune.train import train

    with tempfile.TemporaryDirectory() as out:
        config = FinetuneConfig(strategy=strategy, output_dir=out, max_steps=steps, max_length=max_length,
                                batch_size=batch_size, seed=seed, evaluate=False, progress="none",
                                measure_memory=steps, device=device, **overrides)  # the last step: fp16's
        # gradient scaler may skip the first steps (and Adam's state with them)
        results = launch(train, world_size, args=(config,), device=device, timeout=900)
    n_params = results[0]["n_params"]
    measured = [_peak_states(r["memory"]) for r in results]
    largest = max(measured, key=lambda m: m["total"])
    gathered = 2 if results[0]["mixed_precision"] in ("bf16", "fp16") else 4
    predicted = fsdp2_model_state_bytes(n_params, world_size, strategy, gathered_bytes=gathered)
    return {
        "case": f"{strategy} N={world_size}", "strategy": strategy, "world_size": world_size, "n_params": n_params,
        "measured": largest, "predicted": predicted,
        "measured_over_predicted": largest["total"] / predicted["total"],
        "rest_bytes": max(r["memory"]["after_step"]["total"] for r in results),
        "step_time_s": max(r["step_time_s"] for r in results),
        "losses": [h["loss"] for h in results[0]["history"]],
        "device": results[0]["device"].split(":")[0], "mixed_precision": results[0]["mixed_precision"],  # cpu | cuda
        "max_memory_allocated": max((r.get("max_memory_allocated") or 0 for r in results), default=0) or None,
    }


def measure_strategies(world_sizes=(2, 4), strategies=MEASURED_STRATEGIES, steps: int = 4, **kwargs) -> list[dict]:
    """measure_strategy for each (world size, strategy), with each step time over DDP's."""
    rows = []
    for world_size in world_sizes:
        same_n = [measure_strategy(s, world_size, steps=steps, **kwargs) for s in strategies]
        ddp = next((r for r in same_n if r["strategy"] == "DDP"), None)
        for row in same_n:
            row["ddp_step_time_s"] = ddp["step_time_s"] if ddp else None
            row["time_over_ddp"] = row["step_time_s"] / ddp["step_time_s"] if ddp else None
        rows.extend(same_n)
    return rows
