"""What every check shares: the optimizer, the comparison policy, the side-by-side step timing.

A check trains a technique on N ranks and the same model on one device (shardlib.reference), from
the same seed on the same global batches, and holds the two against each other with one policy:

    parameters   per tensor, max |ours - reference| / max |reference|  <= TOLERANCE
    losses       per step, |ours - reference| / |reference|             <= TOLERANCE

in fp32, after STEPS optimizer steps of AdamW at LR. Adam divides each gradient by its own running
size, so a different summation order (every sharding changes it) moves an element whose gradient is
near zero by up to lr: at lr 3e-4 that stays near 3e-6 relative on the course's models (measured),
under the 1e-5 tolerance; at 1e-2 it reaches 2e-5. Checks that need a tighter comparison (tensor
parallelism's parameters) compare in float64, where the same effect is ~1e-12.
"""

from __future__ import annotations

import statistics
import time

import torch

from shardlib.reference import compare_state

TOLERANCE = 1e-5
LR = 3e-4
STEPS = 5


def adamw(params, lr: float = LR) -> torch.optim.Optimizer:
    """The one optimizer of the checks (and of their single-device references)."""
    return torch.optim.AdamW(params, lr=lr)


def relative_loss_difference(losses: list[float], reference: list[float]) -> float:
    """max over steps of |ours - reference| / |reference|."""
    if len(losses) != len(reference):
        raise ValueError(f"{len(losses)} losses against {len(reference)} reference losses")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def compare_run(state: dict, losses: list[float], reference_state: dict, reference_losses: list[float]) -> dict:
    """The comparison policy: {"max_abs_diff", "max_rel_diff", "loss_rel_diff", "passed"}."""
    max_abs, max_rel = compare_state(state, reference_state)
    loss_rel = relative_loss_difference(losses, reference_losses)
    return {"max_abs_diff": max_abs, "max_rel_diff": max(max_rel, loss_rel), "loss_rel_diff": loss_rel,
            "passed": max_rel <= TOLERANCE and loss_rel <= TOLERANCE}


def interleaved_step_times(runs: dict, batch, loss_fn, repeats: int, warmup: int = 2) -> dict:
    """Median seconds of one training step for each (model, optimizer) in `runs`, on this rank.

    The implementations take turns, in alternating order, step after step, each step started
    together on every rank (barrier), so all of them see the same machine.
    """
    import torch.distributed as dist

    names = list(runs)
    times = {name: [] for name in names}
    for i in range(repeats + warmup):
        for name in (names if i % 2 else names[::-1]):
            model, optimizer = runs[name]
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}
