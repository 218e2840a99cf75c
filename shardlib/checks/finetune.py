"""Benchmark of the fine-tune strategies (`python -m shardlib bench finetune`)."""

from __future__ import annotations

from shardlib.finetune.measure import measure_strategies


def bench_finetune(quick: bool = False) -> list[dict]:
    """Rows for `python -m shardlib bench finetune`: ours_s = the strategy's step time,
    torch_s = DDP's on the same ranks (both are PyTorch; the ratio is what sharding costs)."""
    rows = measure_strategies(world_sizes=(2,) if quick else (2, 4), steps=3 if quick else 5)
    return [{"benchmark": "finetune", "case": r["case"], "ours_s": r["step_time_s"], "torch_s": r["ddp_step_time_s"],
             "ratio": r["time_over_ddp"], "target": None, "measured_bytes": r["measured"]["total"],
             "predicted_bytes": int(r["predicted"]["total"]), "rest_bytes": r["rest_bytes"],
             "measured_over_predicted": round(r["measured_over_predicted"], 4)} for r in rows]


BENCHMARKS = {"finetune": bench_finetune}
