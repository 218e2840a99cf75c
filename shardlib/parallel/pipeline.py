"""Pipeline parallelism: p ranks each hold a stage of consecutive layers; micro-batches flow through.

Stage s of p holds blocks [l_s, l_{s+1}) of the model; the first stage also holds the
embeddings, the last one the final LayerNorm, the output head and the loss. A global batch
of b examples is cut into m micro-batches of b/m. For each micro-batch, stage s receives an
activation (b/m, s, h) from stage s-1, runs its blocks forward and sends the result on to
stage s+1; in the backward pass it receives the gradient of that output from stage s+1,
back-propagates, and sends the gradient of its input to stage s-1. Gradients accumulate over
the m micro-batches (each loss is divided by m), so after the step every stage holds the
gradient of the mean loss over the global batch, exactly as a single device would.

The order of forwards and backwards on each stage is the schedule (shardlib/parallel/schedules.py):
naive (one micro-batch at a time), GPipe (Huang et al., arXiv 1811.06965) or 1F1B
(PipeDream-Flush; Narayanan et al., arXiv 2104.04473).

Per rank, in the course notation (Psi parameters, p stages, m micro-batches, b global batch,
s sequence length, h hidden size, a heads, L layers):

    memory          Psi/p parameters (16 Psi/p bytes of model state with mixed-precision Adam)
                    + activations of the micro-batches stashed at once: m with GPipe, at most
                    p with 1F1B (on stage 0), 1 naive; each (L/p) * s (b/m) h (34 + 5 a s/h)
                    bytes in 16-bit (arXiv 2205.05198)
    communication   point-to-point only: per micro-batch and stage boundary, (b/m) * s * h
                    elements each way (activation forward, its gradient backward); per step
                    b * s * h elements sent to each neighbour. No collective in the pipeline.
    bubble          idle fraction (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/p naive

Under tensor parallelism the t ranks of a stage hold the same boundary activation. With
`scatter_gather=tp_group` each sends only its 1/t of it to the rank with its tp index in the next
stage, and the receivers all-gather the t pieces over their tensor-parallel group, which inside a
node is NVLink (Megatron-LM's scatter/gather optimisation, Narayanan et al., arXiv 2104.04473,
Section 4.1): (b/m) s h / t elements per message across the slow links, and one all-gather of
(b/m) s h per message received. Under sequence parallelism the activation is already split
(b/m, s/t, h) and differs by rank: send it as it is.

Tied embeddings on two stages: shardlib/parallel/tied_embeddings.py (a stage says which weight it
shares with the other end by `tied_embedding()`).

Interleaved schedules give each rank v chunks (pass the list of the rank's chunks as `stage`:
chunk c of rank s is virtual stage c*p + s of v*p, e.g. `gpt_stage(model, c*p + s, v*p)`); the
zero-bubble schedule splits each backward into B and W, which needs
`shardlib.parallel.split_backward.split_weight_gradients(stage)` on every chunk.

A stage is any nn.Module with `stage_index`, `num_stages`, `is_first`, `is_last`,
`forward(input)`, `loss(output, target)` (used on the last stage) and
`activation_shape(microbatch_input)` (the shape a non-first stage receives), and optionally
`activation_dtype` (default: its first parameter's dtype); `GPTStage` cuts
the course's GPT into such stages.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from shardlib.comm import ops
from shardlib.models import GPT
from shardlib.parallel.schedules import (
    SCHEDULES,
    Event,
    bubble_formula,
    check_actions,
    get_schedule,
    measured_bubble,
    message_order_problems,
    plot_timeline,
    simulate,
    stash_formula,
    unpack,
)
from shardlib.parallel.split_backward import pending_bytes

__all__ = ["GPTStage", "gpt_stage", "balanced_split", "check_pipeline", "check_microbatches", "pipeline_step",
           "StepResult",
           "Event", "SCHEDULES", "bubble_formula", "stash_formula", "measured_bubble", "plot_timeline", "simulate"]


# ---------------------------------------------------------------------------------
# cutting the model into stages


def check_microbatches(batch_size: int, n_microbatches: int) -> None:
    """Raise ValueError unless a batch of `batch_size` cuts into `n_microbatches` equal micro-batches."""
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if batch_size % n_microbatches:
        fits = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
        raise ValueError(f"a batch of {batch_size} cannot be cut into {n_microbatches} equal micro-batches: "
                         f"use n_microbatches in {fits}, or a batch size divisible by {n_microbatches}")


def check_pipeline(n_layer: int, num_stages: int, batch_size: int | None = None, n_microbatches: int | None = None,
                   layers_per_stage: list[int] | None = None) -> None:
    """Raise ValueError, saying what to change, for a pipeline that cannot be built."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > n_layer:
        raise ValueError(f"cannot cut {n_layer} transformer blocks into {num_stages} stages: every stage needs "
                         f"at least one block. Use at most {n_layer} stages, or a model with n_layer >= {num_stages}.")
    if layers_per_stage is not None:
        if len(layers_per_stage) != num_stages or min(layers_per_stage) < 1 or sum(layers_per_stage) != n_layer:
            raise ValueError(f"layers_per_stage={list(layers_per_stage)} must give each of the {num_stages} stages "
                             f">= 1 block and add up to n_layer={n_layer}")
    if batch_size is not None and n_microbatches is not None:
        check_microbatches(batch_size, n_microbatches)


def balanced_split(layer_sizes: list[int], num_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Layers per stage, contiguous, minimising the largest stage's size (e.g. parameter count).

    first_extra / last_extra: size the first / last stage holds besides its layers (embeddings;
    final norm and head). Dynamic programming over (stages used, layers placed).
    """
    n = len(layer_sizes)
    check_pipeline(n, num_stages)
    prefix = [0]
    for size in layer_sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]  # best[k][j]: k stages hold layers [0, j)
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):  # stage k-1 holds layers [i, j)
                size = prefix[j] - prefix[i] + (first_extra if k == 1 else 0)
                size += last_extra if k == num_stages else 0
                cost = max(best[k - 1][i], size)
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    counts, j = [], n
    for k in range(num_stages, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return counts[::-1]


class GPTStage(nn.Module):
    """Stage `stage_index` of `num_stages` of a GPT: blocks `layers`, plus tok_emb and pos_emb on the
    first stage and ln_f, lm_head and the loss on the last. Parameter names are the full model's
    (blocks.3.attn.q_proj.weight...), so the stages' state dicts together are the model's."""

    def __init__(self, model: GPT, stage_index: int, num_stages: int, layers: range):
        super().__init__()
        self.config, self.stage_index, self.num_stages = model.config, stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        if self.is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # x: (b, T) token ids
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(positions)  # (b, T, h)
        for block in self.blocks.values():
            x = block(x)  # (b, T, h)
        return self.lm_head(self.ln_f(x)) if self.is_last else x  # (b, T, V) or (b, T, h)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))  # (b*T, V) vs (b*T,)

    def activation_shape(self, idx: torch.Tensor) -> tuple[int, ...]:
        return (idx.shape[0], idx.shape[1], self.config.n_embd)  # (b, T, h)

    def tied_embedding(self) -> nn.Parameter | None:
        """The weight this stage shares with the other end of the pipeline: the embedding on the first stage,
        the output layer on the last, when the model ties them and they are on different stages; else None."""
        if not self.config.tie_embeddings or self.is_first == self.is_last:
            return None
        return self.tok_emb.weight if self.is_first else self.lm_head.weight


def gpt_stage(model: GPT, stage_index: int, num_stages: int, layers_per_stage: list[int] | None = None) -> GPTStage:
    """Cut `model` into `num_stages` stages and return stage `stage_index`.

    layers_per_stage: blocks in each stage; default: balanced by parameter count, the
    embeddings counted with the first stage and ln_f + lm_head with the last.
    """
    n_layer = len(model.blocks)
    check_pipeline(n_layer, num_stages, layers_per_stage=layers_per_stage)
    if layers_per_stage is None:
        count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
        layers_per_stage = balanced_split([count(b) for b in model.blocks], num_stages,
                                          count(model.tok_emb, model.pos_emb), count(model.ln_f, model.lm_head))
    start = sum(layers_per_stage[:stage_index])
    return GPTStage(model, stage_index, num_stages, range(start, start + layers_per_stage[stage_index]))


# ---------------------------------------------------------------------------------
# running a schedule


@dataclass
class StepResult:
    loss: float | None  # mean loss over the global batch (last stage); None on the others
    timeline: list[Event]  # this rank's forwards and backwards, in time.perf_counter() seconds
    peak_stashed: int  # most micro-batches whose activations this rank held at once
    peak_stashed_bytes: int  # most bytes autograd held for stashed micro-batches at once (no parameters)
    step_s: float  # wall time of the step on this rank


class _SavedBytes:
    """Counts the bytes of the distinct tensors autograd saves during a forward (not parameters)."""

    def __init__(self, module: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        pointer = t.untyped_storage().data_ptr()
        if pointer not in self.params:
            self.storages[pointer] = t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels are asynchronous: time what has finished
    return time.perf_counter()


@dataclass
class _Run:
    """What one rank knows while it runs its schedule."""

    chunks: list  # this rank's stages: one, or v chunks of an interleaved schedule
    n_microbatches: int
    group: object
    prev_rank: int  # global ranks of the neighbouring ranks (a chunk at virtual stage 0 or the last one ignores them)
    next_rank: int
    measure_memory: bool
    scatter: object = None  # the tensor-parallel group the boundary tensors are scattered over, or None
    stash: dict = field(default_factory=dict)  # (micro-batch, chunk) -> (stage input, output or loss, saved bytes)
    weight_work: dict = field(default_factory=dict)  # (micro-batch, chunk) -> (deferred W work, its bytes)
    sends: list = field(default_factory=list)  # (Work, tensor): in flight until the step ends
    loss_sum: float = 0.0
    peak: int = 0
    peak_bytes: int = 0

    def account(self) -> None:
        """Micro-batches held (forward done, backward or W not yet) and their bytes, for the peaks."""
        self.peak = max(self.peak, len(self.stash) + len(self.weight_work))
        held = sum(b for _, _, b in self.stash.values()) + sum(b for _, b in self.weight_work.values())
        self.peak_bytes = max(self.peak_bytes, held)


def _send(run: _Run, payload: torch.Tensor, peer: int) -> None:
    """Send a boundary tensor (b/m, T, h) to `peer`: whole, or this tensor-parallel rank's 1/t of it."""
    if run.scatter is not None:
        rank, t = dist.get_rank(run.scatter), dist.get_world_size(run.scatter)
        if payload.numel() % t:
            raise ValueError(f"scatter/gather sends 1/{t} of each boundary tensor: its {payload.numel()} elements "
                             f"must be a multiple of the tensor-parallel size (pass scatter_gather=None)")
        payload = payload.reshape(-1).chunk(t)[rank]  # (b/m T h / t,): this rank's piece
    run.sends.append((ops.isend(payload, peer, group=run.group), payload))


def _receive(run: _Run, out: torch.Tensor, peer: int) -> torch.Tensor:
    """Fill `out` (b/m, T, h) from `peer`: whole, or this rank's 1/t, then all-gathered over the tp group."""
    if run.scatter is None:
        ops.recv(out, peer, group=run.group)
        return out
    piece = out.new_empty(out.numel() // dist.get_world_size(run.scatter))  # (b/m T h / t,)
    ops.recv(piece, peer, group=run.group)
    ops.all_gather_into_tensor(out.view(-1), piece, group=run.scatter)  # the t pieces, in tp order
    return out


def _forward(run: _Run, i: int, c: int, x: torch.Tensor, target: torch.Tensor, device) -> tuple[float, float]:
    stage = run.chunks[c]
    if not stage.is_first:
        dtype = getattr(stage, "activation_dtype", None) or next(stage.parameters()).dtype  # ZeRO-3: not the shards'
        x = _receive(run, torch.empty(stage.activation_shape(x), dtype=dtype, device=device), run.prev_rank)
        x.requires_grad_()  # (b/m, T, h)
    with record_function(f"stage {stage.stage_index} F micro-batch {i}"):  # the span of the timeline's Event
        start = _now(device)
        with _SavedBytes(stage) if run.measure_memory else contextlib.nullcontext() as saved:
            out = stage(x)
            if stage.is_last:
                out = stage.loss(out, target) / run.n_microbatches  # the mean over m micro-batches
        end = _now(device)
    run.stash[i, c] = (x, out, sum(saved.storages.values()) if saved else 0)
    run.account()
    if stage.is_last:
        run.loss_sum += float("nan") if out.is_meta else out.item()  # a meta tensor has a shape, no value
    else:
        _send(run, out.detach(), run.next_rank)  # (b/m, T, h)
    return start, end


def _backward(run: _Run, i: int, c: int, device, split: bool) -> tuple[float, float]:
    stage = run.chunks[c]
    x, out, _ = run.stash.pop((i, c))
    grad = None
    if not stage.is_last:
        grad = _receive(run, torch.empty_like(out), run.next_rank)  # (b/m, T, h): d loss / d output
    with record_function(f"stage {stage.stage_index} B micro-batch {i}"):
        start = _now(device)
        if split:
            stage.weight_grad_store.defer = True  # B: input gradients now, weight gradients put aside for W
        try:
            torch.autograd.backward(out, grad)
        finally:
            if split:
                stage.weight_grad_store.defer = False
        end = _now(device)
    if split:
        work = stage.weight_grad_store.take()
        run.weight_work[i, c] = (work, pending_bytes(work) if run.measure_memory else 0)
    run.account()
    if not stage.is_first:
        _send(run, x.grad.contiguous(), run.prev_rank)  # (b/m, T, h): d loss / d input
    return start, end


def _weight(run: _Run, i: int, c: int, device) -> tuple[float, float]:
    work, _ = run.weight_work.pop((i, c))
    with record_function(f"stage {run.chunks[c].stage_index} W micro-batch {i}"):
        start = _now(device)
        for weight_gradient, _ in work:
            weight_gradient()  # dW = dY^T X (and db) of each linear layer, accumulated into .grad
        end = _now(device)
    return start, end


def _check_chunks(chunks: list, s: int, p: int) -> int:
    """The number of chunks v, after checking that chunk c is virtual stage c*p + s of v*p."""
    v = len(chunks)
    got = [(chunk.stage_index, chunk.num_stages) for chunk in chunks]
    want = [(c * p + s, v * p) for c in range(v)]
    if got != want:
        raise ValueError(f"rank {s} of a group of {p} with {v} chunk(s) runs virtual stages (index, of) {want}, "
                         f"but was given {got}" + ("" if v > 1 else f": stage {s} of {p}"))
    return v


def pipeline_step(stage, batch: tuple[torch.Tensor, torch.Tensor], n_microbatches: int,
                  schedule="1f1b", *, group=None, measure_memory: bool = True, scatter_gather=None) -> StepResult:
    """Forward and backward of one global batch through the pipeline; gradients accumulate in
    the stage's parameters (call optimizer.step() afterwards). Every rank of `group` calls it
    with its own stage: the group's rank r runs stage r. `batch` = (inputs, targets), the whole
    global batch (the first stage reads the inputs, the last the targets).

    The timeline's times are the machine's monotonic clock (time.perf_counter), which every
    process on one machine shares, so events of different ranks can be drawn on one axis.

    stage: this rank's stage, or the list of its v chunks for an interleaved schedule.
    schedule: "naive", "gpipe", "1f1b", "interleaved", "zero-bubble", or a function
    (p, m, stage_index) -> [(op, i) or (op, i, chunk), ...].
    measure_memory: count the bytes autograd saves for each stashed micro-batch (a hook per
    saved tensor; turn off when timing against another implementation).
    scatter_gather: the stage's tensor-parallel group, whose ranks hold the same boundary tensors: each
    sends 1/t of them and the receivers all-gather (module docstring); None sends them whole.
    """
    s, p = dist.get_rank(group), dist.get_world_size(group)
    chunks = list(stage) if isinstance(stage, (list, tuple, nn.ModuleList)) else [stage]
    v = _check_chunks(chunks, s, p)
    inputs, targets = batch
    check_microbatches(inputs.shape[0], n_microbatches)
    actions = [unpack(a) for a in get_schedule(schedule)(p, n_microbatches, s)]
    check_actions(actions, n_microbatches, s)
    used = 1 + max(c for _, _, c in actions)
    if used != v:
        raise ValueError(f"the schedule runs {used} chunk(s) per rank but rank {s} was given {v}")
    split = any(op == "W" for op, _, _ in actions)
    if split and not all(getattr(chunk, "weight_grad_store", None) is not None for chunk in chunks):
        raise ValueError("this schedule splits backward into B and W: call "
                         "shardlib.parallel.split_backward.split_weight_gradients(stage) on every stage first")
    simulate(schedule, p, n_microbatches)  # raises, instead of hanging, if the stages' orders deadlock
    problems = message_order_problems(schedule, p, n_microbatches)
    if problems:
        raise ValueError("the schedule would match messages to the wrong receives: " + "; ".join(problems[:2]))
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    scatter = scatter_gather if scatter_gather is not None and dist.get_world_size(scatter_gather) > 1 else None
    run = _Run(chunks, n_microbatches, group, ranks[(s - 1) % p], ranks[(s + 1) % p], measure_memory, scatter)
    x_mbs, y_mbs = inputs.chunk(n_microbatches), targets.chunk(n_microbatches)  # m x (b/m, ...)
    device, timeline = inputs.device, []
    ops.barrier(group)
    t0 = _now(device)
    for op, i, c in actions:
        if op == "F":
            start, end = _forward(run, i, c, x_mbs[i], y_mbs[i], device)
        elif op == "B":
            start, end = _backward(run, i, c, device, split)
        else:
            start, end = _weight(run, i, c, device)
        timeline.append(Event(s, op, i, start, end, c))
    for work, _ in run.sends:
        work.wait()
    has_loss = any(chunk.is_last for chunk in chunks)
    return StepResult(run.loss_sum if has_loss else None, timeline, run.peak, run.peak_bytes, _now(device) - t0)
