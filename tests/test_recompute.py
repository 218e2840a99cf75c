"""shardlib.parallel.recompute: the same gradients as no recomputation and as PyTorch's checkpoint; the
activation bytes each mode keeps, counted term by term here and against Korthikanti et al.'s 16-bit
formula (arXiv 2205.05198); the extra FLOPs counted by PyTorch's FlopCounterMode; clear errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from shardlib.memory import activation_bytes_per_layer, saved_activations
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.recompute import apply_recompute, eager_attention, recompute
from shardlib.reference import model_loss

CONFIG = GPTConfig(seq_len=32, n_layer=2, n_head=4, n_embd=48)


def _grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _max_rel(a: dict, b: dict) -> float:
    assert set(a) == set(b), f"different gradients: {sorted(set(a) ^ set(b))}"
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in b)


def test_recompute_matches_plain_backward_and_torch_checkpoint():
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)

    def fn(t):
        return torch.tanh(t @ w) @ w.t()

    results = {}
    for name, run in {"plain": fn, "ours": lambda t: recompute(fn, t),
                      "torch": lambda t: checkpoint(fn, t, use_reentrant=False)}.items():
        w.grad = x.grad = None
        run(x).pow(2).sum().backward()
        results[name] = (w.grad.clone(), x.grad.clone())
    for name in ("ours", "torch"):
        for got, want in zip(results[name], results["plain"]):
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), f"{name}: gradients differ from plain backward"


def test_recompute_replays_the_same_dropout_mask():
    x = torch.randn(64, 64, requires_grad=True)

    def fn(t):
        return F.dropout(t, p=0.5, training=True) * 3.0

    torch.manual_seed(7)
    plain = fn(x)
    plain.sum().backward()
    want = x.grad.clone()
    x.grad = None
    torch.manual_seed(7)
    ours = recompute(fn, x)
    assert torch.equal(ours, plain), "the forward under recompute drew another dropout mask"
    ours.sum().backward()
    assert torch.equal(x.grad, want), "backward's second forward drew another dropout mask than the first"


@pytest.mark.parametrize("mode", [None, "selective", "full"])
def test_gpt_gradients_equal_without_recomputation(mode):
    batch = random_token_batches(CONFIG, 3, 1)[0]
    sdpa = build_gpt(CONFIG, seed=0)  # the course GPT as it is: PyTorch's fused attention
    model_loss(sdpa, batch).backward()
    plain = apply_recompute(build_gpt(CONFIG, seed=0), None)
    model_loss(plain, batch).backward()
    ours = apply_recompute(build_gpt(CONFIG, seed=0), mode)
    loss = model_loss(ours, batch)
    loss.backward()
    assert _max_rel(_grads(ours), _grads(plain)) < 1e-6, f"{mode}: gradients differ from the same model without recomputation"
    assert _max_rel(_grads(ours), _grads(sdpa)) < 1e-5, f"{mode}: gradients differ from the fused-attention GPT"


def _itemized_elements(s, b, h, a, mode):
    """What one block saves, listed op by op (fp32 course GPT, dropout 0)."""
    layer_norms = 2 * s * b * h + 4 * s * b  # the two LayerNorms' inputs, their means and 1/std
    projections_in = 2 * s * b * h  # ln_1 output (q, k, v projections' input), ln_2 output (fc's input)
    qkv = 3 * s * b * h  # q and k for the scores, v for the weighted sum
    probabilities = a * s * s * b  # softmax output: read by its own backward and by p @ v
    o_proj_in = s * b * h
    mlp = 4 * s * b * h + 4 * s * b * h  # GELU's input and output (proj's input)
    everything = layer_norms + projections_in + qkv + probabilities + o_proj_in + mlp
    return {None: everything, "selective": everything - probabilities, "full": s * b * h}[mode]


@pytest.mark.parametrize("mode", [None, "selective", "full"])
@pytest.mark.parametrize("shape", [(32, 2, 48, 4), (24, 3, 64, 8)])
def test_activation_bytes_per_block_match_the_itemized_count(mode, shape):
    s, b, h, a = shape
    model = apply_recompute(build_gpt(GPTConfig(seq_len=s, n_layer=1, n_head=a, n_embd=h), seed=0), mode)
    x = torch.randn(b, s, h, requires_grad=True)
    measured = sum(r["bytes"] for r in saved_activations(model.blocks[0], x))
    assert measured == 4 * _itemized_elements(s, b, h, a, mode), f"mode {mode}: {measured} B saved"


def test_16bit_bytes_are_the_paper_formula_less_dropout():
    """Korthikanti et al.'s s b h (34 + 5 a s / h) counts dropout too: per layer 2 sbh bytes of masks
    (1 byte each) after attention and MLP, and 3 a s^2 b bytes of attention dropout (mask + output)."""
    s, b, h, a = 32, 2, 64, 4
    model = apply_recompute(build_gpt(GPTConfig(seq_len=s, n_layer=1, n_head=a, n_embd=h), seed=0), None)
    model = model.to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    measured = sum(r["bytes"] for r in saved_activations(model.blocks[0], x))
    layer_norm_stats = 2 * 4 * s * b  # (b, s, 1) mean and 1/std of 2 LayerNorms, bf16 here
    paper = activation_bytes_per_layer(s, b, h, a)
    assert measured == paper - 2 * s * b * h - 3 * a * s * s * b + layer_norm_stats, f"{measured} vs paper {paper}"


@pytest.mark.parametrize("mode,extra", [(None, 0), ("selective", "core"), ("full", "forward")])
def test_flops_counted_by_pytorch(mode, extra):
    s, b, h = CONFIG.seq_len, 2, CONFIG.n_embd
    block = apply_recompute(build_gpt(CONFIG, seed=0), mode).blocks[0]
    x = torch.randn(b, s, h, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        block(x).sum().backward()
    forward = 2 * b * s * h * (3 * h) + 2 * b * s * h * h + 2 * b * s * h * 8 * h  # q k v, o, fc + proj
    forward += 2 * b * s * s * h * 2  # q k^T and p v
    repeated = {0: 0, "core": 4 * b * s * s * h, "forward": forward}[extra]
    assert counter.get_total_flops() == 3 * forward + repeated, f"{mode}: {counter.get_total_flops()} FLOPs"


@pytest.mark.parametrize("early_stop", [True, False])
def test_pytorchs_checkpoint_stops_before_the_last_product(early_stop):
    # PyTorch's non-reentrant checkpoint (by default since 2.1, pytorch/pytorch#96866) stops recomputing once it has
    # every tensor the backward saved: in a block that is the MLP's down-projection input, so the down projection's
    # forward (2 b s 4h h FLOPs) and the add after it are not run again. shardlib's `recompute`, like Megatron-LM's,
    # runs the whole forward again (test_flops_counted_by_pytorch); the planner's checkpoint_early_stop is this
    s, b, h = CONFIG.seq_len, 2, CONFIG.n_embd
    block = apply_recompute(build_gpt(CONFIG, seed=0), None).blocks[0]
    x = torch.randn(b, s, h, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop), FlopCounterMode(display=False) as counter:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    forward = 2 * b * s * h * (3 * h) + 2 * b * s * h * h + 2 * b * s * h * 8 * h + 2 * b * s * s * h * 2
    down = 2 * b * s * 4 * h * h
    assert counter.get_total_flops() == 3 * forward + forward - (down if early_stop else 0)


def test_eager_attention_equals_pytorchs():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(eager_attention(q, k, v), want, atol=1e-6), "written-out attention differs from SDPA"


def test_modes_can_be_switched_back():
    model = apply_recompute(build_gpt(CONFIG, seed=0), "full")
    apply_recompute(model, None)
    x = torch.randn(1, CONFIG.seq_len, CONFIG.n_embd, requires_grad=True)
    assert sum(r["bytes"] for r in saved_activations(model.blocks[0], x)) > 4 * CONFIG.seq_len * CONFIG.n_embd


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="mode must be one of"):
        apply_recompute(build_gpt(CONFIG), "partial")
    with pytest.raises(ValueError, match="attention must be"):
        apply_recompute(build_gpt(CONFIG), None, attention="flash")
    with pytest.raises(TypeError, match="needs the course GPT"):
        apply_recompute(torch.nn.Linear(2, 2), "full")
    with pytest.raises(TypeError, match="takes tensors only"):
        recompute(lambda t, n: t * n, torch.ones(2), 3)


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["recompute-selective", "recompute-full"])
def test_verify_recompute_on_two_ranks(technique):
    from shardlib.checks.time import verify_recompute

    record = verify_recompute(2, technique=technique)
    assert record["passed"], record["detail"]
