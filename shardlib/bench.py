"""`python -m shardlib bench`: from-scratch techniques beside PyTorch's own, side by side.

Each entry of BENCHMARKS names a benchmark and its function. A benchmark runs both
implementations in the same run, on the same model and ranks, and returns a list of
rows (dicts) with at least `benchmark`, `case`, `ours_s`, `torch_s`, `ratio`
(ours_s / torch_s), and `target` (the largest acceptable ratio, or None); it may add
other measured columns. Ratios are the result: absolute times depend on the machine.
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import time

BENCHMARKS: dict[str, str] = {
    "allreduce": "shardlib.comm:bench_allreduce",
    "ddp": "shardlib.data_parallel_checks:bench_ddp",
    "finetune": "shardlib.finetune:bench_finetune",
    "zero": "shardlib.zero_checks:bench_zero",
    "tp": "shardlib.tp_check:bench_tp",
    "pp": "shardlib.pipeline_checks:bench_pipeline",
    "quant": "shardlib.quant:bench_quant",
    "inference": "shardlib.serving:bench_inference",
    "plan": "shardlib.plan:bench_plan",
}


def interleaved_step_times(runs: dict, batch, loss_fn, repeats: int, warmup: int = 2) -> dict:
    """Median seconds of one training step for each (model, optimizer) in `runs`, on this rank.

    The implementations take turns, in alternating order, step after step, each step
    started together on every rank (barrier), so all of them see the same machine.
    """
    import torch.distributed as dist

    names = list(runs)
    times = {name: [] for name in names}
    for i in range(repeats + warmup):
        for name in (names if i % 2 else names[::-1]):
            model, optimizer = runs[name]
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(names: list[str] | None, as_json: bool, quick: bool = False) -> int:
    unknown = [n for n in names or [] if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    rows = []
    for name in names or list(BENCHMARKS):
        module, fn = BENCHMARKS[name].split(":")
        new_rows = getattr(importlib.import_module(module), fn)(quick=quick)
        rows.extend(new_rows)
        if not as_json:
            for row in new_rows:
                target = row.get("target")
                verdict = "" if target is None else ("  (target <= %.2f: %s)" % (target, "met" if row["ratio"] <= target else "MISSED"))
                extra = "  ".join(f"{k}={v}" for k, v in row.items()
                                  if k not in ("benchmark", "case", "ours_s", "torch_s", "ratio", "target"))
                print(f"{row['benchmark']:<12} {row['case']:<28} ours {row['ours_s'] * 1e3:9.2f} ms  "
                      f"torch {row['torch_s'] * 1e3:9.2f} ms  ratio {row['ratio']:5.2f}{verdict}  {extra}", flush=True)
    if as_json:
        print(json.dumps(rows, indent=1))
    return 0
