"""Collectives over the links of a cluster, and what overlapping them with computation really saves.

Ring collectives on a group of n GPUs (comm.AlphaBeta, the course's alpha-beta model): an all-reduce
takes 2(n-1) steps, an all-gather, reduce-scatter or all-to-all n-1, each step alpha + S / (n B) for a
tensor of S bytes; one GPU sends 2(n-1)/n S or (n-1)/n S. B is the bandwidth per GPU and direction of
the slowest link the group crosses (NVLink when its GPUs share a node, the network otherwise), times
the fraction of it collectives reach there (fitted, shardlib/plan/fitted.py; nccl-tests report ~200 GB/s of
bus bandwidth for an all-reduce over 8 NVLink A100s of 300, https://github.com/NVIDIA/nccl-tests/issues/149).

Overlap. A collective of C seconds launched beside computation of T seconds (a DP reduction beside the
backward, a ring-attention block beside attention, a TP all-gather beside its matrix product) can hide
at most T of itself: the links carry no more while that computation lasts. And the two slow each other:
the communication kernels take SMs and memory bandwidth, so the computation runs 1 + kappa times slower
while they run. Measured over GPT and Llama training steps on A100s and H100s, kappa averages 18.9%
(max 40%; Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
Learning", arXiv 2507.03114, abstract). Computation progresses C / (1 + kappa) while the collective runs,
so the pair takes max(C, T + C kappa / (1 + kappa)), and what the overlap leaves on the step is

    exposed(C, T) = max(C - T, C kappa / (1 + kappa))      (C: seconds of everything on the same links)

Collectives that hide behind the same computation on the same links are summed before they are
compared with it.
"""

from __future__ import annotations

import torch

COMPUTE_SLOWDOWN = 0.189  # kappa: computation slowed by an overlapped collective (arXiv 2507.03114)


def exposed(comm, window, overlap: bool = True):
    """Seconds a collective of `comm` seconds adds to a step when overlapped with `window` seconds of compute."""
    if not overlap:
        return comm
    return torch.maximum(comm - window, comm * (COMPUTE_SLOWDOWN / (1 + COMPUTE_SLOWDOWN)))


def link_bandwidth(cluster, span, fraction: tuple[float, float]):
    """Bytes/s per GPU of a group spanning `span` consecutive ranks: inside one node or across, times the
    fraction of it collectives reach there (fraction: (inside, across))."""
    g = cluster.gpus_per_node
    inside = (span <= g) & (torch.remainder(g, span) == 0)
    return torch.where(inside, cluster.intra_bw_gbps * fraction[0], cluster.inter_bw_gbps * fraction[1]) * 1e9


def in_node(cluster, span):
    """True where a group of `span` consecutive ranks stays inside one node (a column)."""
    g = cluster.gpus_per_node
    return (span <= g) & (torch.remainder(g, span) == 0)


class Ring:
    """Ring collectives on groups of n GPUs (a column), over links of `bandwidth` bytes/s (a column)."""

    def __init__(self, n, bandwidth, alpha: float):
        self.n, self.bandwidth, self.alpha = n, bandwidth, alpha

    def steps(self, kind: str):
        return (2 if kind == "all_reduce" else 1) * (self.n - 1)

    def time(self, kind: str, nbytes):
        """steps (alpha + S / (n B)) on a tensor of S = nbytes. all_to_all: n-1 messages of S/n."""
        return self.steps(kind) * (self.alpha * (self.n > 1) + nbytes / (self.n * self.bandwidth))

    def sent(self, kind: str, nbytes):
        """Bytes one GPU sends: 2 (n-1)/n S (all-reduce) or (n-1)/n S (all-gather, reduce-scatter, all-to-all)."""
        return self.steps(kind) / self.n * nbytes
