"""Collectives over the links of a cluster, and what overlapping them with computation really saves.

Ring collectives on a group of n GPUs (comm.AlphaBeta, the course's alpha-beta model): an all-reduce
takes 2(n-1) steps, an all-gather, reduce-scatter or all-to-all n-1, each step alpha + S / (n B) for a
tensor of S bytes; one GPU sends 2(n-1)/n S or (n-1)/n S. B is the bandwidth per GPU and direction of
the slowest link the group crosses, times the fraction of it collectives reach there (fitted,
shardlib/plan/fitted.py; nccl-tests report ~200 GB/s of bus bandwidth for an all-reduce over 8 NVLink
A100s of 300, https://github.com/NVIDIA/nccl-tests/issues/149):
- inside a node, NVLink;
- across nodes, k B_net for a group with k GPUs in each node (B_net: one GPU's share of the node's
  network): NCCL runs a ring per NIC, each leaving the node through a different one, so an all-reduce
  over whole nodes moves the node's whole network bandwidth (nccl-tests on 3 nodes of 8 A100 with 4 HDR
  NICs: about 85 GB/s of bus bandwidth, 96 at best, against 4 x 200 Gb/s = 100 GB/s per node, where one
  GPU's share is 12.5, https://github.com/NVIDIA/nccl-tests/issues/119). The data-parallel groups (and
  ZeRO's) have k = g / t, at least 1. Tensor-, context- and expert-parallel groups that cross nodes are
  charged one GPU's share (cost_comm.py says why).

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


def link_bandwidth(cluster, span, fraction: tuple[float, float], nics=1):
    """Bytes/s per GPU of a group spanning `span` consecutive ranks: inside one node, NVLink; across nodes, one
    GPU's share of the network times `nics`, the group's GPUs in each node (a ring collective runs a ring per
    NIC it can use), at most NVLink's; times the fraction of it collectives reach there (fraction: (inside,
    across))."""
    network = torch.as_tensor(cluster.inter_bw_gbps * fraction[1] * nics)
    across = torch.clamp(network, max=cluster.intra_bw_gbps * fraction[0])
    return torch.where(in_node(cluster, span), cluster.intra_bw_gbps * fraction[0], across) * 1e9


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
        """steps (alpha + S / (n B)) on a tensor of S = nbytes; nothing for an empty one (a dense model's expert
        gradients), which is never sent. all_to_all: n-1 messages of S/n."""
        latency = self.alpha * ((self.n > 1) & (torch.as_tensor(nbytes) > 0))
        return self.steps(kind) * (latency + nbytes / (self.n * self.bandwidth))

    def sent(self, kind: str, nbytes):
        """Bytes one GPU sends: 2 (n-1)/n S (all-reduce) or (n-1)/n S (all-gather, reduce-scatter, all-to-all)."""
        return self.steps(kind) / self.n * nbytes
