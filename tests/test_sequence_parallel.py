"""Sequence parallelism against unsharded PyTorch and against the paper: the layers vs nn.Linear
(both what backward keeps), the bytes a block saves vs Korthikanti et al.'s formula (arXiv 2205.05198)
with the remainder named, meta tensors, bad options. The GPT against one device and the ledger of a
training step: tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib import launch
from shardlib.checks.tensor import block_saved_bytes, block_saved_bytes_formula
from shardlib.comm import comm_ledger
from shardlib.memory import activation_bytes_per_layer, course_gpt_activation_terms
from shardlib.models import GPTConfig
from shardlib.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from shardlib.parallel.sequence import sequence_parallel_collectives
from shardlib.parallel.tensor_gpt import ParallelBlock, check_layer_options

B, T, D_IN, D_OUT = 2, 8, 12, 24  # divisible by t = 1, 2, 4


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _pair_vs_linear(keep_gathered_input: bool) -> tuple[list[bool], list[str]]:
    """Column -> GELU -> row under sequence parallelism, in and out (B, T/t, C) shards; and the
    collectives of backward."""
    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    first, second = nn.Linear(D_IN, D_OUT), nn.Linear(D_OUT, D_IN)
    x = torch.randn(B, T, D_IN)
    weights = torch.randn(B, T, D_IN, generator=torch.Generator().manual_seed(7))
    x_ref = x.clone().requires_grad_()
    y_ref = second(F.gelu(first(x_ref)))
    (y_ref * weights).sum().backward()

    column = ColumnParallelLinear.from_linear(first, sequence_parallel=True, keep_gathered_input=keep_gathered_input)
    row = RowParallelLinear.from_linear(second, sequence_parallel=True)
    rows = slice(rank * T // t, (rank + 1) * T // t)
    x_shard = x[:, rows].clone().requires_grad_()  # (B, T/t, C)
    y = row(F.gelu(column(x_shard)))  # (B, T/t, C)
    with comm_ledger() as backward:
        (y * weights[:, rows]).sum().backward()
    bias_grad = row.bias.grad.clone()
    dist.all_reduce(bias_grad)  # the row bias saw only T/t positions: its gradient is partial
    hidden = slice(rank * D_OUT // t, (rank + 1) * D_OUT // t)
    return ([_close(y, y_ref.detach()[:, rows]), _close(x_shard.grad, x_ref.grad[:, rows]),
             _close(column.weight.grad, first.weight.grad[hidden]), _close(column.bias.grad, first.bias.grad[hidden]),
             _close(row.weight.grad, second.weight.grad[:, hidden]), _close(bias_grad, second.bias.grad)],
            [r.kind for r in backward.records])


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("keep_gathered_input", [False, True])
def test_sequence_parallel_pair_matches_nn_linear(world_size, keep_gathered_input):
    """Outputs and every gradient equal the unsharded pair's slices, whichever input backward keeps;
    keeping the shard costs one all-gather more in backward (the column layer's input, gathered again)."""
    for checks, kinds in launch(_pair_vs_linear, world_size, args=(keep_gathered_input,)):
        assert all(checks), checks
        regather = [] if keep_gathered_input else ["all_gather"]
        assert kinds == ["all_gather"] + regather + ["reduce_scatter"], kinds  # g's backward, then the column's


def _first_layer_backward(keep_gathered_input: bool) -> tuple[bool, list[str]]:
    """A column layer reading data (no gradient wanted for it): its weight gradient, and the collectives of
    backward."""
    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    first, x = nn.Linear(D_IN, D_OUT), torch.randn(B, T, D_IN)
    first(x).sum().backward()
    column = ColumnParallelLinear.from_linear(first, sequence_parallel=True, keep_gathered_input=keep_gathered_input)
    rows, hidden = slice(rank * T // t, (rank + 1) * T // t), slice(rank * D_OUT // t, (rank + 1) * D_OUT // t)
    y = column(x[:, rows])  # (B, T/t, C) of data in
    with comm_ledger() as backward:
        y.sum().backward()
    return _close(column.weight.grad, first.weight.grad[hidden]), [r.kind for r in backward.records]


@pytest.mark.parametrize("keep_gathered_input", [False, True])
def test_a_first_layer_reading_data_reduce_scatters_no_input_gradient(keep_gathered_input):
    # dW needs the gathered input; nobody needs dX, so it is neither computed nor reduce-scattered
    for right, kinds in launch(_first_layer_backward, 2, args=(keep_gathered_input,)):
        assert right and kinds == ([] if keep_gathered_input else ["all_gather"]), kinds


# ---------------------------------------------------------------------------------
# activation bytes per layer: measured, the course GPT's formula, the paper's


MEMORY_GPT = GPTConfig()  # the course's small GPT: s=64, h=64, a=4 (5as/h = 20: the s^2 term is large)
MEMORY_BATCH = 4
VARIANTS = [dict(sequence_parallel=False), dict(sequence_parallel=True),
            dict(sequence_parallel=True, keep_gathered_input=True),
            dict(sequence_parallel=False, recompute="selective"), dict(sequence_parallel=True, recompute="selective")]


def _saved_per_variant() -> list[int]:
    return [block_saved_bytes(MEMORY_GPT, MEMORY_BATCH, **options) for options in VARIANTS]


@pytest.mark.parametrize("t", [2, 4])
def test_saved_bytes_per_layer_match_the_formula_to_the_byte(t):
    """bf16 block: the bytes measured with saved-tensor hooks equal the course GPT's terms exactly;
    the paper's sbh/t (34 + 5as/h) (selective: 34 sbh/t) differs from them by the named remainder."""
    measured = launch(_saved_per_variant, t)
    assert all(r == measured[0] for r in measured), f"ranks disagree: {measured}"
    s, b, h, a = MEMORY_GPT.seq_len, MEMORY_BATCH, MEMORY_GPT.n_embd, MEMORY_GPT.n_head
    sbh = s * b * h
    for options, saved in zip(VARIANTS, measured[0]):
        assert saved == block_saved_bytes_formula(MEMORY_GPT, MEMORY_BATCH, t, **options), (options, saved)
        if options.get("keep_gathered_input"):
            continue
        sp, selective = options["sequence_parallel"], options.get("recompute") == "selective"
        paper = activation_bytes_per_layer(s, b, h, a, options.get("recompute"), tp=t, sequence_parallel=sp)
        out = t if sp else 1
        # the course GPT: no dropout after attention and MLP (2 sbh), no s x s tensors (5 a s^2 b / t),
        # but LayerNorm statistics (2 x 2 bf16 per token) and, without recomputation, an fp32 log-sum-exp
        remainder = 2 * sbh / out + (0 if selective else 5 * a * s * s * b / t) - 8 * s * b / out \
            - (0 if selective else 4 * a * s * b / t)
        assert paper - saved == remainder, (options, paper, saved, remainder)
    by_name = dict(zip(("tp", "sp", "keep", "tp_sel", "sp_sel"), measured[0]))
    assert by_name["keep"] - by_name["sp"] == 2 * 2 * sbh * (t - 1) // t  # the two column inputs kept whole
    assert by_name["sp"] < by_name["keep"] < by_name["tp"], by_name
    # and the check fails on the wrong variant: keeping the gathered inputs is off the default's formula
    assert by_name["keep"] != block_saved_bytes_formula(MEMORY_GPT, MEMORY_BATCH, t, sequence_parallel=True)


def test_paper_terms_add_up_to_the_paper_formula():
    """The paper column of the term table is Korthikanti et al.'s count: GPT-3 175B's layer (s=2048, b=1,
    h=12288, a=96) at t=8: sbh = 25,165,824; with sequence parallelism 25,165,824/8 * (34 + 80)."""
    s, b, h, a = 2048, 1, 12288, 96
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True) == 3_145_728 * 114
    assert activation_bytes_per_layer(s, b, h, a, tp=8) == 25_165_824 * 10 + 3_145_728 * (24 + 80)
    assert activation_bytes_per_layer(s, b, h, a, "selective", tp=8, sequence_parallel=True) == 3_145_728 * 34
    for recompute in (None, "selective"):
        for sp in (False, True):
            terms = course_gpt_activation_terms(s, b, h, a, recompute, tp=8, sequence_parallel=sp)
            assert sum(row["paper"] for row in terms) == activation_bytes_per_layer(
                s, b, h, a, recompute, tp=8, sequence_parallel=sp)


# ---------------------------------------------------------------------------------
# meta tensors and a fake process group: the same code at 70B shapes, no data read


def _meta_block_on_a_fake_group(t: int) -> list:
    """One rank of a t-way group that moves no data (PyTorch's fake process group), running a
    Llama-2-70B-sized layer (h = 8192, 64 heads, s = 4096) on meta tensors: the collectives issued."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()  # this rank's one-process gloo group, replaced by a fake t-way one
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=t)
    config, out = GPTConfig(n_embd=8192, n_head=64, seq_len=4096), []
    for keep in (False, True):
        with torch.device("meta"):
            block = ParallelBlock(config, sequence_parallel=True, keep_gathered_input=keep).to(torch.bfloat16)
            x = torch.randn(1, 4096 // t, 8192, dtype=torch.bfloat16, requires_grad=True)  # (B, T/t, C)
        with comm_ledger() as forward:
            y = block(x)
        with comm_ledger() as backward:
            y.sum().backward()
        assert x.grad.shape == x.shape and block.mlp.fc.weight.grad.shape == (4 * 8192 // t, 8192)
        out.append(([(r.kind, r.nbytes // 2) for r in forward.records],
                    [(r.kind, r.nbytes // 2) for r in backward.records]))
    return out


def test_sequence_parallel_block_runs_on_meta_tensors():
    """The same code at full scale reads no data (no .item(), no branch on values): on meta tensors it
    issues the collectives of the formula, with and without the gathered inputs kept."""
    (out,) = launch(_meta_block_on_a_fake_group, 1, args=(8,))
    for keep, collectives in zip((False, True), out):
        assert collectives == sequence_parallel_collectives(1, 4096, 8192, keep_gathered_input=keep), keep


# ---------------------------------------------------------------------------------
# bad options: clear errors


@pytest.mark.parametrize("options,what", [
    (dict(sequence_parallel=False, keep_gathered_input=True, recompute=None), "use it with sequence_parallel=True"),
    (dict(sequence_parallel=True, keep_gathered_input=False, recompute="full"), "recompute must be one of"),
])
def test_options_that_do_not_go_together_are_refused(options, what):
    with pytest.raises(ValueError, match=what):
        check_layer_options(**options)  # what TensorParallelGPT and ParallelSelfAttention call first


def test_terms_refuse_what_the_code_does_not_have():
    with pytest.raises(ValueError, match="recompute must be None or 'selective'"):
        course_gpt_activation_terms(64, 1, 64, 4, "full")
    with pytest.raises(ValueError, match="use sequence_parallel=True"):
        course_gpt_activation_terms(64, 1, 64, 4, keep_gathered_input=True)
