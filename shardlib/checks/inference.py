"""Sharded inference checked and timed: `python -m shardlib verify --technique kv-cache-tp|kv-cache-tp-gqa|
continuous-batching` and `python -m shardlib bench inference`.

verify: greedy generation with a KV cache split over t tensor-parallel ranks by heads (kv heads split when
n_kv_head >= t, replicated when n_kv_head < t), and continuous batching of requests of different lengths
(on one device, or on t tensor-parallel ranks), against the single device's GPT.generate, which recomputes
the whole sequence for every token: the token ids must be identical; each step's logits (teacher-forced
through the sharded cache) must agree within the harness's TOLERANCE; each rank's cache bytes must equal
the formula of shardlib/inference/kv_cache.py. In float64, so that no near-tie can flip an arg-max.
bench: each layout's latency per token and throughput beside one device's (shardlib/inference/serving.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from shardlib.checks.harness import DTYPE, TOLERANCE, launch_on
from shardlib.inference.batching import Request, Scheduler, run_engine
from shardlib.inference.generate import forward_step, generate
from shardlib.inference.kv_cache import (
    KVCache,
    PagedKVCache,
    kv_cache_bytes,
    kv_cache_formula_bytes,
)
from shardlib.inference.serving import WORKLOADS, sweep
from shardlib.launch import current_device
from shardlib.models import GPTConfig, build_gpt
from shardlib.parallel.tensor import GatherFromTensorParallelRegion
from shardlib.parallel.tensor_gpt import check_tp_config, parallelize_gpt

CHECK_GPT = GPTConfig(seq_len=32, n_layer=2, n_head=4, n_embd=32)
GQA_GPT = GPTConfig(seq_len=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
PROMPTS, PROMPT_LEN, NEW_TOKENS = 3, 6, 10


def _config(technique: str) -> GPTConfig:
    return GQA_GPT if technique in ("kv-cache-tp-gqa", "continuous-batching") else CHECK_GPT


def _model(config: GPTConfig):
    return build_gpt(config, seed=0).to(DTYPE).eval()


def _prompts() -> torch.Tensor:
    return torch.randint(0, CHECK_GPT.vocab_size, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _kv_generation_on_rank(config: GPTConfig, reference_ids: torch.Tensor) -> dict:
    model = parallelize_gpt(_model(config).to(current_device()))
    prompts = _prompts().to(current_device())
    generation = generate(model, prompts, NEW_TOKENS)
    # teacher-forced through a fresh sharded cache: every step's logits on the reference tokens
    ids, cache, logits = reference_ids.to(current_device()), KVCache(model, PROMPTS, PROMPT_LEN + NEW_TOKENS), []
    step = forward_step(model, ids[:, :PROMPT_LEN], cache, 0)
    for position in range(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS):
        logits.append(GatherFromTensorParallelRegion.apply(step, model.group)[:, -1])  # (b, V)
        step = forward_step(model, ids[:, position:position + 1], cache, position)
    return {"ids": generation.ids.cpu(), "logits": torch.stack(logits, 1).cpu(),  # (b, n, V)
            "cache_bytes": kv_cache_bytes(generation.caches[0])}


@torch.no_grad()
def _reference(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT.generate's ids and the full forward's logits at every generated position (b, n, V)."""
    model = _model(config)
    ids = model.generate(_prompts(), NEW_TOKENS)
    return ids, model(ids)[:, PROMPT_LEN - 1: -1]


def verify_kv_cache(world_size: int, technique: str = "kv-cache-tp", device: str = "cpu") -> dict:
    """Tensor-parallel KV-cached generation on t = world_size ranks vs GPT.generate on one device."""
    config = _config(technique)
    check_tp_config(config, world_size)  # before any process starts
    reference_ids, reference_logits = _reference(config)
    per_rank = launch_on(_kv_generation_on_rank, world_size, args=(config, reference_ids), device=device)
    same_ids = all(torch.equal(r["ids"], reference_ids) for r in per_rank)
    diff = max((r["logits"] - reference_logits).abs().max().item() for r in per_rank)
    rel = diff / reference_logits.abs().max().item()
    formula = kv_cache_formula_bytes(config, PROMPT_LEN + NEW_TOKENS, PROMPTS, DTYPE.itemsize, world_size)
    bytes_ok = all(r["cache_bytes"] == formula for r in per_rank)
    heads = config.kv_heads
    layout = (f"{heads // world_size} kv head(s) per rank" if heads >= world_size
              else f"1 kv head per rank, each of the {heads} on {world_size // heads} ranks")
    detail = (f"{layout}; ids {'identical' if same_ids else 'DIFFER'}; cache {per_rank[0]['cache_bytes']} B per "
              f"rank {'=' if bytes_ok else '!='} formula {formula} B")
    return {"passed": same_ids and rel <= TOLERANCE and bytes_ok, "max_abs_diff": diff, "max_rel_diff": rel,
            "detail": detail}


def _requests() -> list[Request]:
    """12 requests of 3 to 12 prompt tokens and 2 to 14 new ones, all waiting at the start."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(3, 13, (12,), generator=g).tolist()
    outputs = torch.randint(2, 15, (12,), generator=g).tolist()
    return [Request(i, torch.randint(0, GQA_GPT.vocab_size, (n,), generator=g).tolist(), out)
            for i, (n, out) in enumerate(zip(lengths, outputs))]


@torch.no_grad()
def _batching_on_rank(config: GPTConfig) -> dict:
    model = _model(config).to(current_device())
    module = parallelize_gpt(model) if dist.get_world_size() > 1 else model
    cache = PagedKVCache(module, n_blocks=6, block_size=8)  # room for 2 to 6 requests: the budget binds
    scheduler = Scheduler(cache, max_batch=4)
    most = [0]

    def watch(now):  # most requests running at once, seen between iterations
        most[0] = max(most[0], len(scheduler.running))
        return float("inf")
    served = run_engine(module, _requests(), scheduler, tick=watch)
    return {"tokens": {r.id: r.tokens for r in served}, "most_running": most[0], "free": len(cache.free_blocks)}


def verify_continuous_batching(world_size: int, technique: str = "continuous-batching", device: str = "cpu") -> dict:
    """Continuous batching (one device, or t = world_size TP ranks) vs GPT.generate one request at a time."""
    config = _config(technique)
    if world_size > 1:
        check_tp_config(config, world_size)
    model = _model(config)
    reference = {r.id: model.generate(torch.tensor([r.prompt]), r.max_new_tokens)[0, len(r.prompt):].tolist()
                 for r in _requests()}
    per_rank = launch_on(_batching_on_rank, world_size, args=(config,), device=device)
    wrong = sum(r["tokens"][i][j] != token for r in per_rank for i, tokens in reference.items()
                for j, token in enumerate(tokens))
    total = sum(len(t) for t in reference.values()) * world_size
    freed = all(r["free"] == 6 for r in per_rank)
    detail = (f"{len(reference)} requests, {total // world_size} tokens; {wrong} differ from one-at-a-time "
              f"GPT.generate; at most {per_rank[0]['most_running']} running at once under a 6-block cache; "
              f"{'every block freed' if freed else 'BLOCKS LEAKED'} (diffs: tokens differing, and their share)")
    return {"passed": wrong == 0 and freed, "max_abs_diff": float(wrong), "max_rel_diff": wrong / total,
            "detail": detail}


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


CHECKS = {"kv-cache-tp": (verify_kv_cache, (2, 4)), "kv-cache-tp-gqa": (verify_kv_cache, (2, 4)),
          "continuous-batching": (verify_continuous_batching, (1, 2))}
BENCHMARKS = {"inference": bench_inference}
