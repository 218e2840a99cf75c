"""The single-device reference every technique is checked against.

A sharded run and this reference start from the same seed and see the same global
batches; data-parallel ranks each take a contiguous slice of the batch dimension.
After k optimizer steps their parameters must agree within the checks' tolerance
(shardlib/checks/harness.py: 1e-5 relative, in float64).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn as nn

Batch = tuple[torch.Tensor, torch.Tensor]


def rank_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's contiguous share of a global batch: (B, ...) -> (B/N, ...)."""
    x, y = batch
    if x.shape[0] % world_size:
        raise ValueError(f"global batch of {x.shape[0]} is not divisible by {world_size} ranks; "
                         f"use a multiple of {world_size}")
    per_rank = x.shape[0] // world_size
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def model_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean loss of the course's models: GPT returns it, the MLP is fit by mean squared error."""
    x, y = batch
    out = model(x, y) if x.dtype == torch.long else model(x)
    if isinstance(out, tuple):
        return out[1]
    return torch.nn.functional.mse_loss(out, y)


def train_reference(
    build_model: Callable[[], nn.Module],
    batches: Iterable[Batch],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = lambda p: torch.optim.AdamW(p, lr=1e-2),
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor] = model_loss,
    micro_batches: int = 1,
) -> tuple[nn.Module, list[float]]:
    """Train on one device, one optimizer step per global batch; return (model, losses).

    micro_batches > 1: each step accumulates the gradients of loss/m over the batch's m
    micro-batches in turn (the sums a pipeline makes, in its order) before stepping.
    """
    model = build_model()
    optimizer = make_optimizer(model.parameters())
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for micro_batch in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
            micro_loss = loss_fn(model, micro_batch) / micro_batches
            micro_loss.backward()
            loss += micro_loss.item()
        optimizer.step()
        losses.append(loss)
    return model, losses


def compare_state(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max absolute, max relative) difference over matching tensors; names and shapes must agree."""
    if set(ours) != set(reference):
        raise ValueError(f"state dicts differ in names: only ours {sorted(set(ours) - set(reference))}, "
                         f"only reference {sorted(set(reference) - set(ours))}")
    max_abs = max_rel = 0.0
    for name, ref in reference.items():
        ref = ref.detach().cpu()
        mine = ours[name].detach().to("cpu", ref.dtype)
        if mine.shape != ref.shape:
            raise ValueError(f"{name}: shape {tuple(mine.shape)} but the reference has {tuple(ref.shape)}")
        diff = (mine - ref).abs()
        max_abs = max(max_abs, diff.max().item())
        max_rel = max(max_rel, (diff.max() / ref.abs().max().clamp_min(1e-12)).item())
    return max_abs, max_rel
