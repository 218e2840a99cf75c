"""Backward in two parts: gradients of the inputs now (B), gradients of the weights later (W).

A linear layer's backward is two matmuls: dX = dY W, which the previous stage of a pipeline is
waiting for, and dW = dY^T X, which nobody is waiting for. Zero-bubble pipeline schedules (Qi et
al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, Section 2) run the first as B and keep
the second for W, placed where the stage would otherwise idle. As in their implementation, the
weight-gradient matmuls of every nn.Linear are deferred; the small rest (LayerNorm, embeddings,
biases of nothing else) stays in B.

`split_weight_gradients(stage)` makes every nn.Linear of `stage` defer its dW (and db) into the
stage's `WeightGradStore`; while `store.defer` is False the work runs at once, inside backward, and
nothing changes. The pipeline runner (shardlib.parallel.pipeline) sets `defer` around each B,
`take()`s the deferred work and runs it at the schedule's W.

Memory: between B and W a micro-batch still holds, per linear layer, its input X and the output
gradient dY (`pending_bytes`): the activations of a micro-batch are freed at W, not at B. That is
what ZB-H1 pays for its smaller bubble (shardlib.parallel.schedules.schedule_zero_bubble).
Communication: none of its own; the pipeline's messages are 1F1B's, (b/m) s h elements per
micro-batch and stage boundary each way. Compute: unchanged, only moved (dW and db from B to W).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["WeightGradStore", "split_weight_gradients", "pending_bytes"]


class WeightGradStore:
    """Weight-gradient work put aside by backward while `defer` is True."""

    def __init__(self):
        self.defer = False
        self.pending: list[tuple] = []  # (function, tensors it holds)

    def put(self, work, tensors: tuple) -> None:
        if self.defer:
            self.pending.append((work, tensors))
        else:
            work()

    def take(self) -> list[tuple]:
        """The work deferred since the last take(), in the order backward produced it."""
        taken, self.pending = self.pending, []
        return taken


def pending_bytes(work: list[tuple]) -> int:
    """Bytes of the distinct storages that deferred work keeps alive."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, tensors in work for t in tensors}
    return sum(storages.values())


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad.add_(grad)


class _LinearSplitGrad(torch.autograd.Function):
    """y = x W^T + b; backward returns dX and hands dW, db to the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, linear, store):
        ctx.save_for_backward(x)
        ctx.linear, ctx.store = linear, store
        return F.linear(x, weight, bias)  # (..., in) -> (..., out)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        linear = ctx.linear
        grad_input = grad_output @ linear.weight  # (..., out) @ (out, in) -> (..., in)

        def weight_grad():
            dy = grad_output.reshape(-1, grad_output.shape[-1])  # (n, out)
            _accumulate(linear.weight, dy.t() @ x.reshape(-1, x.shape[-1]))  # (out, n) @ (n, in)
            if linear.bias is not None:
                _accumulate(linear.bias, dy.sum(0))  # (out,)

        ctx.store.put(weight_grad, (grad_output, x))
        return grad_input, None, None, None, None


def _split_linear_forward(linear: nn.Linear, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    return _LinearSplitGrad.apply(x, linear.weight, linear.bias, linear, store)


def split_weight_gradients(stage: nn.Module) -> WeightGradStore:
    """Make every nn.Linear in `stage` defer its weight gradients; return (and attach) the store."""
    store = getattr(stage, "weight_grad_store", None)
    if store is None:
        store = WeightGradStore()
        stage.weight_grad_store = store
    linears = [m for m in stage.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(stage).__name__} has no nn.Linear: nothing to split into B and W")
    for linear in linears:
        linear.forward = functools.partial(_split_linear_forward, linear, store)
    return store
