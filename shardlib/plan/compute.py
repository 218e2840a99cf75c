"""One layer of one micro-batch on one GPU: the seconds of its matrix products and memory-bound kernels,
and the bytes it keeps for backward. Columns of layouts in, columns of numbers out (shardlib/plan/cost.py).

Products of a layer, T = b s / c local tokens, on a tensor-parallel rank (Megatron-LM's split,
arXiv 1909.08053), each timed by the GPU's matmul curve (shardlib/plan/gemm.py), forward and backward:
    QKV (T, (h + 2 h_kv) / t, h), output (T, h, h / t), MLP up (T, f / t, h) (2 f / t gated),
    MLP down (T, h, f / t); an MoE layer's E / e experts take T k C_f e / E tokens each.
Attention core: Q K^T and A V on b a / t heads of (s / c) x s scores. Written out ("unfused", as
Megatron-LM did in 2021-22) they are two batched products of that shape, backward twice the forward,
selective recomputation one more forward. A fused kernel (FlashAttention, arXiv 2205.14135, 2307.08691;
cuDNN's) never writes the scores: its causal kernel skips the masked half of the blocks, and its backward
recomputes them, 2.5 x the forward's FLOPs (five products against two), at the kernel's benchmark speed for the
local sequence length s / c (shardlib/plan/attention.py) times the fraction the products reach of theirs.
FlashAttention's Triton kernel (attention="flash-triton", as MosaicML's benchmarks ran it) does the same work at
its own fitted share of the peak (Cluster.triton_attention, shardlib/plan/fitted.py).
Memory-bound kernels between the products, 16-bit, per layer forward: 2 norms (read + write 2 s b h each:
8 s b h), bias + activation of the MLP (16 s b h), 2 bias-dropout-adds (7 s b h each, masks 1 byte) and,
with unfused attention, 13 a s^2 b of scores (Q K^T output 2, softmax 4,
dropout 5, read by A V 2), written whether or not they are kept; backward moves twice the forward's bytes.
Activations: spec.activation_terms() (shardlib/plan/model.py), s b h bytes times each term.
The output layer (T, ceil(V / t), h): the vocabulary padded to a multiple of t.
"""

from __future__ import annotations

import torch

from shardlib.plan.attention import BACKWARD, kernel_tflops
from shardlib.plan.gemm import forward_backward_seconds, matmul_seconds

LOSS_BYTES = 2 + 4 + 4 + 4 + 8 + 6  # per logit, the cross-entropy's passes (output_layer_seconds)
NORM_BYTES = 4  # s b h bytes of a norm: read 2, write 2
RESIDUAL_ADD_BYTES = 7  # s b h bytes of a bias-dropout-add: read 2 + 2, write 2, the mask 1
OUTPUT_LAYER_INPUTS = 4  # s b h bytes the last stage keeps: the final norm's input and the output layer's (Sec. 4.3)


def vocab_rows(spec, t):
    """Rows of the embedding and of the output layer on each of t tensor-parallel ranks (a column): ceil(V / t),
    the vocabulary padded to a multiple of t, as the tensor-parallel code must pad it."""
    return torch.ceil(spec.vocab_size / t)


def layer_seconds(spec, cluster, c, fraction: float, hbm_fraction: float, attention: str, scale: float = 1.0):
    """Seconds of one layer, one micro-batch: dict(gemm_fwd, gemm_bwd, attn_fwd, attn_bwd, elem_fwd, elem_bwd,
    scores_fwd, wgrad_columns, tail_gemm, tail_elem). gemm_*: the weight products; wgrad_columns: a list, the
    weight-gradient product of each column-parallel layer (QKV, and the up projection of a dense MLP), part of
    gemm_bwd; tail_*: the forward after the layer's last saved tensor, which PyTorch's non-reentrant checkpoint
    does not run again (its early stop: cost.Options.checkpoint_early_stop): a dense MLP's down projection (part of
    gemm_fwd; an MoE layer's combine saves the experts' outputs, so its down projections run again) and the
    residual add after it (part of elem_fwd); attn_*: the attention
    core (its backward holds FlashAttention's
    recompute); elem_*: the memory-bound kernels, of which scores_fwd the written-out scores' (what selective
    recomputation runs again beside attn_fwd);
    attention: the kernel (cost.ATTENTION); scale: bytes per value over 2 (1 for 16-bit training) for the
    memory-bound kernels."""
    t, cp, b = c.tp, c.cp, c.micro_batch
    h, s, f = spec.hidden, spec.seq_len, spec.ffn
    tokens = b * s / cp
    kv = h * spec.kv_heads / spec.n_head
    up = f * (2 if spec.gated_mlp else 1)
    fb = lambda m, n, k, batch=1.0: forward_backward_seconds(m, n, k, cluster, fraction, hbm_fraction, batch)  # noqa
    shapes = [(tokens, (h + 2 * kv) / t, h), (tokens, h, h / t)]
    if spec.moe:
        per_expert = tokens * spec.top_k * spec.capacity_factor * c.ep / spec.n_experts
        experts = spec.n_experts / c.ep
        shapes += [(per_expert, up / t, h, experts), (per_expert, h, f / t, experts), (tokens, spec.n_experts, h)]
    else:
        shapes += [(tokens, up / t, h), (tokens, h, f / t)]
    times = [fb(*shape) for shape in shapes]
    gemm_fwd, gemm_bwd = sum(x[0] for x in times), sum(x[1] for x in times)
    # the column-parallel layers' weight-gradient products, dW = x^T dy: what their input gradients' collectives
    # hide behind in Megatron-LM's backward (cost_comm.py); the experts' up projection is not counted
    columns = [shapes[0]] + ([] if spec.moe else [shapes[2]])
    wgrad = [matmul_seconds(k, n, m, cluster, fraction, hbm_fraction) for m, n, k in columns]
    if spec._extra_layer_params():  # parameters `n_params` adds, at the rate of the QKV product
        extra = spec._extra_layer_params() / t
        qkv_flops = 2.0 * tokens * (h + 2 * kv) / t * h
        gemm_fwd = gemm_fwd + times[0][0] * 2.0 * tokens * extra / qkv_flops
        gemm_bwd = gemm_bwd + times[0][1] * 2.0 * tokens * extra / qkv_flops
    attn_fwd, attn_bwd = attention_seconds(spec, cluster, c, fraction, hbm_fraction, attention)
    per_byte = scale / (cluster.hbm_bw_gbps * 1e9 * hbm_fraction)
    scores = scores_traffic(spec, c, flash=attention != "unfused") * per_byte
    elem = layer_traffic(spec, c) * per_byte + scores  # forward
    sbh = tokens * h / torch.where(c.sp > 0, t, 1.0)
    return dict(gemm_fwd=gemm_fwd, gemm_bwd=gemm_bwd, attn_fwd=attn_fwd, attn_bwd=attn_bwd, elem_fwd=elem,
                elem_bwd=2 * elem, scores_fwd=scores, wgrad_columns=wgrad,
                tail_gemm=0.0 if spec.moe else times[3][0], tail_elem=RESIDUAL_ADD_BYTES * sbh * per_byte)


def attention_seconds(spec, cluster, c, fraction: float, hbm_fraction: float, attention: str):
    """(forward, backward) seconds of Q K^T and A V on this rank's b a / t heads of (s / c) x s scores, by the
    kernel `attention` (cost.ATTENTION). FlashAttention-2 and Transformer Engine's fused attention run at their
    benchmark speed for s / c tokens (Cluster.flash_tflops, fused_tflops; attention.py) times `fraction`, as the
    products do; FlashAttention's Triton kernel at its own fitted share of the GPU's peak (Cluster.triton_attention),
    which `fraction` does not change: it is one kernel's fitted speed."""
    t, cp, b, s, d = c.tp, c.cp, c.micro_batch, spec.seq_len, spec.head_dim
    heads = b * spec.n_head / t
    if attention != "unfused":
        flops = 4.0 * heads * (s / cp) * s * d * 0.5  # causal: the kernel skips the masked half
        if attention == "flash-triton":
            rate = cluster.peak_tflops * 1e12 * cluster.triton_attention
        else:
            curve = cluster.fused_tflops if attention == "fused" else cluster.flash_tflops
            rate = kernel_tflops(curve, s / cp) * 1e12 * fraction
        return flops / rate, BACKWARD * flops / rate
    scores = forward_backward_seconds(s / cp, s, d, cluster, fraction, hbm_fraction, heads)
    values = forward_backward_seconds(s / cp, d, s, cluster, fraction, hbm_fraction, heads)
    return scores[0] + values[0], scores[1] + values[1]


def output_layer_seconds(spec, cluster, c, fraction: float, hbm_fraction: float):
    """(forward, backward, wgrad) seconds of the last stage's output layer: the (T, V / t, h) product, and the
    cross-entropy over its fp32 logits, memory-bound: cast (read 2, write 4 bytes), max (read 4), exp and sum
    (read 4), softmax and its gradient (read 4, write 4), the gradient back to 16 bits (read 4, write 2); wgrad:
    its weight-gradient product alone, part of backward (a column-parallel layer too: cost_comm.py)."""
    tokens, rows = c.micro_batch * spec.seq_len / c.cp, vocab_rows(spec, c.tp)
    forward, backward = forward_backward_seconds(tokens, rows, spec.hidden, cluster, fraction, hbm_fraction)
    wgrad = matmul_seconds(spec.hidden, rows, tokens, cluster, fraction, hbm_fraction)
    loss = LOSS_BYTES * tokens * rows / (cluster.hbm_bw_gbps * 1e9 * hbm_fraction)
    return forward + loss / 2, backward + loss / 2, wgrad


def layer_traffic(spec, c):
    """16-bit bytes the memory-bound kernels of one layer move in forward, one micro-batch, one GPU, the
    written-out scores apart (scores_traffic)."""
    t = c.tp
    sbh = c.micro_batch * (spec.seq_len / c.cp) * spec.hidden
    outside = (2 * NORM_BYTES + 2 * RESIDUAL_ADD_BYTES) * sbh  # 2 norms, 2 bias-dropout-adds: outside the TP regions
    mlp = 16 * sbh * (spec.top_k * spec.capacity_factor if spec.moe else 1.0)  # bias + activation, per routed copy
    return torch.where(c.sp > 0, outside / t, outside) + mlp / t


def scores_traffic(spec, c, flash: bool):
    """16-bit bytes the written-out scores cost one forward, one micro-batch, one GPU: 13 a s^2 b / t (c) with
    unfused attention, whether or not they are kept (selective recomputation keeps none, and writes them again
    when it recomputes the attention core); 0 with FlashAttention, which never writes them."""
    if flash:
        return torch.zeros_like(c.micro_batch)
    return 13.0 * spec.n_head * spec.seq_len * c.micro_batch * (spec.seq_len / c.cp) / c.tp


def layer_activations(spec, c, mode: int, flash: bool):
    """16-bit bytes one layer keeps for backward, one micro-batch, one GPU: mode 0 none, 1 selective, 2 full."""
    t, sp = c.tp, c.sp
    sbh = c.micro_batch * (spec.seq_len / c.cp) * spec.hidden  # local tokens x h
    if mode == 2:
        return 2.0 * sbh / torch.where(sp > 0, t, 1.0)  # the layer's input
    outside, inside, scores = spec.activation_terms()
    kept_scores = scores * spec.n_head * spec.seq_len / spec.hidden if mode == 0 and not flash else 0.0
    # all-gather context parallelism: attention keeps the gathered K, V of the other cp - 1 ranks too (2 + 2 h_kv / h)
    gathered_kv = (c.cp_method == 2) * (c.cp - 1) * 4 * spec.kv_heads / spec.n_head
    return torch.where(sp > 0, outside / t, outside) * sbh + (inside + kept_scores + gathered_kv) * sbh / t
