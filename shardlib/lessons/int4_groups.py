"""Lesson 07's question: why can int4 in groups of 32 come out worse than groups of 64 on the small GPT?

Finer groups give each weight a smaller scale, so every layer's squared reconstruction error falls with
the group size g. Whether the model's output follows depends on where the errors land. This module
measures it on one trained model, against its own fp32 outputs:

    held_out_windows(tokens, T)   the whole held-out text as non-overlapping (n, T) windows: more text
                                  than a few random windows, and no window counted twice
    logit_kl(model, reference)    mean over tokens of KL(reference || model) of the next-token
                                  distributions: 0 for the same outputs, and unlike perplexity it
                                  cannot improve by luck
    int4_study(model, windows)    perplexity and KL for int4 in groups of g, with the embedding tables
                                  in int4 too, in int8 (one scale per row) instead, with fp16 scales;
                                  and one module at a time: its KL and its weight's squared error

Memory and communication: none of the course's; it quantizes one model on one device (bits per weight:
shardlib.compress.quant, `4 + 32/g` for int4 in groups of g with fp32 scales).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlib.compress.quality import device_of
from shardlib.compress.quant import dequantize, quantize, quantize_model

__all__ = ["held_out_windows", "logit_kl", "int4_study", "embedding_names"]


def held_out_windows(tokens: torch.Tensor, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(inputs, targets)]: every token of `tokens` once, in n = (len - 1) // seq_len windows of (n, T)."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens make no window of {seq_len} (+1 for the targets)")
    x = tokens[: n * seq_len].view(n, seq_len)  # (n, T)
    y = tokens[1: n * seq_len + 1].view(n, seq_len)  # (n, T) the next token of each
    return [(x, y)]


@torch.no_grad()
def _logits_and_loss(model: nn.Module, windows) -> tuple[list[torch.Tensor], float]:
    device = device_of(model)
    logits, losses, count = [], 0.0, 0
    for x, y in windows:
        out = model(x.to(device))  # (n, T, V)
        logits.append(F.log_softmax(out.float(), dim=-1))
        losses += F.cross_entropy(out.float().flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
        count += y.numel()
    return logits, losses / count


@torch.no_grad()
def logit_kl(model: nn.Module, reference_log_probs: list[torch.Tensor], windows) -> tuple[float, float]:
    """(perplexity, mean KL(reference || model) per token) on `windows`."""
    log_probs, loss = _logits_and_loss(model, windows)
    kl = sum(F.kl_div(lp, ref, log_target=True, reduction="sum").item() for lp, ref in zip(log_probs, reference_log_probs))
    return math.exp(loss), kl / sum(y.numel() for _, y in windows)


def embedding_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Embedding)]


def _int4_int8_embeddings(model: nn.Module, group_size: int) -> nn.Module:
    """Every Linear in int4 groups, every embedding table in int8 with one scale per row."""
    q = quantize_model(model, 4, "group", group_size)  # Linear only
    return quantize_model(q, 8, "per_channel", embeddings=True, targets=embedding_names(model), inplace=True)


def int4_study(model: nn.Module, windows, group_sizes=(16, 32, 64)) -> dict:
    """Perplexity and KL to the fp32 model for int4 variants in groups of each g, on `windows`.

    Returns {"fp32": ppl, "int4": {g: (ppl, kl)}, "int4, int8 embeddings": {g: (ppl, kl)},
    "int4, fp16 scales": {g: (ppl, kl)}, "per module": {name: {g: (kl, squared error of its weight)}}}.
    """
    reference, loss = _logits_and_loss(model, windows)
    out = {"fp32": math.exp(loss), "int4": {}, "int4, int8 embeddings": {}, "int4, fp16 scales": {}, "per module": {}}
    for g in group_sizes:
        out["int4"][g] = logit_kl(quantize_model(model, 4, "group", g, embeddings=True), reference, windows)
        out["int4, int8 embeddings"][g] = logit_kl(_int4_int8_embeddings(model, g), reference, windows)
        out["int4, fp16 scales"][g] = logit_kl(quantize_model(model, 4, "group", g, embeddings=True,
                                                              scale_dtype=torch.float16), reference, windows)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        w = module.weight.detach()  # (out, in) or (V, C): groups run along the rows
        out["per module"][name] = {}
        for g in group_sizes:
            squared_error = (dequantize(*quantize(w, 4, "group", g), 4) - w.float()).square().sum().item()
            one = quantize_model(model, 4, "group", g, embeddings=True, targets=[name])
            out["per module"][name][g] = (logit_kl(one, reference, windows)[1], squared_error)
    return out
