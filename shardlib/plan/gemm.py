"""How long one GPU takes for a matrix product of a given shape: a roofline with a measured ceiling,
and the tile and wave quantization of the GPU's matmul kernels.

A product of an (M, K) by a (K, N) matrix, `batch` times, does 2 M N K batch FLOPs and moves at
least 2 (M K + K N + M N) batch bytes in 16 bits. cuBLAS covers the (M, N) output with tiles of
256 x 128 (or 128 x 256) elements, one thread block per tile, and runs the blocks in waves of one
per SM (NVIDIA, Matrix Multiplication Background User's Guide, DU-09799-001, Sections 2.3, 3.1, 3.2:
https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/): a shape that
is not a multiple of the tile pays for whole tiles (tile quantization), and a number of tiles that is
not a multiple of the SM count leaves SMs idle in the last wave (wave quantization). So

    time = max( waves * n_SM * 2 * 256 * 128 * K / F_mm ,  bytes / B_hbm ),
    waves = ceil(batch * ceil(M / 256) * ceil(N / 128) / n_SM)   (the better of the two orientations)

F_mm is the fastest rate a large, well-shaped product reaches, measured: the "maximum achievable matmul
FLOPS" (bf16, best shape found by a search over shapes; Bekman, ml-engineering,
https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md, "Maximum Achievable
Matmul FLOPS comparison table": A100 SXM 267.9, H100 SXM 792.1 TFLOP/s, against 312 and 989 in the
datasheets), times the fraction a training job's products reach of it (fitted, cost.FITTED). The best
shapes of that table fill whole waves (A100: 6912 x 16384 -> 27 x 128 = 3456 tiles = 32 waves of 108),
so F_mm is the rate of a full wave.

Backward runs two products per forward one, with the shapes permuted: the data gradient (M, K, N)
and the weight gradient (K, N, M) (arXiv 2104.04473, Appendix: 3 GEMMs per weight).
"""

from __future__ import annotations

import torch

TILE = (256, 128)  # output elements per thread block, cuBLAS's large bf16 tiles (guide, Section 2.3)


def _waves(m, n, batch, n_sm: int):
    """Waves of thread blocks for an (m, n) output, the better orientation of the tile."""
    a, b = TILE
    one = torch.ceil(m / a) * torch.ceil(n / b)
    other = torch.ceil(m / b) * torch.ceil(n / a)
    return torch.ceil(batch * torch.minimum(one, other) / n_sm)


def matmul_seconds(m, n, k, cluster, fraction: float, hbm_fraction: float, batch=1.0):
    """Seconds of `batch` products (m, k) @ (k, n) in 16 bits on one GPU of `cluster` (columns welcome)."""
    m, n, k = (torch.as_tensor(x, dtype=torch.float64) for x in (m, n, k))
    flop_s = cluster.matmul_tflops * 1e12 * fraction
    compute = _waves(m, n, batch, cluster.n_sm) * cluster.n_sm * 2.0 * TILE[0] * TILE[1] * k / flop_s
    memory = 2.0 * (m * k + k * n + m * n) * batch / (cluster.hbm_bw_gbps * 1e9 * hbm_fraction)
    return torch.maximum(compute, memory)


def forward_backward_seconds(m, n, k, cluster, fraction: float, hbm_fraction: float, batch=1.0):
    """(forward, backward) seconds of one weight's products: y = x W, then dx = dy W^T and dW = x^T dy."""
    forward = matmul_seconds(m, n, k, cluster, fraction, hbm_fraction, batch)
    backward = (matmul_seconds(m, k, n, cluster, fraction, hbm_fraction, batch)
                + matmul_seconds(k, n, m, cluster, fraction, hbm_fraction, batch))
    return forward, backward


def efficiency(m, n, k, cluster, fraction: float, hbm_fraction: float, batch=1.0):
    """Achieved fraction of the datasheet peak: 2 m n k batch / (time * peak)."""
    seconds = matmul_seconds(m, n, k, cluster, fraction, hbm_fraction, batch)
    return 2.0 * torch.as_tensor(m * n * k * batch, dtype=torch.float64) / (seconds * cluster.peak_tflops * 1e12)
