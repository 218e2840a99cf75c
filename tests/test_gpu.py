"""The CUDA/NCCL paths, on a machine with NVIDIA GPUs: `python3 course.py test -m gpu`.

Skipped without usable GPUs. Whether there are any is read through NVML (shardlib.devices), never by
asking CUDA in pytest's own process: every test here forks ranks that need CUDA afterwards.
Tests for two ranks need two GPUs (two NCCL ranks cannot share one GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardlib
from shardlib import devices
from shardlib.examples import ring_allreduce

GPUS = devices.visible_gpus() if not devices.why_no_gpu() else []
WORLD_SIZES = [pytest.param(n, marks=pytest.mark.skipif(0 < len(GPUS) < n, reason=f"needs {n} GPUs, {len(GPUS)} here"))
               for n in (1, 2)]  # with no GPU at all, the module's own skip below says why

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPUS, reason=f"no usable NVIDIA GPU: {devices.why_no_gpu() or 'none visible'}")]


def describe_rank():
    """What a CUDA rank sees: its device, CUDA's own view of its GPU, and a collective's result."""
    device = shardlib.current_device()
    x = torch.full((4,), float(dist.get_rank() + 1), device=device)  # (4,)
    dist.all_reduce(x)  # NCCL: sum over ranks, on the GPU
    index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    return {"device": str(device), "tensor_device": str(x.device), "sum": x.tolist(),
            "bad_fork": torch.cuda._is_in_bad_fork(), "cuda_count": torch.cuda.device_count(),
            "capability": list(torch.cuda.get_device_capability(index)), "total_memory": properties.total_memory,
            "bf16": torch.cuda.is_bf16_supported(including_emulation=False),
            "backend": dist.get_backend()}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_launch_gives_each_rank_its_own_gpu_over_nccl(world_size):
    results = shardlib.launch(describe_rank, world_size, device="cuda", timeout=240)
    total = world_size * (world_size + 1) / 2
    for rank, seen in enumerate(results):
        assert seen["device"] == seen["tensor_device"] == f"cuda:{rank}", seen
        assert seen["backend"] == "nccl" and not seen["bad_fork"], seen
        assert seen["sum"] == [total] * 4, f"NCCL all_reduce gave {seen['sum']}, expected {total}"
    assert not torch.cuda.is_initialized(), "the launching process started CUDA"


def test_nvml_agrees_with_cuda_about_the_gpus():
    """What shardlib.devices read through NVML, against what CUDA itself says inside a rank."""
    (seen,) = shardlib.launch(describe_rank, 1, device="cuda", timeout=240)
    gpu = GPUS[0]
    assert seen["cuda_count"] == len(GPUS), f"CUDA sees {seen['cuda_count']} GPUs, NVML {len(GPUS)}"
    assert tuple(seen["capability"]) == gpu.capability, (seen["capability"], gpu)
    assert seen["bf16"] == gpu.native_bf16, (seen["bf16"], gpu)
    if gpu.total_memory is not None:  # CUDA reports a little less than NVML (memory the driver reserves)
        assert 0.9 * gpu.total_memory <= seen["total_memory"] <= gpu.total_memory, (seen["total_memory"], gpu)


def test_auto_picks_the_gpu_for_one_rank():
    (seen,) = shardlib.launch(describe_rank, 1, timeout=240)
    assert seen["device"] == "cuda:0" and seen["backend"] == "nccl", seen


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_all_reduce_on_nccl_matches_torch(world_size):
    results = shardlib.launch(ring_allreduce.compare, world_size, args=(1001,), device="cuda", timeout=240)
    for rank, result in enumerate(results):
        assert result["device"] == f"cuda:{rank}", result
        assert ring_allreduce.agrees(result), (
            f"rank {rank}: max|ours - torch| = {result['max_abs_diff']:.2e}, sent {result['sent_bytes']} B "
            f"against the ring formula's {result['ring_formula_bytes']} B")


@pytest.mark.parametrize("technique", ["ddp", "zero3", "tp"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_verify_on_cuda(technique, world_size):
    record = shardlib.verify(technique, world_size, device="cuda")
    assert record["passed"], (f"{technique} on {world_size} GPU(s): max rel diff {record['max_rel_diff']:.2e}; "
                              f"{record.get('detail', '')}\n{record.get('traceback', '')}")
