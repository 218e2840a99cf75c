"""Megatron-Core's tensor-parallel layers on CPU ranks, beside shardlib's and one device (lesson 09).

Megatron-LM (Shoeybi et al., arXiv 1909.08053) as its library, Megatron-Core
(https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/tensor_parallel.html):
`ColumnParallelLinear(gather_output=False)` then `RowParallelLinear(input_is_parallel=True)`, the
MLP split of lesson 04. Both are loaded with slices of one nn.Linear pair, run forward and backward
on the same input, and compared with that pair on one device and with shardlib's layers.

Per rank (t tensor-parallel ranks, d model width, k hidden width): weights 2 d k / t + k / t + d
(the column bias is split, the row bias replicated). Communication, per pair, of b*s*d elements
each way: forward one all-reduce (g, after the row layer), backward one (f, the input's gradient);
2(t-1)/t * b s d elements sent per all-reduce on a ring.

On CPU: after init_process_group("gloo"), `parallel_state.initialize_model_parallel` works and the
layers need `ModelParallelConfig(use_cpu_initialization=True)`. `gather_output=True`,
`input_is_parallel=False` and sequence parallelism call `torch.cuda.current_device()` in Megatron-Core
0.16 (tensor_parallel/mappings.py) and fail without a GPU; the pair used here needs neither.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib.comm import comm_ledger
from shardlib.launch import current_device, launch
from shardlib.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_full_state_dict,
)

__all__ = ["NAME_MAP", "compare_tp_pair", "import_megatron"]


def import_megatron():
    """Import Megatron-Core quietly (it warns that Apex and Transformer Engine are absent; torch logs
    that no CUDA runtime is found): the pure-PyTorch fallbacks are what runs on CPU."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core
        from megatron.core import parallel_state, tensor_parallel  # noqa: F401  (imported here, warnings silenced)
    return megatron.core


def _full_pair(d: int, k: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, k), nn.GELU(), nn.Linear(k, d)).to(current_device())


def _megatron_pair(full: nn.Sequential, t: int):
    core = import_megatron()
    from megatron.core import tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(tensor_model_parallel_size=t, use_cpu_initialization=True,
                                 params_dtype=torch.float32)
    keep = lambda w: None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        col = tensor_parallel.ColumnParallelLinear(full[0].in_features, full[0].out_features, config=config,
                                                   init_method=keep, bias=True, gather_output=False)
        row = tensor_parallel.RowParallelLinear(full[2].in_features, full[2].out_features, config=config,
                                                init_method=keep, bias=True, input_is_parallel=True,
                                                skip_bias_add=False)
    rank = core.parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():  # Megatron marks the split dimension as shardlib does: param.partition_dim
        col.weight.copy_(full[0].weight.chunk(t, dim=0)[rank])  # (k/t, d)
        col.bias.copy_(full[0].bias.chunk(t, dim=0)[rank])  # (k/t,)
        row.weight.copy_(full[2].weight.chunk(t, dim=1)[rank])  # (d, k/t)
        row.bias.copy_(full[2].bias)  # (d,) replicated, added after the sum
    return col.to(current_device()), row.to(current_device())


def _run(forward, params: dict, x: torch.Tensor) -> dict:
    x = x.detach().clone().requires_grad_(True)
    with comm_ledger(record_torch=True) as ledger:
        y = forward(x)  # (B, T, d)
        (y * y).sum().backward()  # a loss whose gradient depends on every output
    return dict(y=y.detach(), x_grad=x.grad.detach(), ledger=ledger)


def _pair_on_rank(d: int, k: int, shape: tuple[int, int], seed: int) -> dict:
    core = import_megatron()
    warnings.filterwarnings("ignore", message="When using async grad allreduce")  # a CUDA stream hint
    t = dist.get_world_size()
    core.parallel_state.initialize_model_parallel(tensor_model_parallel_size=t)
    try:
        full = _full_pair(d, k, seed)
        x = torch.randn(*shape, d, generator=torch.Generator().manual_seed(seed + 1)).to(current_device())  # (B, T, d)
        one = _run(full, {}, x)
        one["grads"] = {"fc.weight": full[0].weight.grad, "fc.bias": full[0].bias.grad,
                        "proj.weight": full[2].weight.grad, "proj.bias": full[2].bias.grad}

        m_col, m_row = _megatron_pair(full, t)
        megatron = _run(lambda x: m_row(F.gelu(m_col(x)[0]))[0], {}, x)  # each layer returns (output, bias)
        ours_col = ColumnParallelLinear.from_linear(full[0])
        ours_row = RowParallelLinear.from_linear(full[2])
        ours = _run(lambda x: ours_row(F.gelu(ours_col(x))), {}, x)

        out = {}
        for name, run, (col, row) in (("megatron", megatron, (m_col, m_row)), ("shardlib", ours, (ours_col, ours_row))):
            grads = {f"{layer}.{key}": g for layer, module in (("fc", col), ("proj", row))
                     for key, g in gather_full_state_dict(module, grads=True).items() if key in ("weight", "bias")}
            out[name] = dict(y=run["y"].cpu(), x_grad=run["x_grad"].cpu(), grads={k: v.cpu() for k, v in grads.items()},
                             records=[(r.kind, r.nbytes, r.sent_bytes) for r in run["ledger"].records],
                             weight_numel=sum(p.numel() for p in (*col.parameters(), *row.parameters())))
        out["one_device"] = dict(y=one["y"].cpu(), x_grad=one["x_grad"].cpu(),
                                 grads={k: v.cpu() for k, v in one["grads"].items()},
                                 weight_numel=sum(p.numel() for p in full.parameters()))
        return out
    finally:
        core.parallel_state.destroy_model_parallel()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def compare_tp_pair(world_size: int, *, d: int = 32, k: int = 128, shape: tuple[int, int] = (4, 16),
                    seed: int = 0, timeout: float = 180, device: str = "auto") -> dict:
    """Megatron-Core's and shardlib's column->row pair on `world_size` ranks vs one device.

    Returns rank 0's view: {"max_rel": {what: largest relative difference}, "records": {library:
    [(kind, bytes, sent bytes)]}, "weights_per_rank": {library: elements}, "one_device_weights": n}.
    """
    if k % world_size:
        raise ValueError(f"the hidden width k={k} must split over t={world_size} ranks; pick k divisible by t")
    import_megatron()  # once, here: the forked ranks inherit it
    r = launch(_pair_on_rank, world_size, args=(d, k, shape, seed), timeout=timeout, device=device)[0]
    one = r["one_device"]
    max_rel = {}
    for name in ("megatron", "shardlib"):
        run = r[name]
        max_rel[f"{name} output vs one device"] = _relative(run["y"], one["y"])
        max_rel[f"{name} input grad vs one device"] = _relative(run["x_grad"], one["x_grad"])
        max_rel[f"{name} weight grads vs one device"] = max(_relative(run["grads"][n], g) for n, g in one["grads"].items())
    max_rel["megatron output vs shardlib"] = _relative(r["megatron"]["y"], r["shardlib"]["y"])
    return {"max_rel": max_rel, "records": {n: r[n]["records"] for n in ("megatron", "shardlib")},
            "weights_per_rank": {n: r[n]["weight_numel"] for n in ("megatron", "shardlib")},
            "one_device_weights": one["weight_numel"]}


# Megatron-Core name -> shardlib code -> the lesson that runs it
NAME_MAP = [
    ("tensor_parallel.ColumnParallelLinear", "parallel.tensor.ColumnParallelLinear", "04 §1, 09 (run here)"),
    ("tensor_parallel.RowParallelLinear", "parallel.tensor.RowParallelLinear", "04 §1, 09 (run here)"),
    ("copy_to_tensor_model_parallel_region (f)", "parallel.tensor.CopyToTensorParallelRegion / enter_tp_region",
     "04 §2"),
    ("reduce_from_tensor_model_parallel_region (g)", "parallel.tensor.ReduceFromTensorParallelRegion / exit_tp_region",
     "04 §2"),
    ("gather_from_tensor_model_parallel_region", "parallel.tensor.GatherFromTensorParallelRegion", "04 §2"),
    ("gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region",
     "parallel.tensor.GatherFromSequenceParallelRegion, ReduceScatterToSequenceParallelRegion", "04 §5"),
    ("ModelParallelConfig(sequence_parallel=True)", "parallel.tensor_gpt.parallelize_gpt(sequence_parallel=True)",
     "04 §5"),
    ("tensor_parallel.VocabParallelEmbedding", "parallel.tensor_gpt.VocabParallelEmbedding", "04 §3"),
    ("tensor_parallel.vocab_parallel_cross_entropy", "parallel.tensor_gpt.vocab_parallel_cross_entropy", "04 §3"),
    ("parallel_state.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=p)",
     "mesh.Mesh / training_mesh(dp, pp, tp): a group per dimension", "06 §1"),
    ("pipeline_parallel.get_forward_backward_func() (1F1B)", "parallel.pipeline.pipeline_step(schedule='1f1b')",
     "05 §4"),
    ("virtual_pipeline_model_parallel_size (interleaved 1F1B)",
     "parallel.schedules.bubble_formula: bubble (p-1)/(m+p-1); interleaved, (p-1)/(vm+p-1)", "05 §5"),
    ("DistributedDataParallel + distributed optimizer", "parallel.zero.ZeroOptimizer (ZeRO-1/2)", "03 §2-3"),
]
