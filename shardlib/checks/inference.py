"""Benchmark of sharded inference (`python -m shardlib bench inference`)."""

from __future__ import annotations

import os

from shardlib.inference.serving import WORKLOADS, sweep


def bench_inference(quick: bool = False) -> list[dict]:
    """Each layout's latency per token (ours_s) beside one device's (torch_s: the same KV-cached loop on one
    rank), with tokens/s and bytes per decode step, on this machine's cores and on the emulated device."""
    rows = []
    for workload in WORKLOADS[:1] if quick else WORKLOADS:
        name, _, n_requests, _, new_tokens = workload
        results = sweep(workload, repeats=0 if quick else 1)
        single = results[0]
        for r in results:
            case = f"{name} {r['layout']} N={r['ranks']}" + (f" m={r['n_microbatches']}" if r["layout"] == "pp" else "")
            rows.append({"benchmark": "inference", "case": case + f", {n_requests} req x {new_tokens} tok",
                         "ours_s": r["latency_s"], "torch_s": single["latency_s"],
                         "ratio": r["latency_s"] / single["latency_s"], "target": None,
                         "tokens_per_s": round(r["tokens_per_s"], 1),
                         "throughput_x": round(r["tokens_per_s"] / single["tokens_per_s"], 2),
                         "bytes_per_token": round(sum(r["decode_sent_bytes"])), "identical": r["identical"],
                         "ranks_per_core": round(r["ranks"] / (os.cpu_count() or 1), 2)})
    return rows


BENCHMARKS = {"inference": bench_inference}
