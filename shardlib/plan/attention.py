"""How fast a fused attention kernel runs: its published benchmark, by GPU and sequence length.

A fused causal attention kernel (FlashAttention, arXiv 2205.14135) does 4 s^2 d a / 2 FLOPs forward on a heads
of length s and dimension d (the masked half skipped), and 2.5 times that backward (five products against two,
the scores recomputed). Its speed is not a product's: softmax, masking and the recomputation keep it well below
the matmul ceiling, and it grows with s, since short sequences leave SMs idle. So the planner takes it from the
kernels' own benchmarks, forward + backward TFLOP/s at s = 512 ... 16k, head dimension 128, causal, batch x s =
16k tokens of hidden size 2048 (the MPT-1b shape; every published run of the planner's sets has d = 128, and a
kernel at d = 64 is 10-15% slower, which the planner does not count):

- FlashAttention-2 (attention="flash"), arXiv 2307.08691, Figure 4(d) on the A100 80GB SXM4 and Figure 7(d) on the
  H100 80GB SXM5 (the same plots: Dao-AILab/flash-attention, assets/flash2_{a100,h100}_fwd_bwd_benchmark.png).
  Written for the A100, it reaches about a third of the H100's peak (arXiv 2407.08608, abstract).
- Transformer Engine's fused attention (attention="fused", the planner's default): on Hopper it runs cuDNN's
  kernel instead of FlashAttention-2 ("Select FusedAttention on sm90 and FlashAttention on others for
  performance", NVIDIA/TransformerEngine 32db39288, 2023-12-07, TE 1.2), so Megatron-Core's and NeMo's H100 runs
  do; off Hopper it runs FlashAttention-2, and "fused" is "flash" there. FlashAttention-3's paper benchmarks
  cuDNN 9.1 on the H100 in the same settings (arXiv 2407.08608, Sec. 4.1; FlashAttention-3 itself is about 8%
  faster at 2k): forward with the causal mask, Figure 5(d), and without it, 5(c) (the same plots: flash-attention's
  assets/flash3_fp16_fwd.png); backward without the mask only, Figure 6(b). The causal backward is taken as the
  backward without the mask slowed as much as the forward is by it (CUDNN_H100, below).
- A GPU without a benchmark (a Cluster given no curve) gets the A100's curves scaled by its peak over the A100's
  312 TFLOP/s, as its matmul ceiling is (inputs.Cluster).

A training job runs these kernels as it runs its products: at `fraction` of their benchmark speed (the fitted
share of the measured matmul ceiling, shardlib/plan/fitted.py), since clocks, power and the rest of the step
bear on both alike. Between the benchmark's lengths the speed is interpolated in log s; beyond them it is held.
"""

from __future__ import annotations

import math

import torch

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)  # the benchmarks' sequence lengths, powers of 2
BACKWARD = 2.5  # FLOPs of a fused kernel's backward over its forward: 5 products of the forward's 2

# FlashAttention-2, forward + backward, causal, d = 128, TFLOP/s (arXiv 2307.08691, Figures 4(d) and 7(d))
FLASH2 = dict(a100=(99.0, 133.0, 155.0, 173.0, 182.0, 189.0), h100=(163.0, 221.0, 265.0, 294.0, 308.0, 328.0))


def _causal_forward_backward(forward_causal, forward_full, backward_full):
    """Forward + backward TFLOP/s of a causal kernel whose causal backward was not benchmarked: the backward
    without the mask times forward_causal / forward_full, the forward's own slowdown under the mask; the pair does
    1 + BACKWARD forward FLOPs."""
    backward = [b * fc / ff for b, fc, ff in zip(backward_full, forward_causal, forward_full)]
    return tuple((1.0 + BACKWARD) / (1.0 / f + BACKWARD / b) for f, b in zip(forward_causal, backward))


# cuDNN 9.1 on the H100, d = 128 (arXiv 2407.08608): forward causal (Fig. 5(d)), forward and backward without the
# mask (Figs. 5(c), 6(b)), TFLOP/s
CUDNN_H100 = _causal_forward_backward(forward_causal=(315.0, 410.0, 484.0, 518.0, 529.0, 539.0),
                                      forward_full=(497.0, 574.0, 617.0, 609.0, 600.0, 595.0),
                                      backward_full=(305.0, 408.0, 465.0, 499.0, 518.0, 516.0))


def kernel_tflops(curve, seq_len):
    """Benchmark TFLOP/s of a kernel's `curve` (one value per LENGTHS) at `seq_len` tokens (a number or a column):
    interpolated in log2 s between the benchmark's lengths, held beyond them."""
    curve = torch.as_tensor(curve, dtype=torch.float64)
    steps = torch.log2(torch.as_tensor(seq_len, dtype=torch.float64)) - math.log2(LENGTHS[0])  # one per doubling
    x = torch.clamp(steps, 0.0, len(LENGTHS) - 1.0)
    low = torch.clamp(torch.floor(x), max=len(LENGTHS) - 2.0).long()
    share = x - low
    return curve[low] + share * (curve[low + 1] - curve[low])
