"""Benchmark of the planner (`python -m shardlib bench plan`): seconds to rank 10,000 layouts."""

from __future__ import annotations

import time

from shardlib.plan import Cluster, ModelSpec, plan


def bench_plan(quick: bool = False) -> list[dict]:
    """Seconds to enumerate, predict and rank 10,000 layouts. No PyTorch counterpart exists:
    torch_s is the 1 s target itself, so ratio <= 1 means the target is met."""
    spec, cluster = ModelSpec.preset("gpt3-175b"), Cluster.of(1536)
    runs = []
    for _ in range(1 if quick else 3):
        start = time.perf_counter()
        result = plan(spec, cluster, global_batch=1536)
        runs.append(time.perf_counter() - start)
    n = len(result.ranked) + len(result.rejected)
    per_10k = min(runs) * 10_000 / n
    return [{"benchmark": "plan", "case": f"gpt3-175b on 1536 GPUs: {n} layouts; s per 10k vs 1 s target",
             "ours_s": per_10k, "torch_s": 1.0, "ratio": per_10k, "target": 1.0, "layouts": n,
             "total_s": round(min(runs), 4)}]


BENCHMARKS = {"plan": bench_plan}
