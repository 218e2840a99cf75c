"""Tied embeddings across a pipeline: the embedding on the first stage, its copy as the output layer on the last.

GPT-2 and GPT-3 use one (V, h) matrix as the input embedding and as the output layer (Press and Wolf,
arXiv 1608.05859). Cut into p > 1 stages, the first stage holds it as the embedding and the last stage
a copy of it as the output layer; both copies start equal (the same seed), and each gets its own
gradient in backward. Summing the two after backward, over the group of the first and the last stage
of each pipeline, gives both the gradient of the one shared matrix, so they take the same step and stay
equal: Megatron-LM's embedding group (megatron/core/parallel_state.py, and _allreduce_word_embedding_grads
in megatron/core/distributed/finalize_model_grads.py).

    memory          the last stage holds V h / t parameters more (and their gradient and optimizer state)
    communication   one all-reduce of V h / t gradient values between the two ends (2 ranks: each sends
                    V h / t), once a step, after the pipeline has drained

A stage says which weight it shares by `tied_embedding()` (the embedding's on the first stage, the output
layer's on the last, None elsewhere): shardlib.parallel.pipeline.GPTStage and the full-scale simulation's
stages (shardlib/simulate/model.py) have it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlib.comm import ops

__all__ = ["embedding_group", "sync_tied_embeddings"]


def embedding_group(pipelines: list[list[int]], rank: int):
    """The group of the first and the last stage of each pipeline (lists of global ranks in stage order),
    created collectively: every rank calls this with every pipeline. Returns this rank's group, or None."""
    mine = None
    for ranks in pipelines:
        ends = sorted({ranks[0], ranks[-1]})
        group = dist.new_group(ends)
        if rank in ends:
            mine = group
    return mine


@torch.no_grad()
def sync_tied_embeddings(stage, *, group) -> None:
    """After backward: sum the tied weight's gradient over its two copies (group: embedding_group's).
    stage: this rank's stage, or its chunks; those without a tied copy do nothing."""
    chunks = list(stage) if isinstance(stage, (list, tuple, nn.ModuleList)) else [stage]
    for chunk in chunks:
        weight = chunk.tied_embedding() if hasattr(chunk, "tied_embedding") else None
        if weight is not None and weight.grad is not None:
            ops.all_reduce(weight.grad, group=group)  # (V/t, h): the embedding's gradient + the output layer's
