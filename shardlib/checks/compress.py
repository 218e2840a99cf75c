"""Checks and benchmark of shardlib.compress.

verify (`--technique quant_shard`): int8 and int4 GPTs sharded over N ranks against the same quantized
model on one device; bytes per rank against ceil(numel/N) of every tensor.
bench (`python -m shardlib bench quant`): the from-scratch quantized encoder beside torch.ao's dynamic int8.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn as nn

from shardlib.checks.harness import TOLERANCE, launch_on, verdict
from shardlib.compress.quant import best_seconds, bytes_held, quantize_model
from shardlib.compress.quant_shard import shard_for_inference
from shardlib.launch import current_device
from shardlib.models import build_gpt

# ---------------------------------------------------------------------------------
# `python -m shardlib verify --technique quant_shard`


def _sharded_against_unsharded(model, idx) -> dict:
    """On this rank's device: the quantized model's logits whole, then sharded; bytes this rank holds."""
    model, idx = model.to(current_device()), idx.to(current_device())
    with torch.no_grad():
        reference = model(idx)  # (B, T, V) before sharding: the single-device quantized model
        shard_for_inference(model)
        out = model(idx)  # (B, T, V), every leaf gathered as it runs
    diff = (out - reference).abs().max().item()
    return {"max_abs_diff": diff, "max_rel_diff": diff / reference.abs().max().item(), "bytes": bytes_held(model)}


def verify_quant_shard(world_size: int, technique: str = "quant_shard", device: str = "cpu") -> dict:
    """Sharded int8 and int4 GPTs on `world_size` ranks against the same quantized models unsharded."""
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    comparisons, problems, notes = [], [], []
    for bits, scheme, group_size in ((8, "per_channel", None), (4, "group", 32)):
        model = quantize_model(build_gpt(seed=0, n_embd=64, n_layer=2), bits, scheme, group_size)
        results = launch_on(_sharded_against_unsharded, world_size, args=(model, idx), device=device, timeout=120)
        comparisons += [dict(r, passed=r["max_rel_diff"] <= TOLERANCE) for r in results]
        bytes_max = max(r["bytes"] for r in results)
        expected = sum(-(-t.numel() // world_size) * t.element_size()  # ceil(numel / N) elements each
                       for t in itertools.chain(model.parameters(), model.buffers()))
        notes.append(f"int{bits}: {bytes_held(model)} B on one device, max {bytes_max} B per rank "
                     f"(ceil(numel/N) per tensor: {expected} B)")
        if bytes_max != expected:
            problems.append(f"int{bits}: BYTES PER RANK DIFFER from the formula")
    return verdict(comparisons, notes, problems)


# ---------------------------------------------------------------------------------
# `python -m shardlib bench quant`


def bench_quant(quick: bool = False, model_id: str | None = None, n_sentences: int = 64) -> list[dict]:
    """all-MiniLM-L6-v2 on a batch of the course's sentences: our QuantLinear vs fp32 vs torch's int8.

    Linear layers only, as PyTorch's own int8 path does: eager dynamic quantization (int8
    weights, activations quantized per batch, int8 GEMM kernels), deprecated but still present.
    """
    import warnings

    from shardlib.compress.quality import load_encoder, load_sentences

    model, tokenizer = load_encoder(model_id)
    batch = tokenizer(load_sentences()[:n_sentences], padding=True, return_tensors="pt")
    repeats = 3 if quick else 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notice of torch.ao.quantization
        torch_int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    ours = {label: quantize_model(model, bits, scheme, g) for label, bits, scheme, g in
            (("int8 per_channel", 8, "per_channel", None), ("int4 group 128", 4, "group", 128))}
    best = best_seconds({"fp32": model, "torch.ao int8": torch_int8, **ours}, batch, repeats)
    rows = []
    for label, quantized in ours.items():
        rows.append({"benchmark": "quant", "case": f"ours {label} / fp32 Linear", "ours_s": best[label],
                     "torch_s": best["fp32"], "ratio": best[label] / best["fp32"], "target": None,
                     "ours_bytes": bytes_held(quantized), "torch_bytes": bytes_held(model)})
    label = "int8 per_channel"
    rows.append({"benchmark": "quant", "case": f"ours {label} / torch.ao int8", "ours_s": best[label],
                 "torch_s": best["torch.ao int8"], "ratio": best[label] / best["torch.ao int8"], "target": None})
    return rows


CHECKS = {"quant_shard": (verify_quant_shard, (1, 2, 3, 4))}
BENCHMARKS = {"quant": bench_quant}
