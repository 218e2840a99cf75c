"""One interface over the three ZeRO stages, for code that compares them (lessons 03 and 06, the checks).

    optimizer = apply_zero(model, stage, torch.optim.AdamW, lr=1e-3)   # stage 1, 2: ZeroOptimizer
                                                                     # stage 3: fully_shard per block + root
    zero_full_state_dict(model, optimizer)   # the whole model, on every rank (a collective)
    zero_state_bytes(model, optimizer)       # what this rank holds: params, grads, optimizer, total

Per-rank model states (Psi parameters, N ranks, mixed-precision Adam; ZeRO, arXiv 1910.02054):
ZeRO-1 4 Psi + 12 Psi/N, ZeRO-2 2 Psi + 14 Psi/N, ZeRO-3 16 Psi/N (shardlib.memory).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlib import memory
from shardlib.parallel.fsdp import full_state_dict, fully_shard
from shardlib.parallel.zero import ZeroOptimizer

__all__ = ["apply_zero", "zero_full_state_dict", "zero_state_bytes", "n_flat_buffers"]


def apply_zero(model: nn.Module, stage: int, optimizer_class=torch.optim.AdamW, *, group=None,
                param_dtype: torch.dtype | None = None, bucket_cap_mb: float | None = None, **defaults):
    """Apply ZeRO `stage` (1, 2, 3) to a course model (it has `.blocks`); return its optimizer.

    Stage 3 shards each block and then the root (fully_shard), and builds a plain torch optimizer
    over the shards; stages 1 and 2 wrap the optimizer (ZeroOptimizer).
    """
    if stage == 3:
        for block in model.blocks:
            fully_shard(block, group=group, param_dtype=param_dtype)
        fully_shard(model, group=group, param_dtype=param_dtype, output_dtype=torch.float32 if param_dtype else None)
        return optimizer_class(model.parameters(), **defaults)
    return ZeroOptimizer(model, optimizer_class, stage=stage, group=group, param_dtype=param_dtype,
                         bucket_cap_mb=bucket_cap_mb, **defaults)


def zero_full_state_dict(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict (a collective: every rank calls it)."""
    return optimizer.full_state_dict() if isinstance(optimizer, ZeroOptimizer) else full_state_dict(model)


def zero_state_bytes(model: nn.Module, optimizer) -> dict:
    """Bytes this rank holds right now: dict(params, grads, optimizer, total), distinct storages."""
    if isinstance(optimizer, ZeroOptimizer):
        held = {kind: memory.unique_storage_bytes(ts) for kind, ts in optimizer.model_state_tensors().items()}
        return dict(held, total=sum(held.values()))
    measured = memory.model_state_bytes(model, optimizer)
    return {k: measured[k] for k in ("params", "grads", "optimizer", "total")}


def n_flat_buffers(model: nn.Module, optimizer) -> int:
    """How many flat buffers are padded (each by at most N-1 elements)."""
    if isinstance(optimizer, ZeroOptimizer):
        return len(optimizer.buckets)
    return sum(1 for m in model.modules() if getattr(m, "_fsdp_unit", None) is not None)
