"""shardlib.parallel.precision: loss scaling against torch.amp.GradScaler, overflow skips, what the master
weights keep that 16-bit weights lose (worked out from the formats' spacing), the bytes each copy costs,
and training against PyTorch's own mixed precision (autocast + GradScaler)."""

from __future__ import annotations

import pytest
import torch

from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.precision import (DynamicLossScaler, MixedPrecisionOptimizer, lost_update_fraction,
                                         underflow_fraction)
from shardlib.reference import model_loss

CONFIG = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)


def test_loss_scale_follows_torch_gradscaler():
    overflows = [False, False, True, False, False, False, False, True, True, False, False, False, False]
    param = torch.nn.Parameter(torch.zeros(3))
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    optimizer = torch.optim.SGD([param], lr=0.1)
    ours = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    for step, overflow in enumerate(overflows):
        optimizer.zero_grad()
        torch_scaler.scale(param.sum()).backward()
        if overflow:
            param.grad[0] = float("inf")
        torch_scaler.step(optimizer)
        torch_scaler.update()
        ours.update(overflow)
        assert ours.scale == torch_scaler.get_scale(), f"step {step}: scale {ours.scale} vs torch's {torch_scaler.get_scale()}"


def test_overflow_skips_the_step_and_halves_the_scale():
    model = build_gpt(CONFIG, seed=0)
    optimizer = MixedPrecisionOptimizer(model, torch.optim.AdamW, dtype=torch.float16, lr=1e-3)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer.backward(model_loss(model, random_token_batches(CONFIG, 2, 1)[0]))
    model.lm_head.weight.grad[0, 0] = float("inf")
    assert optimizer.step() is False, "a step with an infinite gradient must be skipped"
    assert optimizer.loss_scale == 2.0**15 and optimizer.skipped_steps == 1, f"scale {optimizer.loss_scale}"
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters()), "a skipped step changed weights"


def test_master_weights_keep_updates_that_bf16_rounds_away():
    # bf16 keeps 8 significant bits: numbers in [1, 2) are 2^-7 apart, so 1 + u rounds back to 1 for |u| < 2^-8.
    ones = torch.ones(1000)
    assert lost_update_fraction(ones, torch.full((1000,), 2.0**-9)) == 1.0, "an update of 2^-9 on 1.0 survives bf16?"
    assert lost_update_fraction(ones, torch.full((1000,), 2.0**-6)) == 0.0, "an update of 2^-6 on 1.0 is lost in bf16?"
    for master_weights, moves in ((True, True), (False, False)):
        model = build_gpt(CONFIG, seed=0)
        optimizer = MixedPrecisionOptimizer(model, torch.optim.SGD, dtype=torch.bfloat16, lr=1.0,
                                            master_weights=master_weights)
        for _ in range(10):
            optimizer.zero_grad()
            for p in model.parameters():
                p.grad = torch.full_like(p, -2.0**-11)  # each step adds 2^-11 to every weight
            optimizer.step()
        state = optimizer.full_state_dict()
        ln = state["blocks.0.ln_1.weight"].float()  # initialised to 1.0: 10 * 2^-11 = 0.0049 in all
        moved = bool((ln - 1.0).abs().min() > 4e-3)
        assert moved == moves, f"master_weights={master_weights}: LayerNorm weights moved {moved}, expected {moves}"


def test_loss_scaling_brings_fp16_underflows_back():
    grads = [torch.full((100,), 1e-8), torch.full((100,), 1e-3)]  # fp16's smallest positive number is 2^-24 = 6e-8
    assert underflow_fraction(grads, torch.float16) == 0.5, "1e-8 should flush to zero in fp16"
    assert underflow_fraction(grads, torch.float16, scale=2.0**16) == 0.0, "scaled by 2^16, 1e-8 is 6.6e-4: representable"
    assert underflow_fraction(grads, torch.bfloat16) == 0.0, "bf16 has fp32's exponent range"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bytes_per_parameter(dtype):
    model = build_gpt(CONFIG, seed=0)
    optimizer = MixedPrecisionOptimizer(model, torch.optim.AdamW, dtype=dtype, lr=1e-3)
    optimizer.backward(model_loss(model, random_token_batches(CONFIG, 2, 1)[0]))
    assert optimizer.step()
    psi = CONFIG.n_params
    held = optimizer.state_bytes()
    expected = dict(params=2 * psi, grads=2 * psi, master=4 * psi, optimizer=8 * psi, total=16 * psi)
    assert held == expected, f"{held} vs 2 + 2 + 4 + 8 bytes per parameter {expected}"


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="dtype must be"):
        MixedPrecisionOptimizer(build_gpt(CONFIG), dtype=torch.float32)
    with pytest.raises(ValueError, match="loss_scale must be"):
        MixedPrecisionOptimizer(build_gpt(CONFIG), loss_scale=-1)
    with pytest.raises(ValueError, match="growth_factor > 1"):
        DynamicLossScaler(growth_factor=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["precision-bf16", "precision-fp16"])
def test_verify_precision_on_two_ranks(technique):
    from shardlib.checks.precision import verify_precision

    record = verify_precision(2, technique=technique)
    assert record["passed"], record["detail"]
