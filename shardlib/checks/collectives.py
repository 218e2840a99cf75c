"""Checks and benchmark of the ring collectives (shardlib.comm.ring).

verify (`python -m shardlib verify --technique allreduce|allgather|reducescatter|broadcast`): ours
against torch.distributed's on shapes N does not divide; the ledger's bytes against the ring formula.
bench (`python -m shardlib bench allreduce`): ours beside torch.distributed.all_reduce, 1 and 16 MB.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlib.checks.harness import TOLERANCE, launch_on
from shardlib.comm import comm_ledger, ops, ring_all_gather, ring_all_reduce, ring_broadcast, ring_reduce_scatter
from shardlib.comm.cost import ring_sent_bytes
from shardlib.launch import current_device, launch
from shardlib.timing import interleaved_times

_SHAPES = [(1,), (7,), (1000,), (1001,), (5, 3), (4096,)]
_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
          "broadcast": "broadcast"}


def _ours(technique: str, x: torch.Tensor, src: int) -> torch.Tensor:
    if technique == "allreduce":
        return ring_all_reduce(x.clone())
    if technique == "allgather":
        return ring_all_gather(x)
    if technique == "reducescatter":
        return ring_reduce_scatter(x)
    return ring_broadcast(x.clone(), src=src)


def _torchs(technique: str, x: torch.Tensor, src: int, shard_numel: int) -> torch.Tensor:
    """torch.distributed's result for the same call (reduce-scatter: ours' shard of the flat sum)."""
    n = dist.get_world_size()
    if technique == "allgather":
        gathered = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        ops.all_gather_into_tensor(gathered, x.reshape(-1))
        return gathered.view(n, *x.shape)
    if technique == "reducescatter":  # torch wants equal shards: zero-pad to N*c, c = ceil(numel / N)
        c = -(-x.numel() // n)
        shard = torch.empty(c, dtype=x.dtype, device=x.device)
        ops.reduce_scatter_tensor(shard, F.pad(x.reshape(-1), (0, n * c - x.numel())))  # (N*c,) -> (c,)
        return shard[:shard_numel]
    reference = x.clone()
    if technique == "broadcast":
        ops.broadcast(reference, src=src)
    else:
        ops.all_reduce(reference)
    return reference


def _check_against_torch(technique: str) -> tuple[float, float, bool]:
    """On every rank: run ours and torch.distributed's on the same inputs; compare.

    Returns (max abs diff, max relative diff, ledger bytes == ring formula for every shape).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    src = n - 1
    max_abs = max_rel = 0.0
    bytes_match = True
    for i, shape in enumerate(_SHAPES):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(100 * i + rank)).to(current_device())
        with comm_ledger() as ledger:
            ours = _ours(technique, x, src)
        numel_s = x.numel() * (n if technique == "allgather" else 1)  # S: all-gather's is its output
        expected_sent = ring_sent_bytes(_KINDS[technique], numel_s, n, x.element_size(), rank=rank, src=src)
        bytes_match &= ledger.sent_bytes() == expected_sent
        reference = _torchs(technique, x, src, ours.numel())
        if ours.shape != reference.shape:
            return float("inf"), float("inf"), False
        if ours.numel():  # the harness's measure: max |diff| over max |reference|, per tensor
            diff = (ours - reference).abs().max().item()
            max_abs, max_rel = max(max_abs, diff), max(max_rel, diff / reference.abs().max().item())
    return max_abs, max_rel, bytes_match


def verify_collective(world_size: int, technique: str = "allreduce", device: str = "cpu") -> dict:
    """Ours vs torch.distributed on shapes N does not divide; ledger bytes vs the ring formula."""
    if technique not in _KINDS:
        raise ValueError(f"technique must be one of {sorted(_KINDS)}, got {technique!r}")
    results = launch_on(_check_against_torch, world_size, args=(technique,), device=device, timeout=60)
    max_abs = max(r[0] for r in results)
    max_rel = max(r[1] for r in results)
    bytes_ok = all(r[2] for r in results)
    passed = max_rel <= TOLERANCE and bytes_ok
    return {"passed": passed, "max_abs_diff": max_abs, "max_rel_diff": max_rel,
            "detail": "ledger bytes = ring formula" if bytes_ok else "ledger bytes DIFFER from the ring formula"}


def _time_allreduces(numel: int, repeats: int) -> dict[str, float]:
    """Median seconds of ours and torch's all-reduce, interleaved so both see the same machine."""
    x = torch.randn(numel)
    return interleaved_times({"ours": lambda: ring_all_reduce(x.clone()), "torch": lambda: dist.all_reduce(x.clone())},
                             repeats, sync=dist.barrier)


def bench_allreduce(quick: bool = False, world_size: int = 4) -> list[dict]:
    """From-scratch ring all-reduce vs torch.distributed.all_reduce (gloo), 1 MB and 16 MB."""
    rows = []
    for megabytes in (1, 16):
        numel = megabytes * 2**20 // 4
        repeats = 3 if quick else 15
        per_rank = launch(_time_allreduces, world_size, args=(numel, repeats), timeout=600)
        ours = max(r["ours"] for r in per_rank)  # a collective ends when its slowest rank does
        theirs = max(r["torch"] for r in per_rank)
        rows.append({"benchmark": "allreduce", "case": f"{megabytes} MB fp32, N={world_size} gloo",
                     "ours_s": ours, "torch_s": theirs, "ratio": ours / theirs,
                     "target": 1.5 if megabytes == 16 else None})
    return rows


CHECKS = {name: (verify_collective, (1, 2, 3, 4)) for name in ("allreduce", "allgather", "reducescatter", "broadcast")}
BENCHMARKS = {"allreduce": bench_allreduce}
