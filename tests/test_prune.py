"""shardlib.compress.prune: masks checked by counting, compressed 2:4 round trips, bytes from shapes."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlib.models import build_gpt
from shardlib.compress.prune import (Sparse24Linear, compress_2_4, compress_model_2_4, csr_bytes, decompress_2_4,
                            magnitude_mask, mask_2_4, prune_model)
from shardlib.compress.quant import bytes_held


def test_magnitude_mask_drops_the_smallest():
    w = torch.tensor([[0.1, -5.0, 0.3, -0.2], [4.0, 0.05, -3.0, 2.0]])
    mask = magnitude_mask(w, 0.5)
    assert mask.tolist() == [[False, True, False, False], [True, False, True, True]]  # kept: 5, 4, 3, 2


def test_2_4_mask_keeps_exactly_two_largest_of_every_four():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    mask = mask_2_4(w)
    groups = mask.reshape(32, 16, 4)
    assert (groups.sum(-1) == 2).all()
    kept_min = torch.where(groups, w.abs().reshape(32, 16, 4), torch.inf).amin(-1)
    dropped_max = torch.where(~groups, w.abs().reshape(32, 16, 4), -torch.inf).amax(-1)
    assert (kept_min >= dropped_max).all()


def test_prune_model_sparsity_and_pattern():
    model = build_gpt(seed=0, n_embd=64, n_layer=2)
    pruned = prune_model(model, 0.5, skip=("lm_head",))
    for name, m in pruned.named_modules():
        if isinstance(m, nn.Linear):
            zeros = (m.weight == 0).float().mean().item()
            assert zeros == (0.0 if name == "lm_head" else 0.5), name
    assert bytes_held(pruned) == bytes_held(model)  # zeros stored densely save nothing
    p24 = prune_model(model, pattern="2:4")
    assert ((p24.blocks[0].mlp.fc.weight != 0).reshape(256, -1, 4).sum(-1) == 2).all()
    assert (model.blocks[0].mlp.fc.weight != 0).all()  # the original is untouched


def test_compressed_2_4_round_trips_and_computes():
    torch.manual_seed(0)
    linear = nn.Linear(64, 24)
    values, packed = compress_2_4(linear.weight)
    assert values.shape == (24, 32) and packed.shape == (24, 8) and packed.dtype == torch.uint8
    dense = linear.weight.detach() * mask_2_4(linear.weight)
    assert torch.equal(decompress_2_4(values, packed), dense)
    sparse = Sparse24Linear.from_float(linear)
    x = torch.randn(3, 64)
    assert torch.allclose(sparse(x), F.linear(x, dense, linear.bias), atol=1e-6)
    # bytes from shapes: fp32 values out*in/2*4, indices 2 bits per kept value, bias out*4
    assert bytes_held(sparse) == 24 * 32 * 4 + 24 * 64 // 2 * 2 // 8 + 24 * 4


def test_csr_bytes_are_larger_than_dense_at_half_sparsity():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    w = w * magnitude_mask(w, 0.5)
    nnz = 64 * 128 // 2
    assert csr_bytes(w) == nnz * 4 + nnz * 8 + (64 + 1) * 8  # values, int64 columns, int64 row pointers
    assert csr_bytes(w) > w.numel() * 4


def test_compress_model_2_4_output_equals_pruned_model():
    model = build_gpt(seed=0, n_embd=64, n_layer=2)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = prune_model(model, pattern="2:4")(idx)
        got = compress_model_2_4(model)(idx)
    assert torch.allclose(got, expected, atol=1e-5)
    assert bytes_held(compress_model_2_4(model)) < bytes_held(model)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="sparsity must be in"):
        magnitude_mask(torch.randn(4, 4), 1.5)
    with pytest.raises(ValueError, match="multiple of 4"):
        mask_2_4(torch.randn(4, 6))
    with pytest.raises(ValueError, match="multiple of 8"):
        compress_2_4(torch.randn(4, 12))
    with pytest.raises(ValueError, match="pattern"):
        prune_model(nn.Linear(8, 8), pattern="3:4")
    with pytest.raises(ValueError, match="50% sparse by definition"):
        prune_model(nn.Linear(8, 8), 0.7, pattern="2:4")
    with pytest.raises(TypeError, match="not nn.Linear"):
        Sparse24Linear.from_float(nn.Embedding(4, 8))
