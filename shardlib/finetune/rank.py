"""One rank of a fine-tuning job: its Accelerator, its wrapped or sharded model, the pieces of a step.

What a rank holds depends on the strategy (Psi parameters, N ranks, S ranks per shard group,
mixed-precision Adam; ZeRO, arXiv 1910.02054): DDP 16 Psi, SHARD_GRAD_OP 2 Psi + 14 Psi/N,
FULL_SHARD 16 Psi/N, HYBRID_SHARD 16 Psi/S (see shardlib.finetune.model). Two paths lead there:

    GPU (cuda)   Accelerate prepares the model: DDP, or its FSDP2 plugin (fully_shard per block,
                 bf16 or fp16 compute with fp32 shards, SHARDED_STATE_DICT); one GPU included
                 (a mesh of one rank: the same code path, nothing to split).
    CPU          Accelerate's multi-CPU mode has no FSDP: it would wrap the model in DDP. For the
                 sharded strategies we call fully_shard ourselves, with the same per-block wrapping
                 (shardlib.finetune.model.shard_model).

On both, the units are listed and each rank checks that it holds 1/S of every parameter.
Per step each rank sends 2 Psi (DDP's all-reduce; SHARD_GRAD_OP's all-gather and
reduce-scatter) or 3 Psi (FULL_SHARD: a second all-gather in backward).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlib.comm import ops
from shardlib.finetune.config import resolve_mixed_precision
from shardlib.finetune.data import eval_indices, tokenize
from shardlib.finetune.model import (
    block_class_names,
    check_sharded,
    fsdp_plugin,
    fsdp_units,
    make_mesh,
    shard_model,
    strategy_from_launch_env,
)

_forked = False  # True in a process forked after this module was imported


def _note_fork() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_note_fork)


def set_cpu_threads() -> None:
    """notebook_launcher and shardlib.launch fork the ranks, and OpenMP's thread pool does not
    survive a fork (pytorch/pytorch#17199): a forked rank computes with one thread. Telling
    Accelerate through OMP_NUM_THREADS keeps it from resetting the count (and warning)."""
    if _forked:
        torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def resolve_strategy(asked: str | None) -> str:
    """The strategy asked for, or the one the accelerate config set up; a clash is an error."""
    launched = strategy_from_launch_env()
    if asked is None:
        return launched or "FULL_SHARD"
    if launched is not None and launched != asked:
        raise ValueError(f"the accelerate config sets up {launched} but strategy {asked} was asked for; "
                         "drop --strategy, or launch with a config for that strategy")
    return asked


def replicate_size(asked: int | None, world_size: int) -> int:
    """HYBRID_SHARD replicas: as asked, else the accelerate config's, else one per node."""
    if asked:
        return asked
    from_env = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "0"))
    return from_env or world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def rank_mixed_precision(asked: str, device_type: str) -> str:
    """The mixed precision of this rank's device ("no", "bf16" or "fp16"); CUDA may start here."""
    if device_type != "cuda":
        return resolve_mixed_precision(asked, device_type)
    gpu = torch.cuda.current_device() if torch.cuda.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
    return resolve_mixed_precision(asked, device_type, torch.cuda.get_device_capability(gpu),
                                   torch.cuda.get_device_name(gpu))


def make_accelerator(config, strategy: str, device_type: str, world_size: int):
    from accelerate import Accelerator

    mixed = rank_mixed_precision(config.mixed_precision, device_type)
    kwargs = {"cpu": device_type == "cpu", "mixed_precision": mixed}
    if device_type == "cuda" and strategy != "DDP":
        layers = config.layer_cls_to_wrap.split(",") if config.layer_cls_to_wrap else None
        kwargs["fsdp_plugin"] = fsdp_plugin(strategy, activation_checkpointing=False, layer_cls_to_wrap=layers)
        if strategy == "HYBRID_SHARD":
            from accelerate.parallelism_config import ParallelismConfig

            replicas = replicate_size(config.replicate_size, world_size)
            kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=replicas,
                                                             dp_shard_size=world_size // replicas)
    elif device_type == "cpu":  # an accelerate config's mesh (HYBRID_SHARD): Accelerate refuses one on CPU
        os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)  # ranks; prepare_model shards itself
    accelerator = Accelerator(**kwargs)
    if not dist.is_initialized():  # one plain process (python -m, accelerate launch --cpu): a group of 1
        dist.init_process_group("gloo" if device_type == "cpu" else "nccl", store=dist.HashStore(),
                                rank=0, world_size=1)
    return accelerator


def enable_activation_checkpointing(model) -> None:
    """Recompute each block's activations in backward (non-reentrant: dropout replays exactly)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def prepare_model(config, strategy: str, accelerator, model, device_type: str, world_size: int):
    """Replicate or shard the model and build AdamW over what this rank holds.
    Returns (model, optimizer, units, shard_check); DDP has no units and no shard check."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)

    checkpointing = config.activation_checkpointing
    if checkpointing if checkpointing is not None else device_type == "cuda":
        enable_activation_checkpointing(model)
    replicas = replicate_size(config.replicate_size, world_size) if strategy == "HYBRID_SHARD" else 1
    if strategy == "DDP" or device_type == "cuda":  # Accelerate: DDP, or its FSDP2 plugin on GPUs
        model, optimizer = accelerator.prepare(model, adamw(model.parameters()))
        if strategy == "DDP":
            return model, optimizer, [], None
        return model, optimizer, fsdp_units(model), check_sharded(model, world_size // replicas)
    mesh = make_mesh(strategy, world_size, replicas, device_type)
    units = shard_model(model, strategy, mesh, block_class_names(model, config.layer_cls_to_wrap))
    shard_check = check_sharded(model, world_size // replicas)
    return model, adamw(model.parameters()), units, shard_check


# ---------------------------------------------------------------------------------
# the pieces of a step


def sync_gradients(model, sync: bool):
    """Reduce gradients on this backward (True), or only accumulate them locally (False)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def learning_rate(step: int, total_steps: int, lr: float, warmup_ratio: float) -> float:
    """Linear warm-up, then linear decay to 0: a function of the step, so nothing to checkpoint."""
    warmup = max(1, round(warmup_ratio * total_steps))
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup))


def all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)  # (len(values),)
    ops.all_reduce(t)
    return t.tolist()


def evaluate(model, tokenizer, split, config, device, rank: int, world_size: int) -> dict:
    """Accuracy and mean loss over a split; each rank scores 1/N of it, in lockstep."""
    n = len(split) if config.max_eval_examples is None else min(len(split), config.max_eval_examples)
    indices = eval_indices(n, rank, world_size)
    correct = total = loss_sum = 0.0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(indices), config.eval_batch_size):
            chunk = indices[start:start + config.eval_batch_size]
            valid = torch.tensor([i >= 0 for i in chunk], device=device)  # padding rows count for nothing
            rows = [max(i, 0) for i in chunk]
            batch = tokenize(tokenizer, [split.texts[i] for i in rows], config.max_length, device)
            labels = torch.tensor([split.labels[i] for i in rows], device=device)
            logits = model(**batch).logits.float()  # (b, n_labels)
            correct += ((logits.argmax(-1) == labels) & valid).sum().item()
            loss_sum += (F.cross_entropy(logits, labels, reduction="none") * valid).sum().item()
            total += valid.sum().item()
    model.train()
    correct, total, loss_sum = all_reduce_sum([correct, total, loss_sum], device)
    return {"accuracy": correct / total, "loss": loss_sum / total, "n": int(total)}


def memory_snapshot(model, optimizer) -> dict:
    """This rank's model states (shardlib.memory.model_state_bytes), with the parameters counted both as the
    model holds them and as the optimizer steps them. Under FSDP2 these are different tensors while a unit
    is gathered (SHARD_GRAD_OP from its forward to its backward, the root unit always): the gathered copy
    and the shard, both in memory. Under DDP, and for a resharded unit, they are the same tensors, counted once."""
    from shardlib.memory import model_state_bytes, unique_storage_bytes

    states = model_state_bytes(model, optimizer)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    states["params"] = unique_storage_bytes([*model.parameters(), *stepped])
    states["total"] = states["params"] + states["grads"] + states["optimizer"]
    return states


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def typical(times: list[float]) -> float | None:
    """Median step time, leaving out the first step (warm-up) when there are others."""
    times = sorted(times[1:] if len(times) > 1 else times)
    return times[len(times) // 2] if times else None
