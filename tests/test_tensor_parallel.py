"""Tensor parallelism against unsharded PyTorch: layers vs nn.Linear / nn.Embedding /
F.cross_entropy, the GPT vs one device, the ledger vs the Megatron formula, and bad sizes.

References are computed inside each rank from the full module built on the same seed, so
every rank can compare its shard with the matching slice of the unsharded result.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib import RankError, launch
from shardlib.comm import comm_ledger, ring_sent_bytes
from shardlib.models import GPTConfig, build_gpt
from shardlib.reference import compare_state, model_loss
from shardlib.parallel.sequence import sequence_parallel_collectives
from shardlib.parallel.tensor import ColumnParallelLinear, RowParallelLinear, gather_full_state_dict
from shardlib.checks.harness import TOLERANCE
from shardlib.checks.tensor import verify_tp
from shardlib.parallel.tensor_gpt import (VocabParallelEmbedding, check_tp_config, parallelize_gpt,
                             vocab_parallel_cross_entropy)

B, T, D_IN, D_OUT = 2, 8, 12, 24  # divisible by t = 1, 2, 3, 4 (sequence parallelism: tests/test_sequence_parallel.py)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _full_linear_pair(seed: int = 0):
    """nn.Linear(D_IN, D_OUT) -> nn.Linear(D_OUT, D_IN), an input, and output weights for a loss."""
    torch.manual_seed(seed)
    first, second = nn.Linear(D_IN, D_OUT), nn.Linear(D_OUT, D_IN)
    x = torch.randn(B, T, D_IN)
    return first, second, x


# ---------------------------------------------------------------------------------
# layers


def _column_vs_linear(gather_output: bool) -> list[bool]:
    rank, t = dist.get_rank(), dist.get_world_size()
    full, _, x = _full_linear_pair()
    weights = torch.randn(B, T, D_OUT, generator=torch.Generator().manual_seed(7))  # loss = sum(w * y)
    x_ref = x.clone().requires_grad_()
    (full(x_ref) * weights).sum().backward()
    y_ref = full(x).detach()

    layer = ColumnParallelLinear.from_linear(full, gather_output=gather_output)
    x_tp = x.clone().requires_grad_()
    y = layer(x_tp)
    cols = slice(rank * D_OUT // t, (rank + 1) * D_OUT // t)
    (y * (weights if gather_output else weights[..., cols])).sum().backward()
    return [_close(y, y_ref if gather_output else y_ref[..., cols]),  # (B, T, out) or (B, T, out/t)
            _close(x_tp.grad, x_ref.grad),  # f: the all-reduce backward gives every rank the full dX
            _close(layer.weight.grad, full.weight.grad[cols]),
            _close(layer.bias.grad, full.bias.grad[cols])]


def _row_vs_linear() -> list[bool]:
    rank, t = dist.get_rank(), dist.get_world_size()
    _, full, _ = _full_linear_pair()
    x = torch.randn(B, T, D_OUT, generator=torch.Generator().manual_seed(3))
    weights = torch.randn(B, T, D_IN, generator=torch.Generator().manual_seed(7))
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref)
    (y_ref * weights).sum().backward()

    layer = RowParallelLinear.from_linear(full)
    cols = slice(rank * D_OUT // t, (rank + 1) * D_OUT // t)
    x_shard = x[..., cols].clone().requires_grad_()  # (B, T, in/t)
    y = layer(x_shard)
    (y * weights).sum().backward()
    return [_close(y, y_ref.detach()),  # g: the all-reduce forward gives every rank the full Y
            _close(x_shard.grad, x_ref.grad[..., cols]),
            _close(layer.weight.grad, full.weight.grad[:, cols]),
            _close(layer.bias.grad, full.bias.grad)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_column_and_row_parallel_match_nn_linear(world_size):
    """Outputs, input gradients and weight/bias gradients equal the unsharded layer's slices."""
    for fn in (_row_vs_linear, lambda: _column_vs_linear(False), lambda: _column_vs_linear(True)):
        assert all(all(r) for r in launch(fn, world_size)), fn


def _column_under_autocast(sequence_parallel: bool) -> list[bool]:
    """A column layer under autocast against nn.Linear under autocast: outputs in bf16, gradients in the parameters'
    and the input's fp32, equal up to bf16 rounding (its products run in bf16 either way)."""
    rank, t = dist.get_rank(), dist.get_world_size()
    full, _, x = _full_linear_pair()
    weights = torch.randn(B, T, D_OUT, generator=torch.Generator().manual_seed(7))
    x_ref = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = full(x_ref)
    (y_ref.float() * weights).sum().backward()
    layer = ColumnParallelLinear.from_linear(full, sequence_parallel=sequence_parallel)
    rows = slice(rank * T // t, (rank + 1) * T // t) if sequence_parallel else slice(None)  # this rank's positions
    cols = slice(rank * D_OUT // t, (rank + 1) * D_OUT // t)
    x_in = x[:, rows].clone().requires_grad_()  # (B, T/t, C) or (B, T, C)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x_in)
    (y.float() * weights[..., cols]).sum().backward()
    near = lambda a, b: a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=3e-2, atol=3e-2)  # noqa
    return [near(y, y_ref[..., cols]), near(x_in.grad, x_ref.grad[:, rows]),
            near(layer.weight.grad, full.weight.grad[cols]), near(layer.bias.grad, full.bias.grad[cols])]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_layers_run_under_autocast(sequence_parallel):
    # autograd runs backward outside autocast: the bf16 output gradients meet fp32 weights there
    assert all(all(r) for r in launch(_column_under_autocast, 2, args=(sequence_parallel,)))


def _backward_events(input_grad: bool) -> list[str]:
    """What the backward of two column layers reading one input does, in order: products, and the all-reduce of dX
    (started, waited for)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import shardlib.parallel.tensor as tensor

    events, all_reduce = [], tensor.ops.all_reduce

    class Products(TorchDispatchMode):  # what reaches the kernels, backward included
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
                events.append("product")
            return func(*args, **(kwargs or {}))

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def logged_all_reduce(*args, async_op=False, **kwargs):
        events.append("all_reduce, async" if async_op else "all_reduce")
        work = all_reduce(*args, async_op=async_op, **kwargs)
        return Logged(work) if async_op else work

    full, _, x = _full_linear_pair()
    layers = [ColumnParallelLinear.from_linear(full, copy_input=False) for _ in range(2)]
    outputs = tensor.column_parallel_linears(x.clone().requires_grad_(input_grad), layers)
    tensor.ops.all_reduce = logged_all_reduce
    try:
        with Products():
            sum(y.sum() for y in outputs).backward()
    finally:
        tensor.ops.all_reduce = all_reduce
    return events


def test_column_input_gradient_is_all_reduced_while_the_weight_gradients_are_computed():
    # Megatron-LM's asynchronous f (LinearWithGradAccumulationAndAsyncCommunication): dX first, its all-reduce
    # started, the two dW products while it runs, then the wait; what the planner's async_tp_backward costs
    for events in launch(_backward_events, 2, args=(True,)):
        assert events == ["product"] * 2 + ["all_reduce, async"] + ["product"] * 2 + ["wait"], events
    for events in launch(_backward_events, 2, args=(False,)):  # the first layer reads data: dW only, no all-reduce
        assert events == ["product"] * 2, events


def _vocab_parallel_vs_torch(vocab: int, scale: float) -> list[bool]:
    rank, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    embedding = nn.Embedding(vocab, 6)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    logits = (scale * torch.randn(B, T, vocab, generator=g)).requires_grad_()  # large: softmax overflows naively
    targets = torch.randint(0, vocab, (B, T), generator=g)
    loss_ref = F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
    loss_ref.backward()
    emb_weights = torch.randn(B, T, 6, generator=g)
    (embedding(ids) * emb_weights).sum().backward()

    shard = slice(rank * vocab // t, (rank + 1) * vocab // t)
    tp_embedding = VocabParallelEmbedding.from_embedding(embedding)
    out = tp_embedding(ids)
    (out * emb_weights).sum().backward()
    local_logits = logits.detach()[..., shard].clone().requires_grad_()  # (B, T, V/t)
    loss = vocab_parallel_cross_entropy(local_logits, targets)
    loss.backward()
    return [_close(out, embedding(ids).detach()), _close(tp_embedding.weight.grad, embedding.weight.grad[shard]),
            bool(torch.isclose(loss, loss_ref, rtol=1e-6)), _close(local_logits.grad, logits.grad[..., shard])]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("scale", [1.0, 200.0])
def test_vocab_parallel_embedding_and_cross_entropy_match_torch(world_size, scale):
    assert all(all(r) for r in launch(_vocab_parallel_vs_torch, world_size, args=(32, scale)))


# ---------------------------------------------------------------------------------
# the GPT against one device


@pytest.mark.slow
@pytest.mark.parametrize("technique,world_size", [("tp", 2), ("tp", 3), ("tp-sp", 2), ("tp-sp", 3), ("tp-sp", 4)])
def test_gpt_matches_single_device(technique, world_size):
    """5 AdamW steps of the small GPT: losses, step-1 gradients and parameters within 1e-5 relative
    of the single-device run, in float64 (shardlib/checks/harness.py says why); the ledger and the
    bytes a bf16 block saves against their formulas. At t = 3 sequence parallelism pads 64 tokens to 66."""
    result = verify_tp(world_size, technique=technique)
    assert result["passed"], result
    assert result["max_rel_diff"] <= TOLERANCE


def _round_trip(sequence_parallel: bool) -> bool:
    model = build_gpt(GPTConfig(), seed=0)
    tp = parallelize_gpt(model.state_dict(), config=model.config, sequence_parallel=sequence_parallel)
    full = gather_full_state_dict(tp)
    return compare_state(full, model.state_dict()) == (0.0, 0.0) and sum(p.numel() for p in tp.parameters()) < \
        model.config.n_params * (1 if dist.get_world_size() == 1 else 0.6)


def test_parallelize_then_gather_gives_the_checkpoint_back():
    assert all(launch(_round_trip, 2, args=(False,)))


# ---------------------------------------------------------------------------------
# communication: two all-reduces of b*s*h per layer forward, two backward (arXiv 1909.08053)


LEDGER_GPT = GPTConfig(n_layer=3, n_head=4, n_embd=32, seq_len=16)


def _step_ledger(sequence_parallel: bool, b: int, keep_gathered_input: bool = False) -> tuple[list, list]:
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (b, LEDGER_GPT.seq_len + 1))
    model = parallelize_gpt(build_gpt(LEDGER_GPT, seed=0), sequence_parallel=sequence_parallel,
                            keep_gathered_input=keep_gathered_input)
    with comm_ledger() as forward:
        loss = model_loss(model, (tokens[:, :-1], tokens[:, 1:]))
    with comm_ledger() as backward:
        loss.backward()
    return ([(r.kind, r.nbytes // 4) for r in forward.records], [(r.kind, r.nbytes // 4) for r in backward.records])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ledger_two_all_reduces_per_layer_each_way(world_size):
    b, s, h, L = 3, LEDGER_GPT.seq_len, LEDGER_GPT.n_embd, LEDGER_GPT.n_layer
    for forward, backward in launch(_step_ledger, world_size, args=(False, b)):
        # embedding, then per layer attention's g and the MLP's g, then the loss's max, target and sum-exp
        assert forward == [("all_reduce", b * s * h)] * (1 + 2 * L) + [("all_reduce", b * s)] * 3
        # per layer the MLP's f and attention's f, plus the output head's f
        assert backward == [("all_reduce", b * s * h)] * (2 * L + 1)


@pytest.mark.parametrize("keep_gathered_input", [False, True])
def test_ledger_sequence_parallel_gathers_again_in_backward(keep_gathered_input):
    """Per layer 2 all-gathers + 2 reduce-scatters forward (the all-reduces' bytes); backward the same
    plus, unless the gathered inputs are kept, 2 all-gathers again (and one for the output head):
    10 (t-1)/t b s h e per layer on a ring against tensor parallelism's 8."""
    b, s, h, L, t = 2, LEDGER_GPT.seq_len, LEDGER_GPT.n_embd, LEDGER_GPT.n_layer, 2
    forward, backward = launch(_step_ledger, t, args=(True, b, keep_gathered_input))[0]
    bsh = b * s * h
    layer_forward, layer_backward = sequence_parallel_collectives(b, s, h, keep_gathered_input=keep_gathered_input)
    loss = [("all_reduce", b * s)] * 3
    assert forward == [("reduce_scatter", bsh)] + layer_forward * L + [("all_gather", bsh)] + loss
    head = [] if keep_gathered_input else [("all_gather", bsh)]  # the output head's input, gathered again
    assert backward == head + [("reduce_scatter", bsh)] + layer_backward * L + [("all_gather", bsh)]
    assert sum(kind == "all_gather" for kind, _ in backward) == (2 * L + 1) * (1 if keep_gathered_input else 2)
    per_layer = sum(ring_sent_bytes(kind, n, t) for kind, n in layer_forward + layer_backward)
    tp_per_layer = 4 * ring_sent_bytes("all_reduce", bsh, t)
    assert per_layer == (tp_per_layer if keep_gathered_input else tp_per_layer * 10 // 8)


def test_no_communication_at_t1():
    forward, backward = launch(_step_ledger, 1, args=(False, 2))[0]
    assert forward == [] and backward == []


# ---------------------------------------------------------------------------------
# bad sizes: clear errors, before any process starts where possible


@pytest.mark.parametrize("config,t,what", [
    (GPTConfig(n_head=4, n_embd=64), 3, "n_head"),
    (GPTConfig(vocab_size=250, n_head=4, n_embd=64), 4, "vocab_size"),
    (GPTConfig(n_head=6, n_embd=48, vocab_size=255), 2, "vocab_size=255"),
    (GPTConfig(), 0, ">= 1"),
])
def test_indivisible_sizes_raise_naming_the_size(config, t, what):
    with pytest.raises(ValueError, match=what):
        check_tp_config(config, t)


def test_verify_rejects_bad_size_before_launching(monkeypatch):
    import shardlib.checks.harness as harness

    def no_launch(*args, **kwargs):
        raise AssertionError("launch must not be reached")

    monkeypatch.setattr(harness, "launch", no_launch)
    with pytest.raises(ValueError, match="n_head=12 is not divisible by the tensor-parallel size t=5"):
        verify_tp(5)


def _build_indivisible_linear():
    ColumnParallelLinear(10, 15)


def test_layer_with_indivisible_features_names_it_in_the_rank_error():
    with pytest.raises(RankError, match="out_features=15 is not divisible"):
        launch(_build_indivisible_linear, 2)


def test_state_dict_without_config_is_refused():
    with pytest.raises(ValueError, match="config"):
        parallelize_gpt(build_gpt(GPTConfig(), seed=0).state_dict())
