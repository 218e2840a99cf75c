"""Sequence parallelism: tensor parallelism's f and g outside the column->row pairs, made an
all-gather and a reduce-scatter of the sequence, so that what lies between the pairs is cut t ways.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198,
section 4.2.2. The layers that use these operators (`sequence_parallel=True`) are in
shardlib/parallel/tensor.py, the GPT in shardlib/parallel/tensor_gpt.py.

    f  ->  all-gather T forward (B, T/t, C) -> (B, T, C),  reduce-scatter T backward
    g  ->  reduce-scatter T forward (B, T, C) -> (B, T/t, C),  all-gather T backward

An all-reduce is a reduce-scatter followed by an all-gather: the same bytes, but LayerNorm, dropout
and the residual now run on (B, T/t, C). Weights that see only a sequence shard (LayerNorm, row
biases, position embedding) get partial gradients, summed once per step.

What backward keeps. A column layer needs its gathered input again for dW = dY^T X. Keeping the
gathered (B, T, C) would leave s b h e bytes (e per element) per column input on every rank;
as Megatron-LM does (megatron/core/tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication), `GatherSequenceIntoLinears` keeps the (B, T/t, C)
shard and all-gathers it again in backward, started before dX = dY W is computed and waited for
after; the reduce-scatter of dX is started before dW is computed. Activations per layer, 16-bit:

    s b h / t (34 + 5 a s / h)    every term divided by t (arXiv 2205.05198, eq. 5)
    s b h (4 + 30 / t + 5 a s / (h t))    with keep_gathered_input=True (the two column inputs whole)

(what the course GPT really saves, term by term: shardlib.memory.course_gpt_activation_terms).

Traffic per layer and rank (b batch, s sequence, h hidden, e bytes per element), on a ring each
all-gather or reduce-scatter of b*s*h elements sends (t-1)/t * b*s*h*e:

    forward   2 all-gathers + 2 reduce-scatters                      = TP's 2 all-reduces
    backward  2 all-gathers + 2 reduce-scatters + 2 all-gathers again of the kept shards
              10 (t-1)/t b s h e per layer in all, against tensor parallelism's 8

`keep_gathered_input=True` skips the extra all-gathers (TP's 8 (t-1)/t b s h e) and keeps
2 s b h e (1 - 1/t) bytes more per layer: the memory-for-communication trade (`sequence_parallel_collectives`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlib.comm import ops

__all__ = ["SEQUENCE_DIM", "all_gather_along", "reduce_scatter_along", "GatherFromSequenceParallelRegion",
           "ReduceScatterToSequenceParallelRegion", "GatherSequenceIntoLinears", "sequence_parallel_collectives"]

SEQUENCE_DIM = 1  # activations are (B, T, C): sequence parallelism cuts T


# ---------------------------------------------------------------------------------
# the collectives along one dimension, skipped when t = 1 (tensor.py gathers features with them too)


def all_gather_along(x: torch.Tensor, dim: int, *, group=None, async_op: bool = False):
    """Concatenate every rank's x along `dim`: (.., n, ..) -> (.., t*n, ..). With async_op the
    collective is only started, and a function is returned that waits for it and gives the result."""
    t = dist.get_world_size(group)
    if t == 1:
        return (lambda: x) if async_op else x
    flat = torch.empty(t * x.numel(), dtype=x.dtype, device=x.device)  # (t * numel,)
    source = x.reshape(-1)  # (numel,)
    work = ops.all_gather_into_tensor(flat, source, group=group, async_op=async_op)

    def result(source=source) -> torch.Tensor:  # noqa: ARG001 - the source stays alive until the wait
        if work is not None:
            work.wait()
        return torch.cat(flat.view(t, *x.shape).unbind(0), dim=dim)  # (t, *x.shape) joined along dim
    return result if async_op else result()


def reduce_scatter_along(x: torch.Tensor, dim: int, *, group=None, async_op: bool = False):
    """Sum x over ranks and keep this rank's 1/t along `dim`: (.., n, ..) -> (.., n/t, ..).
    With async_op, a function that waits for the collective and gives the shard."""
    t = dist.get_world_size(group)
    if t == 1:
        return (lambda: x) if async_op else x
    stacked = torch.stack(x.chunk(t, dim=dim))  # (t, *shard shape): rank r's share is stacked[r]
    shard = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    # flat: (t * shard numel,) -> (shard numel,)
    work = ops.reduce_scatter_tensor(shard.view(-1), stacked.view(-1), group=group, async_op=async_op)

    def result() -> torch.Tensor:
        if work is not None:
            work.wait()
        return shard
    return result if async_op else result()


# ---------------------------------------------------------------------------------
# the operators


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """f under sequence parallelism: all-gather T forward, reduce-scatter T backward. (A linear
    right after it would keep the gathered tensor: the column layers use GatherSequenceIntoLinears.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, SEQUENCE_DIM, group=group)  # (B, T/t, C) -> (B, T, C)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, SEQUENCE_DIM, group=ctx.group), None  # (B, T, C) -> (B, T/t, C)


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g under sequence parallelism: reduce-scatter T forward, all-gather T backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along(x, SEQUENCE_DIM, group=group)  # (B, T, C) partial -> (B, T/t, C)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, SEQUENCE_DIM, group=ctx.group), None  # (B, T/t, C) -> (B, T, C)


def input_gradient(grads, weights) -> torch.Tensor:
    """dX = sum_j dY_j W_j of linears that read one input, in the gradients' dtype: under autocast the outputs,
    and so their gradients, are bf16 while the W_j stay fp32, and autocast's own linear multiplies in bf16."""
    grad_x = grads[0] @ weights[0].to(grads[0].dtype)  # (B, T, C)
    for grad, weight in zip(grads[1:], weights[1:]):
        grad_x += grad @ weight.to(grad.dtype)
    return grad_x


def parameter_gradients(x, grads, weights, bias_dtypes, needed) -> list:
    """[dW_1, db_1, dW_2, db_2, ...] of linears Y_j = X W_j^T + b_j: dW_j = dY_j^T X in W_j's dtype, db_j = sum dY_j in
    b_j's (bias_dtypes[j]; None: no bias); None where `needed` (one flag per parameter, as autograd's
    needs_input_grad) wants no gradient."""
    x, out = x.flatten(0, -2), []  # (B*T, C)
    for j, (grad, weight, bias_dtype) in enumerate(zip(grads, weights, bias_dtypes)):
        grad = grad.flatten(0, -2)  # (B*T, out_j/t)
        out.append((grad.t() @ x.to(grad.dtype)).to(weight.dtype) if needed[2 * j] else None)  # (out_j/t, C)
        out.append(grad.sum(0).to(bias_dtype) if bias_dtype is not None and needed[2 * j + 1] else None)
    return out


class GatherSequenceIntoLinears(torch.autograd.Function):
    """f under sequence parallelism fused with the column-parallel layers that read its output (q, k
    and v read one, as Megatron's fused QKV does): all-gather T, then Y_j = X W_j^T + b_j for each.
    Backward keeps the (B, T/t, C) shard and gathers it again while dX is computed, then
    reduce-scatters dX while the dW_j are computed; keep_gathered=True keeps the gathered (B, T, C)
    instead and gathers nothing in backward. apply(x, group, keep_gathered, w_1, b_1, w_2, b_2, ...),
    a b_j may be None; returns (Y_1, Y_2, ...), each (B, T, out_j/t)."""

    @staticmethod
    def forward(ctx, x, group, keep_gathered: bool, *params):
        full = all_gather_along(x, SEQUENCE_DIM, group=group)  # (B, T/t, C) -> (B, T, C)
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.keep_gathered = group, keep_gathered
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        ctx.save_for_backward(full if keep_gathered else x, *weights)  # the shard (B, T/t, C), or (B, T, C)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))  # each (B, T, out_j/t)

    @staticmethod
    def backward(ctx, *grads):  # each (B, T, out_j/t)
        saved, *weights = ctx.saved_tensors
        gathered = (lambda: saved) if ctx.keep_gathered else \
            all_gather_along(saved, SEQUENCE_DIM, group=ctx.group, async_op=True)  # started: (B, T, C)
        grad_shard = None
        if ctx.needs_input_grad[0]:  # a first layer reading data needs no dX
            grad_full = input_gradient(grads, weights)  # dX (B, T, C), while the gather runs
        full = gathered()
        if ctx.needs_input_grad[0]:
            grad_shard = reduce_scatter_along(grad_full, SEQUENCE_DIM, group=ctx.group, async_op=True)  # (B, T/t, C)
        grad_params = parameter_gradients(full, grads, weights, ctx.bias_dtypes, ctx.needs_input_grad[3:])  # meanwhile
        return (None if grad_shard is None else grad_shard().to(saved.dtype), None, None, *grad_params)


# ---------------------------------------------------------------------------------
# the traffic formula


def sequence_parallel_collectives(b: int, s: int, h: int, *, keep_gathered_input: bool = False):
    """(forward, backward): the (kind, elements) collectives one transformer layer makes on each rank
    under sequence parallelism, in the order they are issued (see the module docstring)."""
    bsh = b * s * h
    forward = [("all_gather", bsh), ("reduce_scatter", bsh)] * 2  # attention's f and g, then the MLP's
    regather = [] if keep_gathered_input else [("all_gather", bsh)]
    # backward, MLP first: g's all-gather of dY, then the fc's (gather again), reduce-scatter of dX
    backward = ([("all_gather", bsh)] + regather + [("reduce_scatter", bsh)]) * 2
    return forward, backward
