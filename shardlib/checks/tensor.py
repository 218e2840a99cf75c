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

from shardlib.checks.harness import (DTYPE, ELEMENT_SIZE, STEPS, TOLERANCE, adamw, compare_run, cpu_state,
                                     interleaved_step_times, launch_on, reference_run, train_steps, verdict)
from shardlib.comm import comm_ledger
from shardlib.launch import current_device, launch
from shardlib.models import Block, GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.tensor import gather_full_state_dict
from shardlib.parallel.tensor_gpt import (
    check_tp_config,
    parallelize_block,
    parallelize_gpt,
    sync_sequence_parallel_grads,
)
from shardlib.reference import compare_state, model_loss

CHECK_GPT = GPTConfig()  # the course's small GPT: V=256, T=64, L=2, 4 heads, h=64
BATCH = 4


def global_batches(steps: int = STEPS) -> list:
    return random_token_batches(CHECK_GPT, BATCH, steps)


def build_check_gpt():
    return build_gpt(CHECK_GPT, seed=0).to(DTYPE)


def world_size_error(technique: str, world_size: int) -> str | None:
    """Why the check cannot run on `world_size` ranks (None: it can)."""
    try:
        check_tp_config(CHECK_GPT, world_size, technique == "tp-sp")
    except ValueError as error:
        return f"{technique} splits the check's GPT t = world size ways: {error}"
    return None


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


def _records(ledger) -> list[tuple[str, int]]:
    return [(r.kind, r.nbytes // ELEMENT_SIZE) for r in ledger.records]  # (kind, elements)


def _train_on_rank(sequence_parallel: bool, steps: int) -> dict:
    """Losses, full gradients of step 1, full parameters after the last step; the ledger of step 1."""
    model = parallelize_gpt(build_check_gpt().to(current_device()), sequence_parallel=sequence_parallel)
    first = {}

    def forward_backward(batch):
        with comm_ledger() as forward:  # nested in the step's ledger: both record the forward
            loss = model_loss(model, batch)
        with comm_ledger() as backward:
            loss.backward()
            sync_sequence_parallel_grads(model)
        if not first:
            first.update(ledger=(_records(forward), _records(backward)),
                         grads=cpu_state(gather_full_state_dict(model, grads=True)))
        return loss

    losses, _ = train_steps(adamw(model.parameters()), global_batches(steps), forward_backward)
    return dict(first, losses=losses, state=cpu_state(gather_full_state_dict(model)))


def verify_tp(world_size: int, technique: str = "tp", steps: int = STEPS, device: str = "cpu") -> dict:
    """t ranks vs one device: `steps` AdamW steps of the small GPT, parameters and losses with the
    harness's policy, and the first step's gradients; the ledger against expected_collectives."""
    if technique not in ("tp", "tp-sp"):
        raise ValueError(f"technique must be 'tp' or 'tp-sp', got {technique!r}")
    if world_size_error(technique, world_size):  # before any process starts
        raise ValueError(world_size_error(technique, world_size))
    sequence_parallel = technique == "tp-sp"
    per_rank = launch_on(_train_on_rank, world_size, args=(sequence_parallel, steps), device=device, timeout=300)
    reference = reference_run(build_check_gpt, global_batches(steps), first_grads=True, device=device)
    result = compare_run(per_rank[0]["state"], per_rank[0]["losses"], reference["state"], reference["losses"])
    grad_abs, grad_rel = compare_state(per_rank[0]["grads"], reference["grads"])
    same_on_ranks = all(r["losses"] == per_rank[0]["losses"] and r["state"].keys() == per_rank[0]["state"].keys()
                        for r in per_rank)  # every rank saw one loss
    expected = expected_collectives(CHECK_GPT, BATCH, CHECK_GPT.seq_len, world_size, sequence_parallel)
    ledger_ok = all(r["ledger"][0] == expected[0] and sorted(r["ledger"][1]) == sorted(expected[1]) for r in per_rank)
    forward = per_rank[0]["ledger"][0]
    grads = {"max_abs_diff": grad_abs, "max_rel_diff": grad_rel, "passed": grad_rel <= TOLERANCE}
    notes = [f"loss rel {result['loss_rel_diff']:.1e}, step-1 grads rel {grad_rel:.1e}; forward: {len(forward)} "
             f"collectives ({sum(k == 'all_reduce' for k, _ in forward)} all-reduce)"
             + (", = formula" if ledger_ok else "")]
    problems = ([] if ledger_ok else ["LEDGER DIFFERS from the formula"]) + \
        ([] if same_on_ranks else ["RANKS DISAGREE on the loss"])
    return verdict([result, grads], notes, problems)


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
    runs = {name: (m, adamw(m.parameters())) for name, m in (("ours", ours), ("torch", theirs))}
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
