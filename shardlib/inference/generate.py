"""Sharded inference: greedy generation under tensor parallelism, data-parallel replicas and pipeline stages.

Generation runs the prompt through the model once (prefill) and then one token at a time
(decode), each step reusing the keys and values of the earlier positions (the KV cache) so that a
step processes only the new token: (b, 1) ids -> (b, 1, V) logits -> arg-max. Three ways to
spread it over N ranks, b requests in the batch, Psi parameters, L layers, h hidden, V vocabulary:

    layout           weights per rank   traffic per decode step, per rank (elements)           wins
    TP, t ranks      Psi/t (+ LN...)    2L+1 all-reduces of b*h (attention, MLP, embedding)    latency
                                        + 1 all-gather of the b*V logits:
                                        (2L+1) * 2(t-1)/t * b*h + (t-1)/t * b*V sent
    DP, d replicas   Psi                none: each replica serves b/d requests on its own     throughput
    PP, p stages     ~Psi/p             b*h to the next stage; the last stage sends the b new  capacity
                                        token ids back to the first (m groups of requests in
                                        flight pipeline the stages)

The KV cache (shardlib/inference/kv_cache.py) holds 2 L b T h_kv elements in all after T positions
(h_kv = h without grouped-query attention); each rank keeps 1/t of it under TP (its kv heads; at least
one whole head when n_kv_head < t), 1/p under PP (its layers), 1/d under DP (its requests).

Why. A decode step reads every weight once for only b positions of work, so on a GPU at small b it
is bound by memory bandwidth: about (weight bytes)/(bandwidth) whatever b, until 2 Psi b FLOPs take
longer than that (Pope et al., "Efficiently Scaling Transformer Inference", arXiv 2211.05102). TP
divides the bytes each device reads by t, so each token comes up to t times sooner, plus 2L+1
all-reduces whose small messages cost latency (alpha), not bandwidth: TP pays while its links are
fast (one node; Megatron-LM, arXiv 1909.08053). DP replicas leave one request's latency alone; they
add throughput when one device is already busy (compute-bound, or out of memory for more requests):
while memory-bound, one device batching all the requests does as well. PP lets a model too large for
the devices TP can span run at all: a group of requests visits the p stages one after the other
(latency of one device plus p-1 hops), and only with m >= p groups in flight is every stage busy.
`EmulatedDevice` gives each forward pass the duration such a device would take, so that CPU ranks,
which share cores and are compute-bound, can show it (shardlib/inference/serving.py measures both).

Nothing here opens a communication ledger: a caller that wants the traffic opens one around the call
and passes it as `ledger=`, and the Generation splits its records into the prompt pass and the rest.

Outputs are the single-device greedy ones: every layout computes the same arg-max (the tests and
`python -m shardlib bench inference` compare the token ids with GPT.generate). The cache needs the
whole sequence to fit the position table: prompt + new tokens <= seq_len.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib.comm import CommLedger, CommRecord, ops
from shardlib.inference.kv_cache import KVCache
from shardlib.models import repeat_kv
from shardlib.parallel.tensor import (
    ColumnParallelLinear,
    GatherFromTensorParallelRegion,
    RowParallelLinear,
)
from shardlib.parallel.tensor_gpt import VocabParallelEmbedding

__all__ = ["Generation", "EmulatedDevice", "collectives_per_pass", "forward_step", "next_token", "generate",
           "generate_pipelined"]


@dataclass
class Generation:
    """One rank's view of a generation."""

    ids: torch.Tensor | None  # (b, T0 + n) prompts and new tokens; None on ranks that do not produce them
    start: float  # time.perf_counter() when the prefill began (one clock for all ranks of a machine)
    token_times: list[list[float]] = field(default_factory=list)  # per group of requests: when each token was known
    prefill: list[CommRecord] = field(default_factory=list)  # communication of the prompt pass (with ledger=)
    decode: list[CommRecord] = field(default_factory=list)  # communication of all the one-token steps (ledger=)
    caches: list[KVCache] = field(default_factory=list)  # this rank's KV cache (one per group of requests)


@dataclass(frozen=True)
class EmulatedDevice:
    """An accelerator's roofline, for timing on CPU ranks: a forward pass over `tokens` positions with
    Psi_r parameters on this rank lasts max(weight bytes / memory_bandwidth, 2 Psi_r tokens / flops)
    seconds (a decode step reads every weight once and does 2 FLOPs per weight and token: Pope et
    al., arXiv 2211.05102, Section 2). The rank computes for real, then sleeps out the rest: a sleeping
    rank leaves the cores to the others, as ranks on separate devices would (shardlib.lessons.timed_stage's
    TimedStage does the same for training). Communication is real, and runs inside that time;
    `collective_latency` adds the latency a device's link would add per collective of a tensor-parallel
    pass (2L+1 all-reduces and the logits' all-gather: `collectives_per_pass`), 0 by default. Reading the
    KV cache is left out: the weights dominate the bytes of a decode step at short context."""

    memory_bandwidth: float  # bytes per second
    flops: float  # FLOP per second
    collective_latency: float = 0.0  # seconds per collective of a tensor-parallel pass

    def pass_seconds(self, module: nn.Module, tokens: int) -> float:
        params = sum(p.numel() for p in module.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        roofline = max(weight_bytes / self.memory_bandwidth, 2 * params * tokens / self.flops)
        return roofline + self.collective_latency * collectives_per_pass(module)


def collectives_per_pass(module: nn.Module) -> int:
    """Collectives of one forward pass of a tensor-parallel module: one all-reduce per row-parallel layer
    and vocabulary-parallel embedding, one all-gather of the logits; 0 on one device or one rank."""
    split = [m for m in module.modules() if isinstance(m, (RowParallelLinear, VocabParallelEmbedding))]
    if not split or dist.get_world_size(split[0].group) == 1:
        return 0
    return len(split) + int(hasattr(module, "lm_head"))


# ---------------------------------------------------------------------------------
# one forward pass with a KV cache, for a GPT, a TensorParallelGPT or a pipeline stage


def _attention(attn: nn.Module, x: torch.Tensor, cache: KVCache, layer: int, start: int) -> torch.Tensor:
    """Self-attention of the new positions x (b, T, h) over the cached ones and themselves."""
    B, T, _ = x.shape
    q, k, v = (proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # (b, nh/t, T, hd); k, v: (b, n_kv/t, T, hd)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    if start and T != 1:
        raise ValueError("after the prompt, positions come one at a time")
    k, v = cache.update(layer, k, v, start)  # (b, n_kv/t, start + T, hd): the cached positions and the new
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])  # (b, nh/t, start + T, hd)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)  # prefill: causal; one new token sees all
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (b, T, h/t) -> o_proj -> (b, T, h)


def forward_step(module: nn.Module, x: torch.Tensor, cache: KVCache, start: int,
                 emulated: EmulatedDevice | None = None) -> torch.Tensor:
    """Token ids (b, T) if the module embeds, else hidden states (b, T, h), at positions start..start+T-1
    -> hidden states (b, T, h), or the last position's logits (b, 1, V) (V/t under TP) if it has the head.
    With `emulated`, the pass lasts at least as long as that device would take (see EmulatedDevice)."""
    began = time.perf_counter()
    target = emulated.pass_seconds(module, x.shape[0] * x.shape[1]) if emulated is not None else 0.0
    if hasattr(module, "tok_emb"):
        x = module.tok_emb(x) + module.pos_emb(torch.arange(start, start + x.shape[1], device=x.device))  # (b, T, h)
    blocks = module.blocks.values() if isinstance(module.blocks, nn.ModuleDict) else module.blocks
    for layer, block in enumerate(blocks):
        x = x + _attention(block.attn, block.ln_1(x), cache, layer, start)  # (b, T, h)
        x = x + block.mlp(block.ln_2(x))
    if hasattr(module, "lm_head"):
        x = module.lm_head(module.ln_f(x[:, -1:]))  # (b, 1, V) or (b, 1, V/t)
    rest = target - (time.perf_counter() - began)
    if rest > 0:
        time.sleep(rest)
    return x


def _check_length(module: nn.Module, prompts: torch.Tensor, max_new_tokens: int) -> None:
    limit = module.config.seq_len
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompts.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt of {prompts.shape[1]} + {max_new_tokens} new tokens exceeds the model's "
                         f"seq_len={limit}: shorten the prompt or generate fewer tokens")


# ---------------------------------------------------------------------------------
# generation


def next_token(logits: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Arg-max over the whole vocabulary: (b, 1, V) -> (b, 1). When `module`'s output head is
    tensor-parallel, its (b, 1, V/t) shards are gathered first, over the head's group."""
    head = getattr(module, "lm_head", None)
    if isinstance(head, ColumnParallelLinear):
        logits = GatherFromTensorParallelRegion.apply(logits, head.group)  # (b, 1, V/t) -> (b, 1, V)
    return logits[:, -1].argmax(-1, keepdim=True)  # (b, 1)


def _split_records(ledger: CommLedger | None, begin: int, prefill: list[tuple[int, int]]) -> tuple[list, list]:
    """The caller's ledger's records since `begin`: those in the `prefill` index ranges, and the others."""
    if ledger is None:
        return [], []
    inside = {i for a, b in prefill for i in range(a, b)}
    records = range(begin, len(ledger.records))
    return [ledger.records[i] for i in records if i in inside], [ledger.records[i] for i in records if i not in inside]


@torch.no_grad()
def generate(module: nn.Module, prompts: torch.Tensor, max_new_tokens: int, *,
             emulated: EmulatedDevice | None = None, ledger: CommLedger | None = None) -> Generation:
    """Greedy generation on one device, one data-parallel replica, or (module a TensorParallelGPT: its
    own group) every rank of a tensor-parallel group. prompts: (b, T0) token ids.
    ledger: a ledger the caller opened, whose records the Generation splits into prefill and decode."""
    _check_length(module, prompts, max_new_tokens)
    cache = KVCache(module, prompts.shape[0], prompts.shape[1] + max_new_tokens)  # (b, n_kv/t, T0 + n, hd) per layer
    begin = len(ledger.records) if ledger is not None else 0
    start = time.perf_counter()
    ids = torch.cat([prompts, next_token(forward_step(module, prompts, cache, 0, emulated), module)], dim=1)
    times, prefill_end = [time.perf_counter()], len(ledger.records) if ledger is not None else 0
    for _ in range(max_new_tokens - 1):
        logits = forward_step(module, ids[:, -1:], cache, ids.shape[1] - 1, emulated)  # (b, 1, V[/t])
        ids = torch.cat([ids, next_token(logits, module)], dim=1)  # (b, T0 + i)
        times.append(time.perf_counter())
    return Generation(ids, start, [times], *_split_records(ledger, begin, [(begin, prefill_end)]), caches=[cache])


@torch.no_grad()
def generate_pipelined(stage: nn.Module, prompts: torch.Tensor, max_new_tokens: int, n_microbatches: int = 1,
                       *, group=None, emulated: EmulatedDevice | None = None,
                       ledger: CommLedger | None = None) -> Generation:
    """Greedy generation through p pipeline stages (rank s of `group` holds stage s, a GPTStage).
    The b requests are cut into m groups that follow each other through the stages; the last stage
    sends each group's new token ids back to the first. Returns the ids on the last stage."""
    _check_length(stage, prompts, max_new_tokens)
    p, ranks = dist.get_world_size(group), dist.get_process_group_ranks(group or dist.group.WORLD)
    s, h, T0 = stage.stage_index, stage.config.n_embd, prompts.shape[1]
    device, dtype = prompts.device, next(stage.parameters()).dtype
    groups = list(prompts.chunk(n_microbatches))  # m x (b/m, T0)
    if len(groups) != n_microbatches or len({g.shape[0] for g in groups}) != 1:
        raise ValueError(f"{prompts.shape[0]} requests do not cut into {n_microbatches} equal groups")
    caches = [KVCache(stage, len(g), T0 + max_new_tokens) for g in groups]  # this stage's layers, per group
    times, sends = [[] for _ in groups], []
    begin = len(ledger.records) if ledger is not None else 0
    prefill = []  # index ranges of the ledger's records made by the prompt passes
    start = time.perf_counter()
    for step in range(max_new_tokens):
        for i, g in enumerate(groups):
            mark = len(ledger.records) if ledger is not None else 0
            if not stage.is_first:
                x = torch.empty(g.shape[0], T0 if step == 0 else 1, h, dtype=dtype, device=device)  # (b/m, T, h)
                ops.recv(x, ranks[s - 1], group=group)
            elif step == 0:
                x = g  # (b/m, T0) the prompts
            elif stage.is_last:
                x = groups[i][:, -1:]  # a single stage reads its own last token
            else:
                x = torch.empty(g.shape[0], 1, dtype=torch.long, device=device)  # (b/m, 1) new ids from the last stage
                ops.recv(x, ranks[-1], group=group)
            out = forward_step(stage, x, caches[i], 0 if step == 0 else T0 + step - 1, emulated)
            if not stage.is_last:
                sends.append(ops.isend(out.contiguous(), ranks[s + 1], group=group))  # (b/m, T, h)
            if step == 0 and ledger is not None:
                prefill.append((mark, len(ledger.records)))  # this group's prompt pass
            if not stage.is_last:
                continue
            groups[i] = torch.cat([groups[i], out[:, -1].argmax(-1, keepdim=True)], dim=1)  # (b/m, T0 + step + 1)
            times[i].append(time.perf_counter())
            if p > 1 and step + 1 < max_new_tokens:
                sends.append(ops.isend(groups[i][:, -1:].contiguous(), ranks[0], group=group))  # (b/m, 1)
    for work in sends:
        work.wait()
    return Generation(torch.cat(groups) if stage.is_last else None, start, times if stage.is_last else [],
                      *_split_records(ledger, begin, prefill), caches=caches)
