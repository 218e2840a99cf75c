"""Tensor parallelism checked and timed: `python -m shardlib verify --technique tp|tp-sp`
and `python -m shardlib bench tp`.

verify: the small GPT split t ways (shardlib/parallel/tensor_gpt.py) against one device on the same seed
and batches; the communication ledger against the formulas of shardlib/parallel/tensor.py.
bench: shardlib's Megatron block beside PyTorch's own tensor parallelism
(torch.distributed.tensor.parallel, Colwise/RowwiseParallel) on the same block and ranks.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from shardlib.checks.harness import interleaved_step_times
from shardlib.comm import comm_ledger
from shardlib.launch import launch
from shardlib.models import GPT, Block, GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.tensor import gather_full_state_dict
from shardlib.parallel.tensor_gpt import (
    check_tp_config,
    parallelize_block,
    parallelize_gpt,
    sync_sequence_parallel_grads,
)
from shardlib.reference import compare_state, freeze_inert_key_biases, model_loss, train_reference

_CHECK_GPT = GPTConfig()  # the course's small GPT: V=256, T=64, L=2, 4 heads, h=64
_CHECK_BATCH, _CHECK_STEPS = 4, 5


def _check_batches() -> list:
    return random_token_batches(_CHECK_GPT, _CHECK_BATCH, _CHECK_STEPS)


def _check_gpt(dtype: torch.dtype) -> GPT:
    """Key biases frozen: softmax ignores a shift common to all keys, so their exact gradient is
    zero and the computed one is rounding noise that Adam would scale up to full steps."""
    return freeze_inert_key_biases(build_gpt(_CHECK_GPT, seed=0).to(dtype))


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def expected_collectives(config: GPTConfig, b: int, s: int, t: int, sequence_parallel: bool = False):
    """(forward, backward) lists of (kind, elements) one rank makes in one training step, from
    the formulas in the module docstrings: per layer 2 all-reduces of b*s*h each way; the
    embedding's, the output head's and the loss's; under sequence parallelism each all-reduce
    of b*s*h becomes a reduce-scatter plus an all-gather and one all-reduce sums the gradients
    of the weights that saw a sequence shard (6h per layer, 2h for ln_f, T*h position embedding)."""
    if t == 1:
        return [], []
    bsh, L, h = b * s * config.n_embd, config.n_layer, config.n_embd
    loss = [("all_reduce", b * s)] * 3  # max, target logit, sum of exponentials
    if not sequence_parallel:
        return [("all_reduce", bsh)] * (1 + 2 * L) + loss, [("all_reduce", bsh)] * (2 * L + 1)
    layer = [("all_gather", bsh), ("reduce_scatter", bsh)] * 2
    forward = [("reduce_scatter", bsh)] + layer * L + [("all_gather", bsh)] + loss
    backward = [("reduce_scatter", bsh)] + [("all_gather", bsh), ("reduce_scatter", bsh)] * 2 * L \
        + [("all_gather", bsh), ("all_reduce", L * 6 * h + 2 * h + config.seq_len * h)]
    return forward, backward


def _records(ledger, element_size: int) -> list[tuple[str, int]]:
    return [(r.kind, r.nbytes // element_size) for r in ledger.records]


def _train_on_rank(sequence_parallel: bool) -> dict:
    """fp32 and fp64: losses, full gradients of step 1, full parameters after the last step;
    the ledger of step 1 (fp32)."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        model = parallelize_gpt(_check_gpt(dtype), sequence_parallel=sequence_parallel)
        optimizer = _adamw(model.parameters())
        losses = []
        for step, batch in enumerate(_check_batches()):
            optimizer.zero_grad(set_to_none=True)
            with comm_ledger() as forward:
                loss = model_loss(model, batch)
            with comm_ledger() as backward:
                loss.backward()
                sync_sequence_parallel_grads(model)
            if step == 0:
                first_grads = gather_full_state_dict(model, grads=True)
                ledger = (_records(forward, 4 if dtype == torch.float32 else 8),
                          _records(backward, 4 if dtype == torch.float32 else 8))
            optimizer.step()
            losses.append(loss.item())
        out[dtype] = (losses, first_grads, gather_full_state_dict(model), ledger)
    if dist.get_rank() == 0:  # the single-device run, here rather than in the caller's process
        out["reference"] = {dtype: _reference(dtype) for dtype in (torch.float32, torch.float64)}
    return out


def _reference(dtype: torch.dtype) -> tuple[dict, list[float], dict]:
    """Single device: (state after the steps, losses, gradients of step 1)."""
    model = _check_gpt(dtype)
    model_loss(model, _check_batches()[0]).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    trained, losses = train_reference(lambda: _check_gpt(dtype), _check_batches(), _adamw)
    return trained.state_dict(), losses, grads


def verify_tp(world_size: int, technique: str = "tp") -> dict:
    """t ranks vs one device: 5 AdamW steps of the small GPT; losses and step-1 gradients in fp32
    and fp64, parameters in fp64 (see below); the ledger against expected_collectives.

    Parameters after 5 AdamW steps are compared in fp64. In fp32 any change in the order of a
    sum - every sharding changes it - perturbs each gradient by ~1e-7 of its terms, and Adam
    divides each element by its own magnitude: an element whose gradient is ~1e-4 of the
    typical one then moves by a visibly different step (about 1e-4 of the weights here, even at
    t=1, where only the loss's sums are reordered). In fp64 the same effect is ~1e-12."""
    if technique not in ("tp", "tp-sp"):
        raise ValueError(f"technique must be 'tp' or 'tp-sp', got {technique!r}")
    sequence_parallel = technique == "tp-sp"
    check_tp_config(_CHECK_GPT, world_size, sequence_parallel)  # before any process starts
    per_rank = launch(_train_on_rank, world_size, args=(sequence_parallel,), timeout=300)
    max_abs = max_rel = 0.0
    notes, same_on_ranks = [], True
    for dtype in (torch.float32, torch.float64):
        ref_state, ref_losses, ref_grads = per_rank[0]["reference"][dtype]
        losses, grads, state, _ = per_rank[0][dtype]
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        grad_abs, grad_rel = compare_state(grads, ref_grads)
        param_abs, param_rel = compare_state(state, ref_state)
        held = [loss_rel, grad_rel] + ([param_rel] if dtype == torch.float64 else [])
        max_abs = max(max_abs, grad_abs, param_abs if dtype == torch.float64 else 0.0)
        max_rel = max(max_rel, *held)
        notes.append(f"{str(dtype)[6:]}: loss rel {loss_rel:.1e} grad rel {grad_rel:.1e} params rel {param_rel:.1e}"
                     + (" (not held: see verify_tp)" if dtype == torch.float32 else ""))
        same_on_ranks &= all(r[dtype][0] == losses for r in per_rank)  # every rank saw one loss
    expected = expected_collectives(_CHECK_GPT, _CHECK_BATCH, _CHECK_GPT.seq_len, world_size, sequence_parallel)
    ledger_ok = all(r[torch.float32][3][0] == expected[0] and sorted(r[torch.float32][3][1]) == sorted(expected[1])
                    for r in per_rank)
    forward = per_rank[0][torch.float32][3][0]
    notes.append(f"forward: {len(forward)} collectives ({sum(k == 'all_reduce' for k, _ in forward)} all-reduce), "
                 + ("= formula" if ledger_ok else "LEDGER DIFFERS from the formula"))
    return {"passed": max_rel <= 1e-5 and ledger_ok and same_on_ranks, "max_abs_diff": max_abs,
            "max_rel_diff": max_rel, "detail": "; ".join(notes)}


_BENCH_GPT = GPTConfig(seq_len=128, n_head=8, n_embd=256)


def _time_block_steps(batch_size: int, repeats: int) -> dict:
    """Median step time (forward, backward, AdamW) of one GPT block: ours vs torch's
    parallelize_module with ColwiseParallel/RowwiseParallel, steps interleaved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    block = Block(_BENCH_GPT)
    ours = parallelize_block(block, _BENCH_GPT)
    theirs = parallelize_module(copy.deepcopy(block), init_device_mesh("cpu", (dist.get_world_size(),)), {
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    x = torch.randn(batch_size, _BENCH_GPT.seq_len, _BENCH_GPT.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out_diff = (ours(x) - theirs(x)).abs().max().item()  # (B, T, C) both: the same function
    runs = {name: (m, torch.optim.AdamW(m.parameters(), lr=1e-3)) for name, m in (("ours", ours), ("torch", theirs))}
    medians = interleaved_step_times(runs, x, lambda module, x: module(x).square().mean(), repeats)
    return dict(medians, out_diff=out_diff)


def bench_tp(quick: bool = False, world_size: int = 2) -> list[dict]:
    """shardlib's Megatron block vs torch.distributed.tensor.parallel on the same block, t=2 gloo."""
    batch_size = 8
    per_rank = launch(_time_block_steps, world_size, args=(batch_size, 3 if quick else 15), timeout=600)
    ours, theirs = max(r["ours"] for r in per_rank), max(r["torch"] for r in per_rank)  # slowest rank
    c = _BENCH_GPT
    return [{"benchmark": "tp", "case": f"GPT block h={c.n_embd} T={c.seq_len} B={batch_size}, t={world_size} gloo",
             "ours_s": ours, "torch_s": theirs, "ratio": ours / theirs, "target": 1.3,
             "max_out_diff": f"{max(r['out_diff'] for r in per_rank):.1e}"}]


CHECKS = {"tp": (verify_tp, (1, 2, 4)), "tp-sp": (verify_tp, (1, 2, 4))}
BENCHMARKS = {"tp": bench_tp}
