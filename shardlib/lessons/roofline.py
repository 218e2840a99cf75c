"""Lesson 13's rooflines: this machine's peak FLOP/s and memory bandwidth, measured; published GPUs; crossovers.

The roofline model (Williams, Waterman and Patterson, "Roofline: an insightful visual performance
model", CACM 2009): an operation doing F FLOPs on B bytes of memory traffic has arithmetic
intensity I = F / B and runs at most at min(peak FLOP/s, I * memory bandwidth). Below the ridge
I* = peak / bandwidth it is memory-bound, above it compute-bound. The same reasoning with a link's
bandwidth in place of memory's tells when communication hides under computation: the crossovers
below (the chapters on rooflines and parallelism of the scaling book, https://jax-ml.github.io/scaling-book/,
derive them the same way). Notation: Psi parameters, N ranks, t tensor-parallel size, p stages,
m micro-batches, v virtual stages, h hidden size, e bytes per element, F peak FLOP/s, B bandwidth
in bytes per second (one direction).
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["GPUS", "LINKS", "LINK_SOURCES", "measure_matmul_flops", "measure_peak_flops", "measure_bandwidth", "attainable",
           "matmul_intensity", "attention_intensity", "collective_intensity", "dp_overlap_tokens",
           "tp_critical_hidden", "pp_microbatches", "plot_roofline"]

A100_DATASHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                  "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")

# Dense (no sparsity) 16-bit tensor-core peak, HBM bandwidth, GPU-to-GPU link per direction, from the
# vendor's datasheets. NVIDIA quotes bf16 "with sparsity" (twice the dense figure) and NVLink counting
# both directions (twice one direction); both are halved here.
GPUS = {
    "H200 SXM": dict(flops=989e12, mem_bw=4.8e12, link_bw=450e9, link="NVLink 4",
                     source="https://www.nvidia.com/en-us/data-center/h200/ (BF16 1,979 TFLOPS with sparsity; "
                            "4.8 TB/s; NVLink 900 GB/s)"),
    "H100 SXM": dict(flops=989e12, mem_bw=3.35e12, link_bw=450e9, link="NVLink 4",
                     source="https://www.nvidia.com/en-us/data-center/h100/ (BF16 1,979 TFLOPS with sparsity; "
                            "3.35 TB/s; NVLink 900 GB/s)"),
    "A100 SXM 80GB": dict(flops=312e12, mem_bw=2.039e12, link_bw=300e9, link="NVLink 3",
                          source=f"{A100_DATASHEET} (BF16 312 TFLOPS dense; 2,039 GB/s; NVLink 600 GB/s)"),
    "T4": dict(flops=65e12, mem_bw=320e9, link_bw=16e9, link="PCIe Gen3 x16",
               source="https://www.nvidia.com/en-us/data-center/tesla-t4/ (FP16 mixed precision 65 TFLOPS; "
                      "320 GB/s; PCIe Gen3 x16 32 GB/s, no NVLink)"),
}

# Between nodes: one InfiniBand port per GPU.
LINKS = {
    "NVLink 4 (H100/H200)": 450e9,
    "NVLink 3 (A100)": 300e9,
    "InfiniBand NDR 400 Gb/s": 50e9,  # DGX H100: 8 ConnectX-7 ports of 400 Gb/s, one per GPU
    "InfiniBand HDR 200 Gb/s": 25e9,  # DGX A100: 8 ConnectX-6 ports of 200 Gb/s, one per GPU
    "PCIe Gen3 x16 (T4)": 16e9,
}
LINK_SOURCES = ("DGX H100: https://www.nvidia.com/en-us/data-center/dgx-h100/ (8x ConnectX-7, 400 Gb/s each); "
                "DGX A100: https://www.nvidia.com/en-us/data-center/dgx-a100/ (8x ConnectX-6, 200 Gb/s each)")


# ---------------------------------------------------------------------------------
# measuring this machine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device, repeats: int) -> float:
    """Best of `repeats` runs. On a CPU, the calling thread's CPU time (time.thread_time): on a shared
    machine the wall clock also counts the time the thread waits for a core, which grows with the
    length of the operation, so a wall-clock roof taken from small matmuls would put large ones far
    below it. On a GPU, wall time between synchronisations."""
    fn()  # warm up
    clock = time.perf_counter if torch.device(device).type == "cuda" else time.thread_time
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = clock()
        fn()
        _sync(device)
        best = min(best, clock() - start)
    return best


def measure_matmul_flops(n: int, dtype=torch.float32, device="cpu", repeats: int = 5, k: int | None = None) -> float:
    """FLOP/s of (n, k) @ (k, n), best of `repeats`: 2 n^2 k FLOPs (k = n by default)."""
    device = torch.device(device)
    k = k or n
    a = torch.randn(n, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    return 2 * n * n * k / _best_seconds(lambda: a @ b, device, repeats)


def measure_peak_flops(dtype=torch.float32, device="cpu", sizes=(256, 512, 1024), repeats: int = 5) -> float:
    """The best FLOP/s of square matmuls of `sizes`: the machine's compute roof, as measured."""
    return max(measure_matmul_flops(n, dtype, device, repeats) for n in sizes)


def measure_bandwidth(numel: int = 2**24, device="cpu", repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: copying `numel` fp32 values reads and writes 8 bytes each; best of `repeats`."""
    device = torch.device(device)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _best_seconds(lambda: dst.copy_(src), device, repeats)


# ---------------------------------------------------------------------------------
# intensities and the roof


def attainable(intensity, peak_flops: float, bandwidth: float):
    """The roofline: min(peak, intensity * bandwidth) FLOP/s."""
    return torch.clamp(torch.as_tensor(intensity, dtype=torch.float64) * bandwidth, max=peak_flops)


def matmul_intensity(m: int, k: int, n: int, bytes_per_element: float = 2) -> float:
    """(m, k) @ (k, n): 2mkn FLOPs over reading both operands and writing the result once."""
    return 2 * m * k * n / (bytes_per_element * (m * k + k * n + m * n))


def attention_intensity(seq_len: int, head_dim: int, bytes_per_element: float = 2, fused: bool = True) -> float:
    """One head's attention forward, 4 s^2 d FLOPs (q k^T and p v). Fused (flash attention): reads q, k, v
    and writes o, 4 s d e bytes. Written out: also writes the s^2 scores, reads them, writes and reads
    the probabilities, 4 s^2 e bytes more."""
    s, d, e = seq_len, head_dim, bytes_per_element
    traffic = 4 * s * d * e + (0 if fused else 4 * s * s * e)
    return 4 * s * s * d / traffic


def collective_intensity(kind: str, bytes_per_element: float = 2) -> float:
    """FLOPs per byte sent by a ring collective: all-reduce adds (N-1)/N S/e values while sending
    2(N-1)/N S bytes, so 1/(2e); reduce-scatter 1/e; all-gather 0. Nowhere near any ridge: a collective's
    time is its bytes over the link's bandwidth, and the only way to hide it is under other work."""
    table = {"all_reduce": 1 / (2 * bytes_per_element), "reduce_scatter": 1 / bytes_per_element, "all_gather": 0.0}
    if kind not in table:
        raise ValueError(f"kind must be one of {sorted(table)}, got {kind!r}")
    return table[kind]


# ---------------------------------------------------------------------------------
# crossovers: when communication hides under computation


def dp_overlap_tokens(world_size: int, peak_flops: float, link_bw: float, bytes_per_element: float = 2) -> float:
    """Tokens per rank and step above which DP's gradient all-reduce fits under the backward.

    Backward: 4 Psi FLOPs per token (twice the forward's 2 Psi), 4 Psi T / F seconds for T tokens.
    All-reduce: 2(N-1)/N Psi e / B seconds. Equal at T = (N-1)/N * e * F / (2 B), whatever Psi.
    FSDP's all-gather under the forward (2 Psi T / F against (N-1)/N Psi e / B) crosses at the same T.
    """
    n = world_size
    return (n - 1) / n * bytes_per_element * peak_flops / (2 * link_bw)


def tp_critical_hidden(tp_size: int, peak_flops: float, link_bw: float, bytes_per_element: float = 2) -> float:
    """Hidden size below which a Megatron layer's all-reduces take longer than its matmuls.

    Per layer forward: 24 b s h^2 / t FLOPs per rank, 24 b s h^2 / (t F) seconds; two ring all-reduces
    of b s h e bytes, 4 (t-1)/t b s h e / B seconds (arXiv 1909.08053). Their ratio is
    6 h B / ((t-1) e F): communication dominates when h < (t-1) e F / (6 B), whatever b and s.
    """
    t = tp_size
    return (t - 1) * bytes_per_element * peak_flops / (6 * link_bw)


def pp_microbatches(num_stages: int, bubble: float, virtual_stages: int = 1) -> int:
    """Smallest m with idle fraction (p-1)/(v m + p - 1) <= bubble (1F1B, interleaved with v chunks)."""
    p, v = num_stages, virtual_stages
    if not 0 < bubble < 1:
        raise ValueError(f"bubble must be a fraction in (0, 1), got {bubble}")
    return max(1, math.ceil((p - 1) * (1 - bubble) / (bubble * v) - 1e-9))


# ---------------------------------------------------------------------------------
# the plot


def plot_roofline(machines: dict, points: list | None = None, ax=None, intensity_range=(0.05, 1e4)):
    """machines: {name: (peak FLOP/s, bandwidth B/s)}; points: [(label, intensity, FLOP/s)] measured."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 5))[1]
    x = torch.logspace(torch.log10(torch.tensor(intensity_range[0])), torch.log10(torch.tensor(intensity_range[1])), 200)
    for (name, (peak, bandwidth)), color in zip(machines.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        ax.plot(x, attainable(x, peak, bandwidth), color=color, label=f"{name}: ridge at {peak / bandwidth:.0f} FLOP/B")
        ax.axvline(peak / bandwidth, color=color, linestyle=":", linewidth=0.8)
    for k, (label, intensity, flops) in enumerate(points or []):
        ax.plot(intensity, flops, "kx", markersize=7)
        ax.annotate(label, (intensity, flops), textcoords="offset points", xytext=(-4, -12 if k % 2 else 6),
                    fontsize=7, ha="right")  # alternate above and below: neighbours do not overlap
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable FLOP/s")
    ax.legend(fontsize=7, loc="lower right")
    return ax
