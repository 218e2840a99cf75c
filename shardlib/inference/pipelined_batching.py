"""Continuous batching through pipeline stages: m batches in flight, each a continuous batch of its own.

The first stage holds the scheduler. Its running requests are dealt into m micro-batches ("groups")
that take turns: while stage 1 works on group 0, stage 0 works on group 1, and so on, so that with
m >= p groups every stage is busy (GPipe's idea, arXiv 1811.06965, applied to decoding). Before
stage 0 schedules group g again, the last stage has sent back group g's new tokens; stage 0 then
retires its finished requests and admits waiting ones into it, exactly as shardlib.inference.batching
does for one device. A request's token takes one pass through all p stages; with m groups in flight
the server runs m batches at once.

Per iteration of a group, each boundary carries one header of 2 + 5*max_batch int64 (the group's
requests: id, first position, tokens, positions to reserve, last pass) and the (1, sum T, h)
activations; the last stage sends the group's new token ids (8 bytes each) back to the first.
Memory per stage: its L/p layers' weights (about Psi/p) and their KV cache: each stage reserves a
request's blocks when its prompt passes and frees them after its last pass, so every stage's cache
mirrors stage 0's.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlib.comm import ops
from shardlib.inference.batching import (
    Request,
    Scheduler,
    batched_forward,
    iteration_inputs,
)
from shardlib.inference.generate import EmulatedDevice
from shardlib.inference.kv_cache import PagedKVCache

__all__ = ["run_pipeline_engine"]

_FIELDS = 5  # per request in a header: id, first position, tokens, positions to reserve, last pass


@torch.no_grad()
def run_pipeline_engine(stage: nn.Module, requests: list[Request], cache: PagedKVCache, *, max_batch: int,
                        n_microbatches: int, group=None, emulated: EmulatedDevice | None = None,
                        start_time: float | None = None) -> dict:
    """Serve `requests` through the stages of `group` (rank s holds stage s, a GPTStage; p >= 2).
    Returns, on the first stage, {"admitted": {id: time}}, on the last {"tokens": {id: [...]},
    "token_times": {id: [...]}}, and {} in between."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if len(ranks) < 2:
        raise ValueError("a pipeline needs at least 2 stages: serve one device with shardlib.inference.batching")
    start_time = time.perf_counter() if start_time is None else start_time
    if stage.is_first:
        return _first_stage(stage, requests, cache, max_batch, n_microbatches, ranks, group, emulated, start_time)
    return _later_stage(stage, cache, max_batch, ranks, group, emulated, start_time)


def _header(requests: list[Request], pieces: list[tuple[int, int, int]], max_batch: int, device) -> torch.Tensor:
    """(2 + 5 * max_batch,) int64: [1 = work, n, then per request id, start, T, reserve, last pass]."""
    header = torch.zeros(2 + _FIELDS * max_batch, dtype=torch.long, device=device)
    header[:2] = torch.tensor([1, len(pieces)])
    for i, (request, (seq, start, T)) in enumerate(zip(requests, pieces)):
        last = int(len(request.tokens) + 1 == request.max_new_tokens)  # this pass gives its final token
        header[2 + _FIELDS * i: 2 + _FIELDS * (i + 1)] = torch.tensor([seq, start, T, request.positions, last])
    return header


def _first_stage(stage, requests, cache, max_batch, m, ranks, group, emulated, start_time) -> dict:
    device = next(stage.parameters()).device
    scheduler = Scheduler(cache, max_batch)  # its running batch is group g's while g is scheduled
    groups: list[list[Request]] = [[] for _ in range(m)]
    pending, sends, g = deque(sorted(requests, key=lambda r: r.arrival)), [], 0
    while pending or scheduler.waiting or any(groups):
        if groups[g]:  # group g is in flight: its new tokens come back from the last stage
            tokens = torch.empty(len(groups[g]), dtype=torch.long, device=device)  # (n,)
            ops.recv(tokens, ranks[-1], group=group)
            for request, token in zip(groups[g], tokens.tolist()):
                request.tokens.append(token)
            scheduler.running = groups[g]
            scheduler.retire()
            groups[g] = scheduler.running
        now = time.perf_counter() - start_time
        while pending and pending[0].arrival <= now:
            scheduler.add(pending.popleft())
        scheduler.running = groups[g]
        scheduler.admit(now)
        groups[g] = scheduler.running
        if groups[g]:
            pieces, ids = iteration_inputs(groups[g], device)
            hidden = batched_forward(stage, pieces, ids, cache, emulated)  # (1, sum T, h)
            sends.append(ops.isend(_header(groups[g], pieces, max_batch, device), ranks[1], group=group))
            sends.append(ops.isend(hidden.contiguous(), ranks[1], group=group))  # (1, sum T, h)
            sends = [work for work in sends if not work.is_completed()]
        elif not any(groups) and pending:  # nothing anywhere: idle until the next arrival
            time.sleep(max(0.0, pending[0].arrival - now))
        g = (g + 1) % m
    sends.append(ops.isend(torch.zeros(2 + _FIELDS * max_batch, dtype=torch.long, device=device), ranks[1],
                           group=group))  # stop
    for work in sends:
        work.wait()
    return {"admitted": {r.id: r.admitted for r in requests}}


def _later_stage(stage, cache, max_batch, ranks, group, emulated, start_time) -> dict:
    device, dtype, h = next(stage.parameters()).device, next(stage.parameters()).dtype, stage.config.n_embd
    s, sends = stage.stage_index, []
    tokens, token_times = {}, {}
    while True:
        header = torch.empty(2 + _FIELDS * max_batch, dtype=torch.long, device=device)
        ops.recv(header, ranks[s - 1], group=group)
        if not stage.is_last:
            sends.append(ops.isend(header, ranks[s + 1], group=group))
        if header[0].item() == 0:  # stop
            break
        rows = header[2: 2 + _FIELDS * header[1].item()].view(-1, _FIELDS).tolist()  # (n, 5)
        pieces = [(seq, start, T) for seq, start, T, _, _ in rows]
        for seq, start, _, reserve, _ in rows:
            if start == 0:  # a prompt: reserve this stage's blocks for the whole request
                cache.allocate(seq, reserve)
        hidden = torch.empty(1, sum(T for *_, T in pieces), h, dtype=dtype, device=device)  # (1, sum T, h)
        ops.recv(hidden, ranks[s - 1], group=group)
        out = batched_forward(stage, pieces, hidden, cache, emulated)
        for seq, _, _, _, last in rows:
            if last:
                cache.free(seq)
        if not stage.is_last:
            sends.append(ops.isend(out.contiguous(), ranks[s + 1], group=group))  # (1, sum T, h)
            continue
        new = out[:, -1].argmax(-1)  # (n,)
        now = time.perf_counter() - start_time
        for (seq, *_), token in zip(rows, new.tolist()):
            tokens.setdefault(seq, []).append(token)
            token_times.setdefault(seq, []).append(now)
        sends.append(ops.isend(new.contiguous(), ranks[0], group=group))  # (n,) back to the first stage
        sends = [work for work in sends if not work.is_completed()]
    for work in sends:
        work.wait()
    return {"tokens": tokens, "token_times": token_times} if stage.is_last else {}
