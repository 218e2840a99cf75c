"""shardlib.lessons.int4_groups (lesson 07's int4 study) against direct computations: windows, KL, errors."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from shardlib.compress.quality import device_of
from shardlib.compress.quant import QuantEmbedding, QuantLinear
from shardlib.lessons.int4_groups import _int4_int8_embeddings, held_out_windows, int4_study, logit_kl
from shardlib.models import GPTConfig, build_gpt

TINY = GPTConfig(seq_len=8, n_layer=1, n_head=2, n_embd=16)


def test_held_out_windows_cover_every_token_once_with_next_token_targets():
    tokens = torch.arange(30)
    [(x, y)] = held_out_windows(tokens, 8)
    assert x.shape == y.shape == (3, 8)  # (30 - 1) // 8 windows
    assert x.flatten().tolist() == list(range(24))  # each token once, in order
    assert torch.equal(y, x + 1)  # the target is the next token


def test_logit_kl_equals_torch_distributions_kl_and_perplexity_the_exponentiated_cross_entropy():
    tokens = torch.randint(0, TINY.vocab_size, (65,), generator=torch.Generator().manual_seed(0))
    windows = held_out_windows(tokens, TINY.seq_len)
    reference, other = build_gpt(TINY, seed=0).eval(), build_gpt(TINY, seed=1).eval()
    x, y = windows[0]
    with torch.no_grad():
        ref_logits, other_logits = reference(x), other(x)  # (n, T, V)
    expected_kl = kl_divergence(Categorical(logits=ref_logits), Categorical(logits=other_logits)).mean().item()
    expected_ppl = math.exp(F.cross_entropy(other_logits.flatten(0, 1), y.flatten()).item())
    ppl, kl = logit_kl(other, [F.log_softmax(ref_logits, -1)], windows)
    assert math.isclose(kl, expected_kl, rel_tol=1e-5)
    assert math.isclose(ppl, expected_ppl, rel_tol=1e-5)
    assert logit_kl(reference, [F.log_softmax(ref_logits, -1)], windows)[1] < 1e-6  # the same model: no change


def test_the_study_quantizes_what_it_says_and_measures_each_weights_squared_error():
    model = build_gpt(TINY, seed=0).eval()
    tokens = torch.randint(0, TINY.vocab_size, (65,), generator=torch.Generator().manual_seed(1))
    study = int4_study(model, held_out_windows(tokens, TINY.seq_len), group_sizes=(8, 16))
    assert set(study["int4"]) == set(study["int4, int8 embeddings"]) == {8, 16}
    assert set(study["per module"]) == {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    w = model.blocks[0].mlp.fc.weight.detach()  # (4h, h): groups of 8 along each row, symmetric absmax
    groups = w.reshape(w.shape[0], -1, 8)
    scale = groups.abs().amax(-1, keepdim=True) / 7
    by_hand = ((torch.round(groups / scale).clamp(-7, 7) * scale - groups) ** 2).sum().item()
    assert math.isclose(study["per module"]["blocks.0.mlp.fc"][8][1], by_hand, rel_tol=1e-5)
    mixed = _int4_int8_embeddings(model, 8)  # Linear in int4, the tables in int8 per row
    kinds = {(type(m).__name__, m.bits) for m in mixed.modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert kinds == {("QuantLinear", 4), ("QuantEmbedding", 8)}


def test_device_of_finds_parameters_then_buffers_then_defaults_to_the_cpu():
    assert device_of(nn.Linear(2, 2)) == torch.device("cpu")
    buffers_only = nn.Module()
    buffers_only.register_buffer("b", torch.zeros(1))
    assert device_of(buffers_only) == torch.device("cpu")
    assert device_of(nn.Identity()) == torch.device("cpu")
