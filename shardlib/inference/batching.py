"""Batching requests: static (request-level) and continuous (iteration-level), under a KV-cache budget.

A server holds a KV cache of fixed size per device. Requests arrive one by one, with prompts and
output lengths of their own. Two ways to batch them (Yu et al., "Orca", OSDI 2022):

    static       the scheduler admits requests only when the batch is empty; the batch runs until
                 its last request finishes, and newcomers wait for all of it
    continuous   the scheduler acts between iterations (one forward pass = one token for every
                 running request): it retires finished requests and admits waiting ones into the
                 freed room at once (iteration-level scheduling)

Admission is first come, first served, under two limits: `max_batch` running requests, and the KV
cache. A request reserves its whole cache at admission, prompt + output - 1 positions (the last token
is never fed back), rounded up to whole blocks of a PagedKVCache (vLLM, arXiv 2309.06180), so that
a running request never runs out; reserve="max" reserves the model's whole context instead, as a
cache of one contiguous slab per request must.

One iteration runs every running request through the model together (Orca's selective batching):
their new tokens, a whole prompt for a request just admitted and one token for the others, are
concatenated into one (1, sum T, h) sequence for the layers that treat positions independently
(embeddings, LayerNorms, q/k/v/o projections, MLP); attention keeps requests apart: each prompt
attends over itself, each one-token step over its own request's cached keys and values (all the
one-token steps in one call, their caches padded to the longest and the padding masked out). Each
request therefore computes what it would alone, and its tokens are those of one-at-a-time greedy
generation. Under tensor parallelism (a TensorParallelGPT) every rank runs the same scheduler on rank
0's clock, broadcast once per iteration: 8 bytes per iteration besides the model's 2L+1 all-reduces
and the logits' all-gather.

Memory per device: weights (Psi, or Psi/t), plus the KV cache it was given; communication per
iteration: as one forward pass of the layout (shardlib/inference/generate.py).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib.comm import ops
from shardlib.inference.generate import EmulatedDevice, next_token
from shardlib.inference.kv_cache import PagedKVCache
from shardlib.models import repeat_kv
from shardlib.parallel.tensor import ColumnParallelLinear

__all__ = ["Request", "Scheduler", "batched_forward", "iteration_inputs", "run_engine"]


@dataclass
class Request:
    """One request, and what happened to it (times in seconds after the server's start)."""

    id: int
    prompt: list[int]
    max_new_tokens: int  # this request's output length (generation runs to it: no end-of-text token)
    arrival: float = 0.0
    admitted: float | None = None  # when the scheduler let it in
    tokens: list[int] = field(default_factory=list)  # generated so far
    token_times: list[float] = field(default_factory=list)  # when each token was known

    @property
    def positions(self) -> int:
        """KV-cache positions it writes: its prompt and every generated token but the last."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens

    def next_input(self) -> tuple[list[int], int]:
        """(token ids to feed, position of the first): the prompt first, then the last token."""
        if not self.tokens:
            return self.prompt, 0
        return self.tokens[-1:], len(self.prompt) + len(self.tokens) - 1


class Scheduler:
    """First-come-first-served admission under `max_batch` and the blocks of `cache`.

    policy "continuous" admits whenever there is room; "static" only into an empty batch.
    reserve "exact" reserves a request's own positions; "max" the model's `max_positions`."""

    def __init__(self, cache: PagedKVCache, max_batch: int, policy: str = "continuous", reserve: str = "exact",
                 max_positions: int | None = None):
        if policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
        if reserve not in ("exact", "max") or (reserve == "max" and not max_positions):
            raise ValueError(f"reserve must be 'exact', or 'max' with max_positions, got {reserve!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.cache, self.max_batch, self.policy = cache, max_batch, policy
        self.reserve, self.max_positions = reserve, max_positions
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def reservation(self, request: Request) -> int:
        """Positions of KV cache the request holds while it runs."""
        return self.max_positions if self.reserve == "max" else request.positions

    def add(self, request: Request) -> None:
        """Queue a request; it must fit the whole cache, or it could never run."""
        need = self.cache.blocks_needed(self.reservation(request))
        if need > self.cache.n_blocks:
            raise ValueError(f"request {request.id} needs {need} KV blocks and the cache has {self.cache.n_blocks}: "
                             "give the cache more blocks, or shorten the request")
        self.waiting.append(request)

    def admit(self, now: float) -> list[Request]:
        """Move requests from the head of the queue into the batch while they fit; return them."""
        admitted = []
        if self.policy == "static" and self.running:
            return admitted
        while (self.waiting and len(self.running) < self.max_batch
               and self.cache.can_allocate(self.reservation(self.waiting[0]))):
            request = self.waiting.popleft()
            self.cache.allocate(request.id, self.reservation(request))
            request.admitted = now
            self.running.append(request)
            admitted.append(request)
        return admitted

    def retire(self) -> list[Request]:
        """Remove finished requests from the batch and free their blocks; return them."""
        finished = [r for r in self.running if r.done]
        for request in finished:
            self.cache.free(request.id)
        self.running = [r for r in self.running if not r.done]
        return finished


# ---------------------------------------------------------------------------------
# one iteration: the running requests' new tokens through the model together


def _attention(attn: nn.Module, x: torch.Tensor, pieces: list[tuple[int, int, int]], cache: PagedKVCache,
               layer: int) -> torch.Tensor:
    """x: (1, sum T, h), the new positions of every request. A prompt attends over itself alone; the
    one-token steps of all other requests attend together, each over its own cached positions (padding
    masked out), in one call, as PagedAttention's kernels do."""
    total = x.shape[1]
    q, k, v = (proj(x)[0].view(total, -1, attn.head_dim).transpose(0, 1)  # (nh/t, sum T, hd); k, v (n_kv/t, ...)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    y, n_rep = torch.empty_like(q), q.shape[0] // k.shape[0]  # (nh/t, sum T, hd)
    decode, offset = [], 0  # (row of x, sequence, position) of the one-token steps
    for seq, start, T in pieces:
        if T == 1:
            decode.append((offset, seq, start))
        else:  # a prompt, at positions 0..T-1
            keys, values = cache.update(layer, seq, k[:, offset:offset + T], v[:, offset:offset + T], 0)  # (n_kv/t, T, hd)
            y[:, offset:offset + T] = F.scaled_dot_product_attention(
                q[None, :, offset:offset + T], repeat_kv(keys[None], n_rep), repeat_kv(values[None], n_rep),
                is_causal=True)[0]  # (nh/t, T, hd)
        offset += T
    if decode:
        rows = torch.tensor([row for row, _, _ in decode], device=x.device)  # (n,)
        keys, values, mask = cache.update_decode(layer, [seq for _, seq, _ in decode], k[:, rows].transpose(0, 1),
                                                 v[:, rows].transpose(0, 1), [start for *_, start in decode])
        out = F.scaled_dot_product_attention(q[:, rows].transpose(0, 1)[:, :, None],  # (n, nh/t, 1, hd)
                                             repeat_kv(keys, n_rep), repeat_kv(values, n_rep),  # (n, nh/t, P, hd)
                                             attn_mask=mask[:, None, None, :])  # (n, 1, 1, P)
        y[:, rows] = out[:, :, 0].transpose(0, 1)  # (nh/t, n, hd)
    return attn.o_proj(y.transpose(0, 1).reshape(1, total, -1))  # (1, sum T, h/t) -> (1, sum T, h)


def batched_forward(module: nn.Module, pieces: list[tuple[int, int, int]], x: torch.Tensor, cache: PagedKVCache,
                    emulated: EmulatedDevice | None = None) -> torch.Tensor:
    """One iteration. pieces: (sequence, first position, T) per request, in the order of x; x: (sum T,)
    token ids if the module embeds, else (1, sum T, h) hidden states. Returns the logits of every
    request's last position (n, 1, V) ((n, 1, V/t) under TP) if the module has the head, else the hidden
    states (1, sum T, h). A prompt (T > 1) must start at position 0; later positions come one at a time."""
    began = time.perf_counter()
    if any(T > 1 and start for _, start, T in pieces):
        raise ValueError("a request's prompt must come whole, at position 0; then one token per iteration")
    target = emulated.pass_seconds(module, sum(T for *_, T in pieces)) if emulated is not None else 0.0
    if hasattr(module, "tok_emb"):
        positions = torch.cat([torch.arange(start, start + T, device=x.device) for _, start, T in pieces])
        x = module.tok_emb(x[None]) + module.pos_emb(positions)  # (1, sum T, h)
    blocks = module.blocks.values() if isinstance(module.blocks, nn.ModuleDict) else module.blocks
    for layer, block in enumerate(blocks):
        x = x + _attention(block.attn, block.ln_1(x), pieces, cache, layer)  # (1, sum T, h)
        x = x + block.mlp(block.ln_2(x))
    if hasattr(module, "lm_head"):
        last = torch.tensor([T for *_, T in pieces], device=x.device).cumsum(0) - 1  # (n,) each request's last
        x = module.lm_head(module.ln_f(x[0, last]))[:, None]  # (n, 1, V) or (n, 1, V/t)
    rest = target - (time.perf_counter() - began)
    if rest > 0:
        time.sleep(rest)
    return x


def iteration_inputs(running: list[Request], device=None) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
    """The pieces and (sum T,) token ids of one iteration over `running`."""
    pieces, ids = [], []
    for request in running:
        tokens, start = request.next_input()
        pieces.append((request.id, start, len(tokens)))
        ids += tokens
    return pieces, torch.tensor(ids, dtype=torch.long, device=device)


# ---------------------------------------------------------------------------------
# the serving loop


def _clock(start_time: float, group, device) -> float:
    """Seconds since start_time; under TP the group's first rank's, broadcast, so every rank schedules alike."""
    now = time.perf_counter() - start_time
    if group is None:
        return now
    stamp = torch.tensor([now], dtype=torch.float64, device=device)  # (1,): 8 bytes
    ops.broadcast(stamp, src=dist.get_process_group_ranks(group)[0], group=group)
    return stamp.item()


@torch.no_grad()
def run_engine(module: nn.Module, requests: list[Request], scheduler: Scheduler, *,
               emulated: EmulatedDevice | None = None, start_time: float | None = None,
               route: Callable[[Request], bool] | None = None,
               tick: Callable[[float], float] | None = None) -> list[Request]:
    """Serve `requests` (each arriving `arrival` seconds after start_time, default now) on one device, one
    replica, or every rank of a TensorParallelGPT's group, iteration after iteration until all are done.
    Fills in each request's tokens, token_times and admitted, and returns the requests it served, in
    order of arrival.

    route(request): whether this server takes an arriving request (replicas sharing one stream of
    requests; default all). tick(now): called between iterations (a monitor, an autoscaler), returns the
    time it wants to be called next (math.inf: never again); the server runs until that time too."""
    head = getattr(module, "lm_head", None)
    group = (head.group or dist.group.WORLD) if isinstance(head, ColumnParallelLinear) else None
    device = next(module.parameters()).device
    start_time = time.perf_counter() if start_time is None else start_time
    too_long = [r.id for r in requests if len(r.prompt) + r.max_new_tokens > module.config.seq_len]
    if too_long:
        raise ValueError(f"requests {too_long[:5]} need more positions than the model's seq_len="
                         f"{module.config.seq_len}: shorten their prompts or outputs")
    pending, served, next_tick = deque(sorted(requests, key=lambda r: r.arrival)), [], math.inf
    while True:
        now = _clock(start_time, group, device)
        next_tick = tick(now) if tick is not None else math.inf
        while pending and pending[0].arrival <= now:
            request = pending.popleft()
            if route is None or route(request):
                scheduler.add(request)
                served.append(request)
        scheduler.admit(now)
        if not scheduler.running:  # idle until the next arrival or tick (every TP rank knows the same `now`)
            wake = min(pending[0].arrival if pending else math.inf, next_tick)
            if wake == math.inf:
                break
            time.sleep(max(0.0, wake - now))
            continue
        pieces, ids = iteration_inputs(scheduler.running, device)
        logits = batched_forward(module, pieces, ids, scheduler.cache, emulated)  # (n, 1, V[/t])
        tokens = next_token(logits, module)[:, 0].tolist()  # (n,)
        now = time.perf_counter() - start_time
        for request, token in zip(scheduler.running, tokens):
            request.tokens.append(token)
            request.token_times.append(now)
        scheduler.retire()
    return served
