"""Data parallelism: every rank holds the whole model, takes 1/N of the batch, averages gradients.

Rank r computes the gradient of the mean loss on its B/N examples. With equal slices the
mean of the N gradients is the gradient of the mean loss over the global batch of B, so
after an all-reduce (sum) and a division by N every rank takes the step a single device
would take on the whole batch, and the replicas stay identical.

Two ways to average, both here:

- `all_reduce_gradients(module)`: naive. After backward, one all-reduce per parameter
  tensor. Communication waits for the whole backward, and every small tensor pays the
  per-message latency (alpha) on its own.
- `DistributedDataParallel(module, bucket_cap_mb=25)`: the design of PyTorch's DDP
  (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
  VLDB 2020, arXiv 2006.15704), named as PyTorch names it. Initial parameters and buffers
  are broadcast from one rank so the replicas start equal. Gradients are packed into flat
  buckets of about bucket_cap_mb, in reverse order of registration (roughly the order
  backward produces them). A hook on each parameter copies its gradient into its bucket as
  soon as autograd has accumulated it; the moment a bucket is complete its all-reduce starts
  asynchronously, while backward goes on computing the gradients of earlier layers
  (overlap). Buckets start in index order on every rank, so the ranks' collectives always
  match. When backward ends, every bucket is waited for and the averages copied back to
  `.grad`. Inside `no_sync()` hooks do nothing: gradients accumulate locally.

Per rank, in the course notation (Psi parameters, N ranks):

    memory         16 Psi bytes with mixed-precision Adam (2 bf16 params + 2 grads + 12 fp32
                   master copy, m, v; ZeRO paper, arXiv 1910.02054), NOT divided by N,
                   + the buckets: one more copy of the gradients (2 Psi bytes in bf16, 4 Psi in fp32)
    communication  2(N-1)/N * Psi elements sent per step (ring all-reduce of every gradient),
                   in at most about Psi*bytes / bucket_bytes all-reduces (a bucket closes once it
                   holds bucket_bytes or more; naive: one per parameter tensor)

Inputs, handled or refused:
- parameters with requires_grad=False are broadcast but never bucketed nor reduced;
- buffers (BatchNorm statistics...) are broadcast once, when wrapping; PyTorch's DDP also
  re-broadcasts them before every forward (broadcast_buffers=True), which is not done here;
- tied (shared) parameters are one Parameter object: registered once, hooked once (autograd
  sums their uses before the hook fires), reduced once;
- parameters of several dtypes or devices get separate buckets (one per dtype and device);
- a parameter that gets no gradient in a synced backward, or gets one twice, is an error
  naming it (the ranks' buckets would no longer match); sparse gradients are refused.
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from shardlib.comm import ops, ring_all_reduce

__all__ = ["all_reduce_gradients", "broadcast_parameters", "assign_buckets", "DistributedDataParallel"]


def broadcast_parameters(module: nn.Module, src: int = 0, *, group=None) -> None:
    """Overwrite every rank's parameters and buffers with those of rank `src` of the group, in place."""
    source = src if group is None else dist.get_global_rank(group, src)  # torch.distributed wants a global rank
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            ops.broadcast(tensor, src=source, group=group)  # same shape on every rank


def all_reduce_gradients(module: nn.Module, *, group=None) -> None:
    """Naive data parallelism: after backward, average each gradient over the group, one call per tensor."""
    world_size = dist.get_world_size(group)
    for name, param in module.named_parameters():  # a tied parameter is listed once
        if not param.requires_grad:
            continue
        if param.grad is None:
            raise RuntimeError(f"parameter {name!r} has no gradient: call backward first, or set "
                               "requires_grad=False on parameters the loss does not use")
        ops.all_reduce(param.grad, group=group)  # sum over ranks, in place, same shape
        param.grad.div_(world_size)


def assign_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets, walking `params` from the last to the first.

    One bucket is open per (dtype, device); a parameter joins the open bucket of its kind,
    which closes as soon as it holds bucket_cap_bytes or more (so a tensor larger than the cap
    gets a bucket of its own). Buckets come back in the order they closed, then the part-filled
    ones; each lists indices in reverse order. PyTorch's DDP assigns its buckets the same way.
    """
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    buckets = []
    for index in reversed(range(len(params))):
        p = params[index]
        kind = (p.dtype, p.device)
        open_buckets.setdefault(kind, []).append(index)
        open_bytes[kind] = open_bytes.get(kind, 0) + p.numel() * p.element_size()
        if open_bytes[kind] >= bucket_cap_bytes:
            buckets.append(open_buckets.pop(kind))
            open_bytes[kind] = 0
    return buckets + list(open_buckets.values())


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat all-reduce."""

    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]  # where each gradient starts in `buffer`
    buffer: torch.Tensor  # (sum of numels,) one dtype
    pending: int = 0  # gradients still to arrive in this backward
    handle: object = field(default=None, repr=False)  # the async all-reduce's Work


def _make_bucket(named: list[tuple[str, nn.Parameter]]) -> Bucket:
    offsets = [0] + list(itertools.accumulate(p.numel() for _, p in named))[:-1]
    first = named[0][1]
    buffer = torch.zeros(sum(p.numel() for _, p in named), dtype=first.dtype, device=first.device)
    return Bucket([n for n, _ in named], [p for _, p in named], offsets, buffer)


class DistributedDataParallel(nn.Module):
    """Wrap a module for data-parallel training with bucketed all-reduces overlapped with backward.

    module: the model, the same architecture on every rank; its parameters are overwritten
        with those of rank `broadcast_from` of the group at construction (PyTorch's DDP: rank 0).
    bucket_cap_mb: bucket size in MiB (2**20 bytes), as PyTorch's argument of the same name.
    group: the process group (None: all ranks).
    ring: all-reduce buckets with shardlib.comm.ring_all_reduce (blocking, so no overlap; the
        ledger sees its sends) instead of torch.distributed.all_reduce(async_op=True).
    record_timeline: keep (seconds, event, bucket) tuples in `self.timeline`, events
        "grad_ready", "start" and "done": the all-reduce issued, and completed, in the completion
        callback of its future, on gloo's thread (an NCCL future completes once the work is enqueued
        on its stream: https://pytorch.org/docs/stable/distributed.html#torch.distributed.Work.get_future,
        so on CUDA "done" is not the end). A profiler trace holds the same moments as the labels
        "bucket b all-reduce" (the issue) and "bucket b done" (shardlib.profile.agree reads both).

    Use it as torch's: `loss = model_loss(ddp, batch); loss.backward(); optimizer.step()`.
    Backward returns with averaged gradients (as in PyTorch, the wait is queued to run when
    autograd ends); `finish_gradient_sync()` is that wait, and may be called again harmlessly.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, *, group=None, broadcast_from: int = 0,
                 ring: bool = False, record_timeline: bool = False):
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameter that requires grad: there is nothing to train")
        self.module, self.group, self.ring = module, group, ring
        self.world_size = dist.get_world_size(group)
        self.require_backward_grad_sync = True  # PyTorch's name for what no_sync() turns off
        self.timeline: list[tuple[float, str, int]] | None = [] if record_timeline else None
        if not 0 <= broadcast_from < self.world_size:
            raise ValueError(f"broadcast_from={broadcast_from} is not a rank of a group of {self.world_size}: "
                             f"use 0 .. {self.world_size - 1}")
        broadcast_parameters(module, src=broadcast_from, group=group)
        indices = assign_buckets([p for _, p in named], int(bucket_cap_mb * 2**20))
        self.buckets = [_make_bucket([named[i] for i in bucket]) for bucket in indices]
        self._where = {}  # id(param) -> (bucket index, offset)
        self._hooks = []
        for b, bucket in enumerate(self.buckets):
            for param, offset in zip(bucket.params, bucket.offsets):
                self._where[id(param)] = (b, offset)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._reset()

    def forward(self, *args, **kwargs):
        if self._in_backward:  # the last backward stopped half-way (it raised): start this step clean
            self._reset()
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward inside this context only accumulates `.grad` locally; the next synced
        backward averages the accumulated sums (gradient accumulation over micro-batches)."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.handle = len(bucket.params), None
        self._ready: set[int] = set()
        self._next_bucket = 0  # buckets start in index order on every rank
        self._in_backward = False

    def _log(self, event: str, bucket: int) -> None:
        if self.timeline is not None:
            self.timeline.append((time.perf_counter(), event, bucket))

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Autograd has accumulated param.grad: copy it into its bucket; start full buckets."""
        if not self.require_backward_grad_sync:
            return
        if not self._in_backward:
            self._in_backward = True
            # Run the wait when this backward ends, as PyTorch's reducer does.
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_sync)
        b, offset = self._where[id(param)]
        bucket = self.buckets[b]
        if id(param) in self._ready:
            raise RuntimeError(f"parameter {bucket.names[bucket.params.index(param)]!r} received its gradient "
                               "twice in one backward (reentrant checkpointing?); call backward once per step")
        if param.grad.is_sparse:
            raise RuntimeError("sparse gradients are not supported: build nn.Embedding with sparse=False")
        self._ready.add(id(param))
        bucket.buffer[offset: offset + param.numel()].copy_(param.grad.reshape(-1))  # (numel,) slice
        bucket.pending -= 1
        self._log("grad_ready", b)
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._start_all_reduce(self._next_bucket)
            self._next_bucket += 1

    def _start_all_reduce(self, b: int) -> None:
        bucket = self.buckets[b]
        bucket.buffer.div_(self.world_size)  # sum of g/N = the mean; divided first, as PyTorch does
        if self.ring:
            with record_function(f"bucket {b} all-reduce (ring)"):
                self._log("start", b)
                ring_all_reduce(bucket.buffer, group=self.group)  # (numel,) summed in place, blocking
            self._done(b)
            return
        with record_function(f"bucket {b} all-reduce"):  # the issue; gloo's thread or NCCL's stream runs it
            self._log("start", b)
            bucket.handle = ops.all_reduce(bucket.buffer, group=self.group, async_op=True)  # (numel,) in place
        if self.timeline is not None:
            bucket.handle.get_future().then(lambda _, b=b: self._done(b))  # run by the thread that completes it

    def _done(self, b: int) -> None:
        """Bucket b's all-reduce has completed: its "done" event, and the same moment labelled for a trace."""
        with record_function(f"bucket {b} done"):
            self._log("done", b)

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce and copy the averaged gradients back to `.grad`."""
        if not self._in_backward:
            return
        missing = [name for bucket in self.buckets for name, p in zip(bucket.names, bucket.params)
                   if id(p) not in self._ready]
        if missing:
            self._reset()
            raise RuntimeError(f"parameters {missing[:4]}{' ...' if len(missing) > 4 else ''} got no gradient "
                               "in this backward, so their buckets cannot be all-reduced; set "
                               "requires_grad=False on parameters the loss does not use, before wrapping")
        for b, bucket in enumerate(self.buckets):
            if bucket.handle is not None:
                with record_function(f"wait for bucket {b}"):
                    bucket.handle.wait()
            for param, offset in zip(bucket.params, bucket.offsets):
                param.grad.copy_(bucket.buffer[offset: offset + param.numel()].view_as(param.grad))
        self._reset()
