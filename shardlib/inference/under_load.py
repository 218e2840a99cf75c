"""Layouts under load: one stream of requests served by one device, d replicas, TP t or PP p (lesson 10).

`serve_traces(layout, world_size, config, traces)` launches the ranks once and serves each trace (a
list of Requests with arrival times) in turn, in real time, with continuous batching
(shardlib.inference.batching; shardlib.inference.pipelined_batching for PP), every forward pass
lasting what `emulated` says such a device would take (the ranks sleep out the rest of it, so that
ranks sharing a laptop's cores behave as separate devices). Returns, per trace, the requests with
their tokens and times.

    layout       ranks   per device                     a request's token takes          slots
    "replicas"   d       Psi, KV of its own requests    one pass of the whole model      d * max_batch
    "tp"         t       ~Psi/t, KV by heads            one pass of 1/t of it + 2L+2     max_batch
                                                        collectives
    "pp"         p       ~Psi/p, KV of its L/p layers   p passes of 1/p of it, one per   m * max_batch
                                                        stage, + p hops

Replicas share the stream through a router that sends each request to a replica drawn uniformly at
random (seeded): each replica then sees a Poisson stream of lambda/d, which is what the queueing
formula (shardlib.inference.queueing) assumes. Every rank's KV cache has `kv_blocks` blocks of
`block_size` positions.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

from shardlib.comm import ops
from shardlib.inference.batching import Request, Scheduler, run_engine
from shardlib.inference.generate import EmulatedDevice
from shardlib.inference.kv_cache import PagedKVCache
from shardlib.inference.pipelined_batching import run_pipeline_engine
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt
from shardlib.parallel.pipeline import gpt_stage
from shardlib.parallel.tensor_gpt import check_tp_config, parallelize_gpt

__all__ = ["LAYOUTS", "random_routes", "shared_start", "serve_traces"]

LAYOUTS = ("replicas", "tp", "pp")


def random_routes(requests: list[Request], n_replicas: int, seed: int = 0) -> dict[int, int]:
    """request id -> replica, uniformly at random (the same on every rank: drawn from `seed`)."""
    draws = torch.randint(0, n_replicas, (len(requests),), generator=torch.Generator().manual_seed(seed))
    return {r.id: int(d) for r, d in zip(sorted(requests, key=lambda r: r.id), draws)}


def shared_start(lead: float = 0.05, group=None) -> float:
    """A start time on the machine's monotonic clock, the same on every rank: the first rank's clock + lead."""
    start = torch.tensor([time.perf_counter() + lead], dtype=torch.float64, device=current_device())  # (1,)
    ops.broadcast(start, src=dist.get_process_group_ranks(group or dist.group.WORLD)[0], group=group)
    return start.item()


def _server(layout: str, config: GPTConfig, max_batch: int, kv_blocks: int, block_size: int, n_microbatches: int,
            policy: str):
    """This rank's model (or stage) and a function that serves one trace on it."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_gpt(config, seed=0).to(current_device()).eval()
    if layout == "pp":
        stage = gpt_stage(model, rank, n)

        def serve(requests, emulated, start_time, seed):
            cache = PagedKVCache(stage, kv_blocks, block_size)
            return run_pipeline_engine(stage, requests, cache, max_batch=max_batch, n_microbatches=n_microbatches,
                                       emulated=emulated, start_time=start_time)
        return serve
    module = parallelize_gpt(model) if layout == "tp" else model

    def serve(requests, emulated, start_time, seed):
        scheduler = Scheduler(PagedKVCache(module, kv_blocks, block_size), max_batch, policy)
        routes = random_routes(requests, n, seed) if layout == "replicas" else None
        route = (lambda r: routes[r.id] == rank) if routes else None  # noqa: E731
        return run_engine(module, requests, scheduler, emulated=emulated, start_time=start_time, route=route)
    return serve


def _serve_on_rank(layout, config, traces, max_batch, kv_blocks, block_size, n_microbatches, policy, emulated, seed):
    serve = _server(layout, config, max_batch, kv_blocks, block_size, n_microbatches, policy)
    warm_up = [Request(-1 - i, [1, 2, 3], 2) for i in range(dist.get_world_size())]
    serve(warm_up, None, time.perf_counter(), seed)  # first calls into torch are slow: keep them out of the runs
    results = []
    for trace in traces:
        dist.barrier()
        results.append(serve(copy.deepcopy(trace), emulated, shared_start(), seed))
    return results


def _assemble(layout: str, per_rank: list, trace: list[Request]) -> list[Request]:
    """The served requests of one trace, in order of arrival, from every rank's view of it."""
    if layout == "replicas":
        served = [r for rank_result in per_rank for r in rank_result]
    elif layout == "tp":
        served = per_rank[0]
        if any([r.tokens for r in other] != [r.tokens for r in served] for other in per_rank[1:]):
            raise RuntimeError("tensor-parallel ranks disagree on the generated tokens")
    else:  # pp: admission times from the first stage, tokens from the last
        first, last = per_rank[0], per_rank[-1]
        served = copy.deepcopy(trace)
        for r in served:
            r.admitted, r.tokens, r.token_times = first["admitted"][r.id], last["tokens"][r.id], \
                last["token_times"][r.id]
    return sorted(served, key=lambda r: r.arrival)


def serve_traces(layout: str, world_size: int, config: GPTConfig, traces: list[list[Request]], *,
                 max_batch: int = 8, kv_blocks: int = 64, block_size: int = 16, n_microbatches: int = 2,
                 policy: str = "continuous", emulated: EmulatedDevice | None = None, seed: int = 0,
                 device: str = "auto", timeout: float = 600.0) -> list[list[Request]]:
    """Serve each trace with `layout` on `world_size` ranks (one launch); return each trace's requests.
    policy: "continuous" or "static" batching (shardlib.inference.batching; a pipeline batches continuously)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if policy not in ("continuous", "static") or (layout == "pp" and policy != "continuous"):
        raise ValueError(f"policy must be 'continuous' or 'static' ('continuous' for a pipeline), got {policy!r}")
    if layout == "tp":
        check_tp_config(config, world_size)
    if layout == "pp" and not 2 <= world_size <= config.n_layer:
        raise ValueError(f"a pipeline needs 2 to n_layer={config.n_layer} stages, got {world_size}")
    longest = max((len(r.prompt) + r.max_new_tokens for t in traces for r in t), default=0)
    if longest > config.seq_len:
        raise ValueError(f"a request of {longest} positions exceeds the model's seq_len={config.seq_len}: "
                         "shorten prompts or outputs")
    per_rank = launch(_serve_on_rank, world_size, args=(layout, config, traces, max_batch, kv_blocks, block_size,
                                                        n_microbatches, policy, emulated, seed),
                      device=device, timeout=timeout)
    return [_assemble(layout, [rank_results[i] for rank_results in per_rank], trace)
            for i, trace in enumerate(traces)]
