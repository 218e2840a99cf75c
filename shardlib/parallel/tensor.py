"""Tensor parallelism (Megatron-LM): the operators and the linear layers.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", arXiv 1909.08053. Sequence parallelism: Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198.
The GPT built from these layers, with the vocabulary-parallel embedding and
cross-entropy, is in shardlib/parallel/tensor_gpt.py; its checks and benchmark in shardlib/checks/tensor.py.

A linear layer Y = X A (A of shape in x out) can be split over t ranks two ways:

    column-parallel   A = [A_1 | ... | A_t]    rank i computes Y_i = X A_i        (B, T, out/t)
    row-parallel      A = [A_1 ; ... ; A_t]    rank i computes X_i A_i; Y = sum_i X_i A_i

A column layer followed by a row layer needs no communication in between: the column
output shard (B, T, out/t) is exactly the row input shard. Two conjugate operators
bracket the pair:

    f   identity forward, all-reduce backward   (enter: X is used by every rank's A_i)
    g   all-reduce forward, identity backward   (exit: sum the t partial products)

Per-rank memory: the split weights take Psi_split / t (attention q/k/v/o and MLP weights,
the embedding and the output head); LayerNorms, row-layer biases and the position embedding
are replicated. Activations inside a column->row pair are 1/t; outside them (LayerNorm,
residual) each rank holds the full (B, T, C).

Communication per transformer layer (b batch, s sequence, h hidden), per rank:
    forward:  2 all-reduces of b*s*h elements (g after attention, g after the MLP)
    backward: 2 all-reduces of b*s*h elements (f before attention, f before the MLP), each started
              while the layers it feeds compute their weight gradients (CopyIntoLinears)
each costing 2(t-1)/t * b*s*h * bytes on a ring. The vocabulary-parallel embedding adds
one b*s*h all-reduce forward, the output head's f one backward, the loss three of b*s forward.

Sequence parallelism (arXiv 2205.05198, section 4.2.2) replaces f and g outside the pairs by an
all-gather and a reduce-scatter of the sequence: its operators, memory and traffic are in
shardlib/parallel/sequence.py; the layers here take `sequence_parallel=True` to use them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib.comm import ops
from shardlib.parallel.sequence import (
    GatherFromSequenceParallelRegion,
    GatherSequenceIntoLinears,
    ReduceScatterToSequenceParallelRegion,
    all_gather_along,
    input_gradient,
    parameter_gradients,
)

def rank_and_size(group=None) -> tuple[int, int]:
    """(this rank's index in the tensor-parallel group, t)."""
    return dist.get_rank(group), dist.get_world_size(group)


def check_divisible(size: int, t: int, what: str) -> None:
    if size % t:
        divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel size t={t}: "
                         f"use t in {divisors} or change {what}")


# ---------------------------------------------------------------------------------
# the collectives, skipped when t = 1


def all_reduce_copy(x: torch.Tensor, op=dist.ReduceOp.SUM, *, group=None) -> torch.Tensor:
    """x reduced over the group (sum by default), in a new tensor: x itself is left alone."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)  # never overwrite a tensor autograd holds
    ops.all_reduce(x, op=op, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/t of x along `dim` (no communication)."""
    rank, t = rank_and_size(group)
    return x if t == 1 else x.chunk(t, dim=dim)[rank].contiguous()


# ---------------------------------------------------------------------------------
# f and g, as autograd functions


class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, group=ctx.group), None  # (B, T, C): the sum of every rank's dX


class CopyIntoLinears(torch.autograd.Function):
    """f fused with the column-parallel layers that read its output (q, k and v read one): forward
    Y_j = X W_j^T + b_j. Backward dX = sum_j dY_j W_j, all-reduced asynchronously while the dW_j = dY_j^T X are
    computed: they need only what this rank holds, so the all-reduce hides behind them (Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication, by default since 2021-09; the planner's async_tp_backward).
    apply(x, group, w_1, b_1, w_2, b_2, ...), a b_j may be None; returns (Y_1, Y_2, ...), each (B, T, out_j/t)."""

    @staticmethod
    def forward(ctx, x, group, *params):  # x: (B, T, C), the same on every rank
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.bias_dtypes = group, [None if b is None else b.dtype for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))  # each (B, T, out_j/t)

    @staticmethod
    def backward(ctx, *grads):  # each (B, T, out_j/t)
        x, *weights = ctx.saved_tensors
        grad_x, work = None, None
        if ctx.needs_input_grad[0]:  # the model's first layer reads data: no dX, nothing to all-reduce
            grad_x = input_gradient(grads, weights)  # this rank's part of dX (B, T, C)
            if dist.get_world_size(ctx.group) > 1:
                work = ops.all_reduce(grad_x, group=ctx.group, async_op=True)
        grad_params = parameter_gradients(x, grads, weights, ctx.bias_dtypes, ctx.needs_input_grad[2:])  # meanwhile
        if work is not None:
            work.wait()
        return (None if grad_x is None else grad_x.to(x.dtype), None, *grad_params)


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_copy(x, group=group)  # (B, T, C)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dim forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, -1, group=group)  # (B, T, out/t) -> (B, T, out)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None  # (B, T, out) -> (B, T, out/t)


def enter_tp_region(x: torch.Tensor, *, group=None, sequence_parallel: bool = False) -> torch.Tensor:
    """f (or its all-gather under sequence parallelism): every rank gets the full (B, T, C)."""
    if sequence_parallel:
        return GatherFromSequenceParallelRegion.apply(x, group)
    return CopyToTensorParallelRegion.apply(x, group)


def exit_tp_region(x: torch.Tensor, *, group=None, sequence_parallel: bool = False) -> torch.Tensor:
    """g (or its reduce-scatter under sequence parallelism): sum the ranks' partial outputs."""
    if sequence_parallel:
        return ReduceScatterToSequenceParallelRegion.apply(x, group)
    return ReduceFromTensorParallelRegion.apply(x, group)


def column_parallel_linears(x: torch.Tensor, layers, *, group=None, sequence_parallel: bool = False,
                            keep_gathered_input: bool = False) -> tuple[torch.Tensor, ...]:
    """The outputs of column-parallel `layers` that read one input, entered once: f (one all-reduce
    backward for all of them, beside their weight gradients: CopyIntoLinears), or under sequence parallelism one
    all-gather of x (B, T/t, C), whose shard is what backward keeps (GatherSequenceIntoLinears). Each output
    (B, T, out_j/t)."""
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    if not sequence_parallel:
        return CopyIntoLinears.apply(x, group, *params)
    return GatherSequenceIntoLinears.apply(x, group, keep_gathered_input, *params)


# ---------------------------------------------------------------------------------
# layers. A sharded parameter carries `partition_dim` (the dim cut across ranks); one
# that sees only a sequence shard carries `sequence_parallel = True` (its grad is partial).


def shard_parameter(shape: tuple[int, ...], partition_dim: int | None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape))
    if partition_dim is not None:
        param.partition_dim = partition_dim
    return param


class ColumnParallelLinear(nn.Module):
    """nn.Linear(in, out) with its output features split: rank i holds weight rows
    [i*out/t, (i+1)*out/t). Input (B, T, in) replicated -> output (B, T, out/t),
    or (B, T, out) with gather_output; under sequence parallelism the input is (B, T/t, in), gathered
    (and kept as that shard for backward unless keep_gathered_input). `copy_input=False`: a plain
    linear of the input as given (several layers reading one input: see column_parallel_linears)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 gather_output: bool = False, sequence_parallel: bool = False, copy_input: bool = True,
                 keep_gathered_input: bool = False):
        super().__init__()
        _, t = rank_and_size(group)
        check_divisible(out_features, t, "out_features")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel, self.copy_input = gather_output, sequence_parallel, copy_input
        self.keep_gathered_input = keep_gathered_input
        self.weight = shard_parameter((out_features // t, in_features), partition_dim=0)
        self.bias = shard_parameter((out_features // t,), partition_dim=0) if bias else None
        _reset_like_linear(self.weight, self.bias, fan_in=in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            (y,) = column_parallel_linears(x, (self,), group=self.group, sequence_parallel=self.sequence_parallel,
                                           keep_gathered_input=self.keep_gathered_input)  # (B, T, out/t)
        else:
            y = F.linear(x, self.weight, self.bias)  # (B, T, out/t)
        return GatherFromTensorParallelRegion.apply(y, self.group) if self.gather_output else y

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, **options):
        """This rank's shard of a full nn.Linear (same weights as `linear`)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group, **options)
        layer.to(linear.weight.dtype)
        load_shards(layer, linear.state_dict(), group=group)
        return layer


class RowParallelLinear(nn.Module):
    """nn.Linear(in, out) with its input features split: rank i holds weight columns
    [i*in/t, (i+1)*in/t). Input (B, T, in/t) already split -> output (B, T, out) summed
    by g (under sequence parallelism (B, T/t, out)). The bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        _, t = rank_and_size(group)
        check_divisible(in_features, t, "in_features")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.sequence_parallel = sequence_parallel
        self.weight = shard_parameter((out_features, in_features // t), partition_dim=1)
        self.bias = shard_parameter((out_features,), partition_dim=None) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True
        _reset_like_linear(self.weight, self.bias, fan_in=in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, in/t)
        partial = F.linear(x, self.weight)  # (B, T, out): this rank's share of the sum
        # (B, T, out), or (B, T/t, out) under sequence parallelism
        y = exit_tp_region(partial, group=self.group, sequence_parallel=self.sequence_parallel)
        return y if self.bias is None else y + self.bias

    from_linear = classmethod(ColumnParallelLinear.from_linear.__func__)  # the same: cut the full layer's tensors


def _reset_like_linear(weight: nn.Parameter, bias: nn.Parameter | None, fan_in: int) -> None:
    """nn.Linear's default bounds, from the full layer's fan-in (to match a single device
    exactly, build the full layer and use `from_linear`)."""
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


# ---------------------------------------------------------------------------------
# moving between full and sharded weights


@torch.no_grad()
def load_shards(module: nn.Module, full_state: dict[str, torch.Tensor], *, group=None) -> None:
    """Copy this rank's slice of every parameter from a full (single-device) state dict."""
    rank, t = rank_and_size(group)
    params = dict(module.named_parameters())
    if set(params) != set(full_state):
        raise ValueError(f"state dict does not match the model: missing {sorted(set(params) - set(full_state))}, "
                         f"unexpected {sorted(set(full_state) - set(params))}")
    for name, param in params.items():
        dim = getattr(param, "partition_dim", None)
        piece = full_state[name] if dim is None else full_state[name].chunk(t, dim=dim)[rank]
        if piece.shape != param.shape or piece.dtype != param.dtype:
            raise ValueError(f"{name}: slice {tuple(piece.shape)} {piece.dtype} does not fit the shard "
                             f"{tuple(param.shape)} {param.dtype}")
        param.copy_(piece)


@torch.no_grad()
def gather_full_state_dict(module: nn.Module, *, group=None, grads: bool = False) -> dict[str, torch.Tensor]:
    """The single-device state dict, on every rank: shards all-gathered along `partition_dim`.
    With grads=True, the full gradients of the parameters that require them (None as zeros)."""
    full, t = {}, dist.get_world_size(group)
    for name, param in module.named_parameters():
        if grads and not param.requires_grad:
            continue
        tensor = (param.grad if param.grad is not None else torch.zeros_like(param)) if grads else param.detach()
        dim = getattr(param, "partition_dim", None)
        full[name] = tensor.clone() if dim is None or t == 1 else all_gather_along(tensor, dim, group=group)
    return full
