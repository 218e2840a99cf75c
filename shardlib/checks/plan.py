"""Benchmark of the planner (`python -m shardlib bench plan`): seconds to rank 10,000 layouts."""

from __future__ import annotations

import time

from shardlib.plan import Cluster, ModelSpec, plan

CASES = (  # (name, model, GPUs, global batch)
    ("gpt3-175b on 1536 GPUs", lambda: ModelSpec.preset("gpt3-175b"), 1536, 1536),
    # Megatron-LM's 1T GPT (arXiv 2104.04473, Table 1), the size that once overflowed
    ("1T GPT on 3072 GPUs", lambda: ModelSpec(128, 25600, 160, 51200, 2048, tied_embeddings=True, name="gpt-1t"),
     3072, 3072),
    ("mixtral-8x7b on 256 GPUs", lambda: ModelSpec.preset("mixtral-8x7b"), 256, 1024),
)


def bench_plan(quick: bool = False) -> list[dict]:
    """Seconds to enumerate, predict and rank 10,000 layouts. No PyTorch counterpart exists:
    torch_s is the 1 s target itself, so ratio <= 1 means the target is met."""
    rows = []
    for name, model, n_gpus, batch in CASES[:1] if quick else CASES:
        spec, cluster, runs = model(), Cluster.of(n_gpus), []
        for _ in range(1 if quick else 3):
            start = time.perf_counter()
            result = plan(spec, cluster, global_batch=batch)
            runs.append(time.perf_counter() - start)
        n = len(result.ranked) + len(result.rejected)
        per_10k = min(runs) * 10_000 / n
        rows.append({"benchmark": "plan", "case": f"{name}: {n} layouts; s per 10k vs 1 s target",
                     "ours_s": per_10k, "torch_s": 1.0, "ratio": per_10k, "target": 1.0, "layouts": n,
                     "total_s": round(min(runs), 4)})
    return rows


BENCHMARKS = {"plan": bench_plan}
