"""Lesson 03's memory picture: bytes each rank holds under ZeRO-1, 2 and 3, measured beside the formulas.

Per rank, mixed-precision Adam (ZeRO, arXiv 1910.02054, Figure 1): ZeRO-1 4 Psi + 12 Psi/N, ZeRO-2
2 Psi + 14 Psi/N, ZeRO-3 16 Psi/N bytes; the measurement sends what each stage sends (2 or 3 (N-1)/N Psi
elements per step) but only reads the bytes held. Each rank builds on `current_device()`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlib import memory
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt
from shardlib.parallel.zero_stages import apply_zero, zero_state_bytes
from shardlib.reference import model_loss

__all__ = ["measure_zero_memory", "plot_zero_memory"]


def _held_by_stage(config: GPTConfig, param_dtype) -> dict:
    """Bytes this rank holds after one step, for stages 1, 2, 3 on the same model."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), generator=g).to(current_device())
    held = {}
    for stage in (1, 2, 3):
        model = build_gpt(config, seed=0).to(current_device())
        optimizer = apply_zero(model, stage, torch.optim.AdamW, lr=1e-3, param_dtype=param_dtype)
        model_loss(model, (tokens[:, :-1], tokens[:, 1:])).backward()
        optimizer.step()
        held[stage] = zero_state_bytes(model, optimizer)
    return held


def measure_zero_memory(config: GPTConfig | None = None, world_sizes=(1, 2, 3, 4),
                        param_dtype: torch.dtype | None = torch.bfloat16, device: str = "auto") -> dict:
    """{N: {stage: dict(params, grads, optimizer, total)}}: the largest rank's bytes after a step,
    on ranks launched on `device` ("auto", "cpu" or "cuda", as shardlib.launch)."""
    config = config or GPTConfig(seq_len=64, n_layer=4, n_head=4, n_embd=128)
    measured = {}
    for n in world_sizes:
        per_rank = launch(_held_by_stage, n, args=(config, param_dtype), timeout=300, device=device)
        measured[n] = {stage: max((r[stage] for r in per_rank), key=lambda h: h["total"]) for stage in (1, 2, 3)}
    return measured


def plot_zero_memory(measured: dict, n_params: int, recipe: str = "mixed_adam", max_world_size: int = 8, ax=None):
    """Per-rank model-state bytes by stage: measured bars (N in `measured`), formula markers N = 1..max."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 4.5))[1]
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    width, mb = 0.25, 1e6
    ns = list(range(1, max_world_size + 1))
    ddp = memory.zero_model_state_bytes(n_params, 1, 0, recipe)["total"] / mb
    ax.axhline(ddp, color="gray", linestyle="--", linewidth=1, label=f"DDP, any N ({ddp:.1f} MB)")
    for stage, color in colors.items():
        offset = (stage - 2) * width
        formula = [memory.zero_model_state_bytes(n_params, n, stage, recipe)["total"] / mb for n in ns]
        ax.plot([n + offset for n in ns], formula, "D", color=color, markeredgecolor="black", markersize=6,
                label=f"ZeRO-{stage} formula")
        bars = [(n + offset, measured[n][stage]["total"] / mb) for n in sorted(measured)]
        ax.bar([x for x, _ in bars], [y for _, y in bars], width=width, color=color, alpha=0.6,
               label=f"ZeRO-{stage} measured")
    ax.set_xticks(ns)
    ax.set_xlabel("N (data-parallel ranks)")
    ax.set_ylabel("model states per rank (MB)")
    ax.set_title(f"Per-rank memory by ZeRO stage, Psi = {n_params / 1e6:.2f}M, {recipe}")
    ax.set_ylim(0, ddp * 1.35)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=2, loc="upper right")
    return ax
