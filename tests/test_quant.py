"""shardlib.compress.quant against hand-computed cases, error bounds, F.linear and byte counts from shapes."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlib.models import build_gpt
from shardlib.compress.quant import (QuantEmbedding, QuantLinear, bytes_held, dequantize, pack_int4, quantize, quantize_model,
                            relative_error, unpack_int4, weight_error)


def test_int8_per_tensor_hand_computed():
    w = torch.tensor([[1.0, -2.0], [0.5, 127.0]])
    q, s = quantize(w, 8, "per_tensor")
    assert s.shape == (1, 1) and s.item() == pytest.approx(1.0)  # absmax 127 / 127
    assert q.dtype == torch.int8
    assert q.tolist() == [[1, -2], [0, 127]]  # round(0.5) = 0 (half to even)


def test_int8_per_channel_hand_computed():
    w = torch.tensor([[0.1, -0.3, 0.4], [10.0, 6.0, -2.5]])
    q, s = quantize(w, 8, "per_channel")
    assert s.flatten().tolist() == pytest.approx([0.4 / 127, 10.0 / 127])
    assert q.tolist() == [[32, -95, 127], [127, 76, -32]]  # 0.1 * 127 / 0.4 = 31.75 -> 32, 6 * 12.7 = 76.2 -> 76
    assert torch.equal(dequantize(q, s), torch.tensor([[32.0, -95, 127], [127, 76, -32]]) * s)


def test_int4_group_hand_computed():
    w = torch.tensor([[0.875, -0.4375, 0.125, 0.0, 7.0, 3.5, -7.0, 1.0]])  # exact in binary
    q, s = quantize(w, 4, "group", group_size=4)
    assert s.flatten().tolist() == [0.125, 1.0]  # absmax / 7 per group of 4
    assert unpack_int4(q).tolist() == [[7, -4, 1, 0, 7, 4, -7, 1]]  # -3.5 -> -4, 3.5 -> 4 (half to even)
    assert q.dtype == torch.uint8 and q.shape == (1, 4)
    # packed by hand: value + 8 in each nibble, low nibble = even column
    assert q.tolist() == [[(7 + 8) | ((-4 + 8) << 4), (1 + 8) | (8 << 4), 15 | (12 << 4), 1 | (9 << 4)]]


@pytest.mark.parametrize("bits,scheme,group_size", [(8, "per_tensor", None), (8, "per_channel", None),
                                                    (8, "group", 16), (4, "group", 32), (4, "per_channel", None)])
def test_reconstruction_error_at_most_half_a_step(bits, scheme, group_size):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 1, 24)[:, None]
    q, s = quantize(w, bits, scheme, group_size)
    w_hat = dequantize(q, s, bits)
    step = s.repeat_interleave(w.shape[1] // s.shape[1], dim=1) if s.shape[0] > 1 else s  # each weight's scale
    assert ((w_hat - w).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
    # and the scale is the absmax over its group divided by qmax (independent computation)
    qmax = 2 ** (bits - 1) - 1
    if scheme == "per_tensor":
        assert s.item() == pytest.approx(w.abs().max().item() / qmax)
    elif scheme == "per_channel":
        assert torch.allclose(s.flatten(), w.abs().amax(1) / qmax)
    else:
        assert torch.allclose(s, w.abs().reshape(24, -1, group_size).amax(-1) / qmax)


def test_int4_dequantize_equals_unpacked_values_times_their_group_scale():
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    packed, s = quantize(w, 4, "group", 8)
    expected = unpack_int4(packed).float() * s.repeat_interleave(8, dim=1)  # (6, 32): each value times its scale
    assert torch.equal(dequantize(packed, s, bits=4), expected)


def test_int4_pack_round_trips_every_value():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)[:, torch.randperm(32)]  # (3, 32)
    packed = pack_int4(q)
    assert packed.shape == (3, 16) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


def test_per_channel_beats_per_tensor_with_an_outlier():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 7] = 5.0  # one outlier: per-tensor stretches every row's step, per-channel only row 3's
    rows = [r for r in range(16) if r != 3]
    err = {name: relative_error(w[rows], dequantize(*quantize(w, bits, scheme, g), bits)[rows])
           for name, bits, scheme, g in (("tensor", 8, "per_tensor", None), ("channel", 8, "per_channel", None),
                                         ("int4 g32", 4, "group", 32))}
    # per-tensor step 5/127 ~ 0.04 against weights of std 0.02: most round to 0 or +-1
    assert err["tensor"] > 0.3
    assert err["channel"] < err["tensor"] / 20
    assert err["channel"] < err["int4 g32"] < err["tensor"]  # 4 bits cost more than 8, groups keep the outlier away
    assert relative_error(w, w) == 0.0


@pytest.mark.parametrize("bits,scheme,group_size",
                         [(8, "per_channel", None), (8, "per_tensor", None), (4, "group", 16)])
def test_quant_linear_equals_linear_with_dequantized_weight(bits, scheme, group_size):
    torch.manual_seed(0)
    linear = nn.Linear(32, 12)
    ql = QuantLinear.from_float(linear, bits, scheme, group_size)
    x = torch.randn(5, 7, 32)
    q, s = quantize(linear.weight, bits, scheme, group_size)
    expected = F.linear(x, dequantize(q, s, bits), linear.bias)
    assert torch.equal(ql(x), expected)
    assert relative_error(linear(x), ql(x)) < (0.02 if bits == 8 else 0.2)


def test_quant_embedding_dequantizes_only_looked_up_rows():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 32)
    for bits, scheme, g in ((8, "per_channel", None), (4, "group", 8), (8, "per_tensor", None)):
        qe = QuantEmbedding.from_float(emb, bits, scheme, g)
        idx = torch.tensor([[3, 0, 49], [7, 7, 1]])
        full = dequantize(*quantize(emb.weight, bits, scheme, g), bits)  # (50, 32)
        assert torch.equal(qe(idx), full[idx])


def test_bytes_held_matches_shapes():
    model = build_gpt(seed=0, n_embd=64, n_layer=2)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    other = sum(p.numel() * 4 for n, p in model.named_parameters() if n.rpartition(".")[0] not in linears)
    assert bytes_held(model) == sum(p.numel() for p in model.parameters()) * 4
    for bits, scheme, g in ((8, "per_channel", None), (8, "per_tensor", None), (4, "group", 32)):
        q = quantize_model(model, bits, scheme, g)
        expected = other
        for m in linears.values():
            out, inp = m.weight.shape
            weight_bytes = out * inp if bits == 8 else out * inp // 2  # int8, or two int4 per byte
            n_scales = {"per_tensor": 1, "per_channel": out, "group": out * inp // (g or 1)}[scheme]
            expected += weight_bytes + 4 * n_scales + (0 if m.bias is None else 4 * out)
        assert bytes_held(q) == expected, (bits, scheme)


def test_bytes_per_weight_formula():
    """8 + 32/in bits per weight for per-channel int8; 4 + 32/g for int4 groups (fp32 scales), 4 + 16/g (fp16)."""
    lin = nn.Linear(256, 64, bias=False)
    for bits, scheme, g, scale_dtype, formula in ((8, "per_channel", None, torch.float32, 8 + 32 / 256),
                                                  (4, "group", 64, torch.float32, 4 + 32 / 64),
                                                  (4, "group", 64, torch.float16, 4 + 16 / 64)):
        ql = QuantLinear.from_float(lin, bits, scheme, g, scale_dtype)
        assert bytes_held(ql) * 8 / lin.weight.numel() == pytest.approx(formula)


def test_quantize_model_replaces_linears_and_skips():
    model = build_gpt(seed=0, n_embd=64, n_layer=2)
    q = quantize_model(model, 8, skip=("lm_head", "blocks.1"))
    kinds = {n: type(m).__name__ for n, m in q.named_modules()}
    assert kinds["lm_head"] == "Linear" and kinds["blocks.1.attn.q_proj"] == "Linear"
    assert kinds["blocks.0.attn.q_proj"] == "QuantLinear" and kinds["blocks.0.mlp.proj"] == "QuantLinear"
    assert kinds["tok_emb"] == "Embedding"
    assert type(model.blocks[0].attn.q_proj) is nn.Linear  # the original is untouched (a copy was made)
    assert kinds_embedded(quantize_model(model, 8, embeddings=True)) == {"tok_emb", "pos_emb"}
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_error(model(idx), q(idx)) < 0.01


def kinds_embedded(model):
    return {n for n, m in model.named_modules() if isinstance(m, QuantEmbedding)}


def test_bad_input_errors():
    lin = nn.Linear(48, 8)
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        quantize(lin.weight, bits=3)
    with pytest.raises(ValueError, match="bits=16"):
        quantize_model(build_gpt(seed=0), bits=16)
    with pytest.raises(ValueError, match="group_size=32 does not divide in_features=48"):
        quantize(lin.weight, 4, "group", 32)
    with pytest.raises(ValueError, match="group_size=128 does not divide in_features=64 of blocks.0.attn.q_proj"):
        quantize_model(build_gpt(seed=0, n_embd=64), 4, "group", 128)
    with pytest.raises(ValueError, match="scheme"):
        quantize(lin.weight, 8, "per_row")
    with pytest.raises(TypeError, match="LayerNorm, not nn.Linear"):
        QuantLinear.from_float(nn.LayerNorm(8))
    with pytest.raises(TypeError, match="target 'ln_f' is LayerNorm"):
        quantize_model(build_gpt(seed=0), 8, targets=("ln_f",))
    with pytest.raises(KeyError, match="no module named 'lm_haed'"):
        quantize_model(build_gpt(seed=0), 8, skip=("lm_haed",))
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="even"):
        quantize(torch.randn(4, 5), 4, "per_channel")
    assert math.isfinite(weight_error(torch.zeros(4, 8))["max_abs_error"])  # all-zero rows: no division by zero


def test_embedding_errors_name_the_embedding_dim():
    with pytest.raises(ValueError, match="group_size=128 does not divide embedding_dim=64 of tok_emb"):
        quantize_model(build_gpt(seed=0, n_embd=64), 4, "group", 128, embeddings=True)
    with pytest.raises(TypeError, match="not nn.Embedding"):
        QuantEmbedding.from_float(nn.Linear(4, 4))
