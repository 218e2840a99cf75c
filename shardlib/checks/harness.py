"""What every check shares: train on ranks, train on one device, compare with one policy, time side by side.

A check trains a technique on N ranks and the same model on one device (`reference_run`), from the
same seed on the same global batches, and holds the two against each other with one policy:

    parameters   per tensor, max |ours - reference| / max |reference|  <= TOLERANCE
    losses       per step, |ours - reference| / |reference|             <= TOLERANCE

after STEPS optimizer steps of AdamW at LR (`adamw`), models and data in DTYPE = float64.

Why float64. Every sharding sums in another order, which moves each gradient by rounding: ~1e-7 of
its terms in float32. Adam divides each gradient by its own running size, so an element whose
gradient is nearly zero (its terms cancel) turns that rounding into a step of up to lr. Among the
tens of thousands of elements of a model a few always nearly cancel, so in float32 the largest
parameter difference after 5 steps is luck: measured for DDP on the check GPT (2 or 3 ranks, lr 3e-4,
seeds 0-3) it ranged from 2.4e-6 to 2.9e-4 relative, half the runs above 1e-5. In float64 the same
runs differ by 2.4e-15 to 1.2e-12 (1e-12 .. 3e-11 at lr 1e-2): eight orders of magnitude under the
tolerance, whatever the seed. (The course GPT also has no key-projection bias: its gradient would be
exactly zero, pure rounding.) Ledger and memory formulas count ELEMENT_SIZE = 8 bytes per element.

A check's models are built in DTYPE. On each rank it builds its technique on `current_device()`, then
runs `train_steps(optimizer, batches, forward_backward)`: the one training loop, with each step's
communication in a ledger.
`launch_on` starts the ranks on `device` ("cpu": processes over gloo; "cuda": one GPU per rank;
"auto": GPUs when there are enough); every rank and the reference compute on
`shardlib.current_device()`.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlib import memory
from shardlib.comm import CommLedger, comm_ledger
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt, build_mlp, mlp_batch, random_token_batches
from shardlib.reference import compare_state, model_loss, train_reference
from shardlib.timing import interleaved_times

TOLERANCE = 1e-5
LR = 3e-4
STEPS = 5
DTYPE = torch.float64
ELEMENT_SIZE = torch.empty((), dtype=DTYPE).element_size()  # bytes per element in ledgers and memory
RECIPE = memory.Recipe(ELEMENT_SIZE, ELEMENT_SIZE, 2 * ELEMENT_SIZE,
                       copies="float64 weights (8), gradients (8), Adam m and v (8 + 8)",
                       source="torch.optim.AdamW keeps m and v in the parameters' dtype; the checks run in float64")


# the data-parallel checks' models: an MLP whose Psi = 1634 neither 3 nor 4 divides (flat buffers pad), a small GPT
CHECK_MLP = dict(d_in=13, hidden=29, n_blocks=2, n_out=3)
CHECK_GPT = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)  # Psi = 42304
BATCH = 12  # the global batch: splits evenly over N in 1, 2, 3, 4, 6, 12


def build_check_model(kind: str, seed: int = 0) -> nn.Module:
    """The check MLP ("mlp") or GPT ("gpt"), in DTYPE."""
    return (build_mlp(seed, **CHECK_MLP) if kind == "mlp" else build_gpt(CHECK_GPT, seed=seed)).to(DTYPE)


def check_model_params(kind: str) -> int:
    """Psi of build_check_model(kind), from the models' formulas (not from the code under test)."""
    if kind == "gpt":
        return CHECK_GPT.n_params
    d, h, blocks, out = CHECK_MLP["d_in"], CHECK_MLP["hidden"], CHECK_MLP["n_blocks"], CHECK_MLP["n_out"]
    return blocks * (2 * d * h + h + d) + d * out + out


def check_batches(kind: str, steps: int = STEPS) -> list:
    """`steps` global batches of BATCH examples for build_check_model(kind), the same on every rank."""
    if kind == "mlp":
        d_in, n_out = CHECK_MLP["d_in"], CHECK_MLP["n_out"]
        batches = [mlp_batch(BATCH, d_in=d_in, n_out=n_out, seed=step) for step in range(steps)]
        return [(x.to(DTYPE), y.to(DTYPE)) for x, y in batches]
    return random_token_batches(CHECK_GPT, BATCH, steps)


def batch_split_error(technique: str, world_size: int) -> str | None:
    """Why a data-parallel check cannot cut BATCH over `world_size` ranks (None: it can)."""
    if BATCH % world_size:
        sizes = tuple(n for n in range(1, BATCH + 1) if BATCH % n == 0)
        return f"{technique} splits a global batch of {BATCH} evenly: use a world size in {sizes}, not {world_size}"
    return None


def adamw(params, lr: float = LR) -> torch.optim.Optimizer:
    """The one optimizer of the checks (and of their single-device references)."""
    return torch.optim.AdamW(params, lr=lr)


# ---------------------------------------------------------------------------------
# on the ranks


def launch_on(fn: Callable, world_size: int, *, args: tuple = (), device: str = "cpu", timeout: float = 300.0) -> list:
    """shardlib.launch on `device`: "cpu", "cuda" or "auto" (the launcher decides)."""
    return launch(fn, world_size, args=args, timeout=timeout, device=device)


def on_device(batch, dtype: torch.dtype = DTYPE):
    """A batch (a tuple of tensors) on this rank's device; floating tensors in `dtype`."""
    return tuple(t.to(current_device(), dtype) if t.is_floating_point() else t.to(current_device()) for t in batch)


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict (or gradients) as CPU copies: what a rank returns to the caller."""
    return {name: t.detach().to("cpu", copy=True) for name, t in state.items()}


def train_steps(optimizer, batches: Iterable, forward_backward: Callable,
                dtype: torch.dtype = DTYPE) -> tuple[list, list[CommLedger]]:
    """The training loop of every check: per global batch, zero the gradients, `forward_backward(batch)`
    (the technique's forward, backward and gradient sync; the batch on this rank's device, floating
    tensors in `dtype`; returns the loss or None), `optimizer.step()`. Returns (losses, one ledger per
    step: the step's whole communication)."""
    losses, ledgers = [], []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        with comm_ledger() as ledger:
            loss = forward_backward(on_device(batch, dtype))
            optimizer.step()
        losses.append(loss.item() if isinstance(loss, torch.Tensor) else loss)
        ledgers.append(ledger)
    return losses, ledgers


# ---------------------------------------------------------------------------------
# on one device


def _reference_on_rank(build_model, batches, micro_batches: int, first_grads: bool, optimizer) -> dict:
    dtype = next(build_model().parameters()).dtype
    batches = [on_device(batch, dtype) for batch in batches]
    model, losses = train_reference(lambda: build_model().to(current_device()), batches, optimizer,
                                    micro_batches=micro_batches)
    out = {"state": cpu_state(model.state_dict()), "losses": losses}
    if first_grads:  # the gradient of the mean loss over the first global batch, before any step
        fresh = build_model().to(current_device())
        model_loss(fresh, batches[0]).backward()
        out["grads"] = cpu_state({n: p.grad for n, p in fresh.named_parameters() if p.grad is not None})
    return out


def reference_run(build_model: Callable[[], nn.Module], batches: list, *, micro_batches: int = 1,
                  first_grads: bool = False, device: str = "cpu", optimizer: Callable = adamw) -> dict:
    """Train `build_model()` on one device (one rank of `device`, one thread, the model's dtype) with
    `optimizer(params)` (the checks' AdamW), one step per global batch (accumulating `micro_batches`
    micro-batches); {"state", "losses"[, "grads"]}."""
    return launch_on(_reference_on_rank, 1, args=(build_model, batches, micro_batches, first_grads, optimizer),
                     device=device, timeout=300)[0]


# ---------------------------------------------------------------------------------
# the comparison policy


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


def compare_fp32_and_fp64(build_model: Callable[[], nn.Module], batches: list, ours: dict, device: str = "cpu") -> dict:
    """The policy of the checks whose ranks sum in another order than one device (context, experts):
    fp32 losses and first-step gradients, and fp64 parameters after the last step, each against one
    device in the same dtype. `ours`: {torch.float32: {"state", "losses", "grads"}, torch.float64:
    {"state", "losses"}} from rank 0. Returns {"step1", "params", "fp32_params"} (compare_run's
    records; "fp32_params" is printed, not held).

    Why fp64 for the parameters: in fp32 they differ after 5 AdamW steps by up to ~5e-5 relative
    (measured), even where the losses agree to 1e-7, because Adam divides each gradient by its own
    running size, which turns the rounding of a near-zero element into a visibly different step; in
    fp64 the same comparison is ~1e-13."""
    ref32, ref64 = (reference_run(lambda dtype=dtype: build_model().to(dtype), batches,
                                  first_grads=dtype == torch.float32, device=device)
                    for dtype in (torch.float32, torch.float64))
    ours32, ours64 = ours[torch.float32], ours[torch.float64]
    return {"step1": compare_run(ours32["grads"], ours32["losses"], ref32["grads"], ref32["losses"]),
            "params": compare_run(ours64["state"], ours64["losses"], ref64["state"], ref64["losses"]),
            "fp32_params": compare_run(ours32["state"], ours32["losses"], ref32["state"], ref32["losses"])}


def worst(comparisons: list[dict]) -> dict:
    """Several comparisons as one: the largest differences; passed when every one passed."""
    return {"max_abs_diff": max(c["max_abs_diff"] for c in comparisons),
            "max_rel_diff": max(c["max_rel_diff"] for c in comparisons),
            "passed": all(c["passed"] for c in comparisons)}


def verdict(comparisons: list[dict], notes: list[str], problems: list[str] = ()) -> dict:
    """A check's record: the worst of its comparisons, failed by any problem (a ledger or a memory
    figure off its formula), the notes and the problems as its detail."""
    record = worst(comparisons)
    record["passed"] = bool(record["passed"] and not problems)
    record["detail"] = "; ".join(list(notes) + list(problems))
    return record


def mean_losses(per_rank_losses: list[list[float]]) -> list[float]:
    """The global batch's loss per step from the ranks' losses on equal slices (their mean)."""
    return [sum(step) / len(step) for step in zip(*per_rank_losses)]


# ---------------------------------------------------------------------------------
# side-by-side timing of training steps


def interleaved_step_times(runs: dict, batch, loss_fn, repeats: int, warmup: int = 2) -> dict:
    """Median seconds of one training step for each (model, optimizer) in `runs`, on this rank.

    The implementations take turns (shardlib.timing.interleaved_times), each step started together
    on every rank (barrier), so all of them see the same machine.
    """
    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()

    fns = {name: (lambda pair=pair: step(*pair)) for name, pair in runs.items()}
    return interleaved_times(fns, repeats, warmup=warmup, sync=dist.barrier)
