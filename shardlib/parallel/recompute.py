"""Activation recomputation: keep fewer activations for backward, compute them again when needed.

Backward needs what forward computed: each op saves the tensors its gradient formula reads.
Recomputation (Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174)
runs a piece of the forward without saving anything, keeps only the piece's inputs, and runs the
piece forward again, this time saving, just before its backward. `recompute(fn, *inputs)` does
that for any function of tensors, from scratch, as a torch.autograd.Function (PyTorch's own is
torch.utils.checkpoint.checkpoint; the tests hold the two against each other).

`apply_recompute(gpt, mode)` sets the course GPT up for one of three modes (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, Section 5):

    None          every block saves everything it computed
    "selective"   the attention core, softmax(q k^T / sqrt(d) + causal mask) v, is recomputed: its
                  inputs q, k, v are kept, its a*s*s scores and probabilities are not
    "full"        each whole block is recomputed: only the block's input is kept

Activations kept per layer, in elements, for the course GPT in its own dtype with dropout 0
(b batch, s sequence, h hidden, a heads; `activation_elements`):

    None          16 s b h + a s^2 b + 4 s b
    "selective"   16 s b h            + 4 s b
    "full"         1 s b h

16 sbh: LayerNorm inputs 2, LayerNorm outputs 2, q k v 3, attention output 1, MLP hidden 4 + 4;
a s^2 b: the softmax probabilities; 4 sb: the LayerNorms' means and reciprocal deviations.
The paper's 16-bit count, s b h (34 + 5 a s / h) bytes, is the same list with dropout: its masks
and outputs add 2 sbh + 3 a s^2 b bytes (shardlib.memory.activation_bytes_per_layer).

Extra compute per step (matmul FLOPs, forward of one layer = 24 b s h^2 + 4 b s^2 h):
full recomputation repeats the whole forward (training costs 4 forwards instead of 3, +33%), as
`recompute` and Megatron-LM's checkpoint do; PyTorch's non-reentrant checkpoint, since 2.1, stops once
every saved tensor is back, before the MLP's down projection: 8 b s h^2 fewer FLOPs per layer, a third
of its weight products, so about 3 2/3 forwards instead of 4 (pytorch/pytorch#96866; tests/test_recompute.py;
the planner's checkpoint_early_stop);
selective repeats only the core's 4 b s^2 h (`recompute_flops`). Memory per rank and
communication are otherwise the model's: recomputation moves no bytes between ranks (under
tensor parallelism a recomputed forward would repeat its all-reduces; not here).

The attention core is written out (`eager_attention`) so that its s^2 tensors exist to be kept or
not; `attention="sdpa"` keeps PyTorch's fused scaled_dot_product_attention, which on CPU and GPU
(flash attention, Dao et al., arXiv 2205.14135) already recomputes the scores in backward and keeps
none of the s^2 terms: selective recomputation built into one kernel.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlib.models import GPT, Block, CausalSelfAttention

__all__ = ["recompute", "eager_attention", "apply_recompute", "activation_elements", "recompute_flops",
           "layer_forward_flops", "MODES"]

MODES = (None, "selective", "full")


class _Recompute(torch.autograd.Function):
    """Forward without saving; keep the inputs; in backward, forward again with grad, then backward."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.cpu_rng = torch.get_rng_state()  # the same dropout masks when forward runs again
        ctx.cuda_rng = {x.device: torch.cuda.get_rng_state(x.device) for x in inputs if x.is_cuda}
        ctx.save_for_backward(*inputs)  # all that stays alive until backward
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=list(ctx.cuda_rng)):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in ctx.cuda_rng.items():
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                output = ctx.fn(*inputs)  # forward again, saving this time
        torch.autograd.backward(output, grad_output)  # parameters' .grad accumulate here
        return (None, *(x.grad if x.requires_grad else None for x in inputs))


def recompute(fn, *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs) (one tensor out), keeping only `inputs` for backward and running fn again there."""
    if not all(isinstance(x, torch.Tensor) for x in inputs):
        raise TypeError("recompute(fn, *inputs) takes tensors only; bind other arguments with functools.partial")
    return _Recompute.apply(fn, *inputs)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v, written out: (B, a, s, d) each -> (B, a, s, d)."""
    s, d = q.shape[-2], q.shape[-1]
    mask = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)  # (s, s), added: not saved
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d)) + mask  # (B, a, s, s)
    return torch.softmax(scores, dim=-1) @ v  # (B, a, s, s) @ (B, a, s, d) -> (B, a, s, d)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, a, s, d)


def _attention_forward(attn: CausalSelfAttention, x: torch.Tensor, *, core, selective: bool) -> torch.Tensor:
    B, T, _ = x.shape  # (B, s, h)
    q = attn.q_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # (B, a, s, d)
    k = attn.k_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # (B, a, s, d)
    v = attn.v_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # (B, a, s, d)
    y = recompute(core, q, k, v) if selective else core(q, k, v)  # (B, a, s, d)
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, s, h)


def _block_forward(block: Block, x: torch.Tensor) -> torch.Tensor:
    return recompute(functools.partial(Block.forward, block), x)  # (B, s, h); only x is kept


def apply_recompute(model: GPT, mode: str | None, *, attention: str = "eager") -> GPT:
    """Set every block of the course GPT (or of a pipeline stage of it) to recompute as `mode` says.

    mode: None, "selective" or "full" (see the module docstring). attention: "eager" (the core
    written out, its s^2 tensors visible) or "sdpa" (PyTorch's fused kernel). Parameters and their
    names are untouched; the model is changed in place and returned. Call it again to change modes.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention must be 'eager' (written out) or 'sdpa' (PyTorch's fused kernel), got {attention!r}")
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"apply_recompute needs the course GPT or a stage of it (with .blocks), got {type(model).__name__}")
    core = eager_attention if attention == "eager" else _sdpa
    for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):
        block.attn.forward = functools.partial(_attention_forward, block.attn, core=core, selective=mode == "selective")
        if mode == "full":
            block.forward = functools.partial(_block_forward, block)
        else:
            block.__dict__.pop("forward", None)  # back to Block.forward
    return model


# ---------------------------------------------------------------------------------
# formulas


def activation_elements(seq_len: int, batch: int, hidden: int, heads: int, mode: str | None = None, *,
                        attention: str = "eager") -> int:
    """Elements one block of the course GPT keeps for backward (dropout 0).

    attention="eager": the core written out keeps its a s^2 b probabilities; "sdpa" (the course GPT as
    built, PyTorch's fused kernel) keeps instead one log-sum-exp per head and position, a s b, and
    recomputes the probabilities in its backward. Selective and full recomputation keep the same either way.
    """
    s, b, h, a = seq_len, batch, hidden, heads
    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention must be 'eager' or 'sdpa', got {attention!r}")
    if mode is None:
        return 16 * s * b * h + (a * s * b if attention == "sdpa" else a * s * s * b) + 4 * s * b
    if mode == "selective":
        return 16 * s * b * h + 4 * s * b
    if mode == "full":
        return s * b * h
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def layer_forward_flops(seq_len: int, batch: int, hidden: int) -> int:
    """Matmul FLOPs of one block's forward: 24 b s h^2 (projections, MLP) + 4 b s^2 h (q k^T, p v)."""
    s, b, h = seq_len, batch, hidden
    return 24 * b * s * h * h + 4 * b * s * s * h


def recompute_flops(seq_len: int, batch: int, hidden: int, mode: str | None) -> int:
    """Matmul FLOPs one block repeats per step: full its forward, selective the core's 4 b s^2 h."""
    s, b, h = seq_len, batch, hidden
    return {None: 0, "selective": 4 * b * s * s * h, "full": layer_forward_flops(s, b, h)}[mode]
