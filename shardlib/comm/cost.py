"""The alpha-beta cost model of ring collectives, and the bytes each rank sends.

A message of S bytes over one link costs alpha + S/B seconds: alpha the latency per message, B the
bandwidth of the link (Hockney's model; Thakur, Rabenseifner and Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 2005). A ring collective on N ranks cuts its tensor into N
chunks and takes a number of steps in which every rank sends one chunk to its neighbour:

    collective       steps     bytes sent per rank          time
    reduce-scatter   N-1       (N-1)/N * S                  (N-1) * (alpha + S/(N*B))
    all-gather       N-1       (N-1)/N * S                  (N-1) * (alpha + S/(N*B))
    all-reduce       2(N-1)    2(N-1)/N * S                 2(N-1) * (alpha + S/(N*B))
    broadcast        k+N-2     S (every rank but the last)  (k+N-2) * (alpha + S/(k*B))

S is the full tensor (all-gather: the gathered output; reduce-scatter: the input); k is the number
of pieces the pipelined chain broadcast cuts the tensor into (k = N in shardlib.comm.ring). With
padding (N does not divide the tensor) the bytes are exact when S is replaced by N*c*element_size,
c = ceil(numel/N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardlib.comm.ledger import RING_STEPS as _RING_STEPS

__all__ = ["ring_sent_bytes", "AlphaBeta", "fit_alpha_beta"]


def ring_sent_bytes(kind: str, numel: int, world_size: int, element_size: int = 4, rank: int = 0, src: int = 0) -> int:
    """Bytes one rank sends in the ring collective `kind` on a tensor of `numel` elements.

    Exact for this module's implementation, padding included: chunks of ceil(numel/N).
    For broadcast, `rank` and `src` matter: every rank but the last of the chain sends S.
    """
    n = world_size
    if n == 1:
        return 0
    chunk = math.ceil(numel / n) * element_size
    if kind == "broadcast":
        last_of_chain = (src - 1) % n
        return 0 if rank == last_of_chain else n * chunk
    if kind not in _RING_STEPS:
        raise ValueError(f"unknown collective {kind!r}; use one of {sorted(_RING_STEPS) + ['broadcast']}")
    return _RING_STEPS[kind](n) * chunk


@dataclass(frozen=True)
class AlphaBeta:
    """A link: `alpha` seconds of latency per message, `bandwidth` bytes per second."""

    alpha: float
    bandwidth: float

    def time(self, kind: str, nbytes: float, world_size: int) -> float:
        """Predicted seconds for a ring collective of `nbytes` (S) on `world_size` ranks."""
        n = world_size
        if n == 1:
            return 0.0
        if kind == "broadcast":
            steps, piece = 2 * n - 2, nbytes / n  # k = N pieces
        else:
            steps, piece = _RING_STEPS[kind](n), nbytes / n
        return steps * (self.alpha + piece / self.bandwidth)


def fit_alpha_beta(kind: str, world_size: int, nbytes: list[float], seconds: list[float]) -> AlphaBeta:
    """Least-squares fit of t = steps*alpha + steps*(S/N)/B to measured times.

    Each point is weighted by 1/t (relative error), since sizes span decades: unweighted,
    the largest tensors' jitter alone would decide alpha.
    """
    n = world_size
    steps = (2 * n - 2) if kind == "broadcast" else _RING_STEPS[kind](n)
    x = torch.tensor([[steps, steps * s / n] for s in nbytes], dtype=torch.float64)  # (k, 2)
    y = torch.tensor(seconds, dtype=torch.float64)  # (k,)
    weight = 1.0 / y.unsqueeze(1)  # (k, 1)
    alpha, inv_bw = torch.linalg.lstsq(x * weight, (y.unsqueeze(1) * weight)).solution.squeeze(1).tolist()
    return AlphaBeta(alpha=max(alpha, 0.0), bandwidth=1.0 / inv_bw if inv_bw > 0 else float("inf"))


