"""Checks and benchmark of the ring collectives (shardlib.comm.ring).

verify (`python -m shardlib verify --technique allreduce|allgather|reducescatter|broadcast`): ours
against torch.distributed's on shapes N does not divide; the ledger's bytes against the ring formula.
bench (`python -m shardlib bench allreduce`): ours beside torch.distributed.all_reduce, 1 and 16 MB.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardlib.comm import comm_ledger, ops, ring_all_gather, ring_all_reduce, ring_broadcast, ring_reduce_scatter
from shardlib.comm.cost import ring_sent_bytes
from shardlib.comm.ring import _padded_chunks
from shardlib.launch import launch

_SHAPES = [(1,), (7,), (1000,), (1001,), (5, 3), (4096,)]


def _check_against_torch(technique: str) -> tuple[float, float, bool]:
    """On every rank: run ours and torch.distributed's on the same inputs; compare.

    Returns (max abs diff, max relative diff, ledger bytes == ring formula for every shape).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    max_abs = max_rel = 0.0
    bytes_match = True
    for i, shape in enumerate(_SHAPES):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(100 * i + rank))
        with comm_ledger() as ledger:
            if technique == "allreduce":
                ours = ring_all_reduce(x.clone())
            elif technique == "allgather":
                ours = ring_all_gather(x)
            elif technique == "reducescatter":
                ours = ring_reduce_scatter(x)
            else:
                ours = ring_broadcast(x.clone(), src=n - 1)
        kind = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter"}.get(technique, "broadcast")
        numel_s = x.numel() * (n if technique == "allgather" else 1)  # S: all-gather's is its output
        expected_sent = ring_sent_bytes(kind, numel_s, n, x.element_size(), rank=rank, src=n - 1)
        bytes_match &= ledger.sent_bytes() == expected_sent
        if technique == "allreduce":
            reference = x.clone()
            dist.all_reduce(reference)
        elif technique == "allgather":
            reference = torch.empty(n * x.numel())
            ops.all_gather_into_tensor(reference, x.reshape(-1))
            reference = reference.view(n, *shape)
        elif technique == "reducescatter":
            padded = _padded_chunks(x, n)  # torch wants equal shards: pad, then cut ours' way
            shard = torch.empty(padded.shape[1])
            ops.reduce_scatter_tensor(shard, padded.reshape(-1))
            reference = shard[: ours.numel()]
        else:
            reference = x.clone()
            dist.broadcast(reference, src=n - 1)
        if ours.shape != reference.shape:
            return float("inf"), float("inf"), False
        diff = (ours - reference).abs()
        if diff.numel():
            max_abs = max(max_abs, diff.max().item())
            max_rel = max(max_rel, (diff / reference.abs().clamp_min(1e-6)).max().item())
    return max_abs, max_rel, bytes_match


def verify_collective(world_size: int, technique: str = "allreduce") -> dict:
    """Ours vs torch.distributed on shapes N does not divide; ledger bytes vs the ring formula."""
    results = launch(_check_against_torch, world_size, args=(technique,), timeout=60)
    max_abs = max(r[0] for r in results)
    max_rel = max(r[1] for r in results)
    bytes_ok = all(r[2] for r in results)
    passed = max_abs <= 1e-5 and bytes_ok
    return {"passed": passed, "max_abs_diff": max_abs, "max_rel_diff": max_rel,
            "detail": "ledger bytes = ring formula" if bytes_ok else "ledger bytes DIFFER from the ring formula"}


def _time_allreduces(numel: int, repeats: int) -> dict[str, float]:
    """Median seconds of ours and torch's all-reduce, interleaved so both see the same machine."""
    x = torch.randn(numel)
    times = {"ours": [], "torch": []}
    for name, op in (("ours", ring_all_reduce), ("torch", dist.all_reduce)):  # warm-up
        op(x.clone())
    for _ in range(repeats):
        for name, op in (("ours", ring_all_reduce), ("torch", dist.all_reduce)):
            y = x.clone()
            dist.barrier()
            start = time.perf_counter()
            op(y)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


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
