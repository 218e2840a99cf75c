"""What a smaller model costs in quality: embedding cosine, linear-probe accuracy, perplexity.

Lesson 07 holds every compressed variant of a model against the fp32 original:

- sentence embeddings (mean-pooled last hidden states, L2-normalised, as
  sentence-transformers does for all-MiniLM-L6-v2): cosine similarity to the fp32
  embedding of the same sentence, averaged over the course's sentences;
- a linear probe: logistic regression trained with torch on the frozen embeddings of a
  labelled training split, accuracy on the held-out test split;
- for the course's byte-level GPT: perplexity exp(mean cross-entropy) on held-out text.

Sharding leaves all three unchanged (the same tensors are gathered back); quantization
and pruning move them. Every measurement runs where the model is (`device_of`): move the model
to a rank's `current_device()` and its inputs follow.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm  # text bars: they also work inside forked ranks, whose output is forwarded

from shardlib.models import DATA_DIR, GPTConfig, build_gpt, load_course_text, text_batches

SENTENCES = DATA_DIR / "sentences.txt"  # DATA_DIR: shardlib/data, shipped inside the package
TOPICS = DATA_DIR / "topics"


def device_of(model: nn.Module) -> torch.device:
    """Where the model's tensors are (its first parameter or buffer); the CPU for a model without any."""
    tensor = next(iter(model.parameters()), None)
    tensor = next(iter(model.buffers()), None) if tensor is None else tensor
    return torch.device("cpu") if tensor is None else tensor.device


def load_sentences(path: str | Path = SENTENCES) -> list[str]:
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line]


def load_encoder(model_id: str | None = None, offline: bool = True):
    """(model, tokenizer) of a Hugging Face encoder; default: the packaged all-MiniLM-L6-v2.

    The pooler head is dropped: sentence embeddings use the hidden states only.
    """
    with warnings.catch_warnings():  # transformers imports tqdm.auto, which warns in a notebook without ipywidgets
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

    from shardlib.finetune.model import DEFAULT_MODEL_ID, resolve_model_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = resolve_model_path(model_id or DEFAULT_MODEL_ID, offline)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
    model = AutoModel.from_pretrained(path, local_files_only=offline).eval()
    if getattr(model, "pooler", None) is not None:
        model.pooler = None
    return model, tokenizer


@torch.no_grad()
def embed(model: nn.Module, tokenizer, sentences: list[str], batch_size: int = 64, max_length: int = 128,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """(S, C) L2-normalised mean-pooled sentence embeddings, in fp32."""
    chunks = []
    for start in range(0, len(sentences), batch_size):  # (B, T) token ids per batch
        batch = tokenizer(sentences[start:start + batch_size], padding=True, truncation=True,
                          max_length=max_length, return_tensors="pt").to(device_of(model))
        hidden = model(**batch).last_hidden_state.float()  # (B, T, C)
        mask = batch["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)  # (B, C)
        chunks.append(F.normalize(pooled, dim=-1))
    return torch.cat(chunks).cpu()  # (S, C)


def cosine_to_reference(reference: torch.Tensor, embeddings: torch.Tensor) -> dict:
    """Per-sentence cosine between two sets of (S, C) embeddings: mean and worst."""
    cos = F.cosine_similarity(reference, embeddings, dim=-1)  # (S,)
    return {"mean": cos.mean().item(), "min": cos.min().item()}


def linear_probe_accuracy(train_x, train_y, test_x, test_y, steps: int = 300, lr: float = 0.05,
                          weight_decay: float = 1e-4, seed: int = 0) -> float:
    """Multinomial logistic regression on frozen features (full-batch Adam); test accuracy."""
    g = torch.Generator().manual_seed(seed)
    n_classes = int(train_y.max()) + 1
    probe = nn.Linear(train_x.shape[1], n_classes)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=g) * 0.01)
        probe.bias.zero_()
    opt = torch.optim.Adam(probe.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(probe(train_x), train_y).backward()
        opt.step()
    with torch.no_grad():
        return (probe(test_x).argmax(-1) == test_y).float().mean().item()


# ---------------------------------------------------------------------------------
# the course's small GPT: train briefly, then measure perplexity


def split_course_text(validation_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = load_course_text()
    cut = int(len(tokens) * (1 - validation_fraction))
    return tokens[:cut], tokens[cut:]


def train_gpt(config: GPTConfig, steps: int = 300, batch_size: int = 16, lr: float = 3e-3, seed: int = 0,
              tokens: torch.Tensor | None = None, device: torch.device | str = "cpu", progress: bool = False) -> nn.Module:
    """A GPT trained for `steps` AdamW steps on the course text (the first 90% by default), on `device`;
    `progress`: a progress bar (one line, redrawn at most every 10 s)."""
    tokens = split_course_text()[0] if tokens is None else tokens
    model = build_gpt(config, seed=seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    batches = text_batches(batch_size, config.seq_len, steps, seed=seed, tokens=tokens)
    for x, y in tqdm(batches, desc=f"training the GPT (seed {seed})", disable=not progress, mininterval=10):
        _, loss = model(x.to(device), y.to(device))  # (B, T) each
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    return model.eval()


@torch.no_grad()
def perplexity(model: nn.Module, batches) -> float:
    """exp(mean cross-entropy) over (inputs, targets) batches, computed where the model is."""
    device = device_of(model)
    losses = [model(x.to(device), y.to(device))[1].item() for x, y in batches]
    return math.exp(sum(losses) / len(losses))
