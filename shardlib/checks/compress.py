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

from shardlib.compress.quant import best_seconds, bytes_held, quantize_model
from shardlib.compress.quant_shard import shard_for_inference

# ---------------------------------------------------------------------------------
# `python -m shardlib verify --technique quant_shard`


def _sharded_outputs(model, idx, group=None):
    shard_for_inference(model, group)
    with torch.no_grad():
        return model(idx), bytes_held(model)


def verify_quant_shard(world_size: int, technique: str = "quant_shard") -> dict:
    """Sharded int8 and int4 GPTs on `world_size` ranks against the single-device quantized ones."""
    from shardlib.launch import launch
    from shardlib.models import build_gpt

    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    worst, detail = 0.0, []
    for bits, scheme, group_size in ((8, "per_channel", None), (4, "group", 32)):
        model = quantize_model(build_gpt(seed=0, n_embd=64, n_layer=2), bits, scheme, group_size)
        with torch.no_grad():
            reference = model(idx)
        results = launch(_sharded_outputs, world_size, args=(model, idx))
        worst = max([worst] + [(out - reference).abs().max().item() for out, _ in results])
        bytes_max = max(b for _, b in results)
        expected = sum(-(-t.numel() // world_size) * t.element_size()  # ceil(numel / N) elements each
                       for t in itertools.chain(model.parameters(), model.buffers()))
        worst = worst if bytes_max == expected else float("inf")
        detail.append(f"int{bits}: {bytes_held(model)} B on one device, max {bytes_max} B per rank")
    return {"passed": worst <= 1e-5, "max_abs_diff": worst, "max_rel_diff": worst / reference.abs().max().item(),
            "detail": "; ".join(detail)}


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
