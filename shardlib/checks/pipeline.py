"""Pipeline parallelism held against its references: `verify` (one device, the ledger formula)
and `bench` (the bubble formula, and PyTorch's torch.distributed.pipelining).

verify: the course's small GPT (4 blocks) cut into p = 2 or 4 stages, 5 AdamW steps with
m in {1, p, 4p} micro-batches for each schedule. Parameters equal one device accumulating the
same m micro-batches; losses and the first step's gradients equal one device on the whole batch;
each rank's ledger holds exactly m sends of (b/m)*s*h elements to each neighbour per step
(activations forward, gradients backward); peak stashed micro-batches equal the formula.

bench: the measured bubble fraction (from each run's timeline) beside (p-1)/(m+p-1), on two
kinds of stages: GPT blocks (real compute, two per stage), and timed stages that sleep
t_f = 30 ms forward and t_b = 60 ms backward. On a CPU the p processes share the cores: with 4
ranks on 2 cores a busy stage runs slower when its neighbours are busy too, which distorts the
timeline and is not what a pipeline of p devices does. A sleeping stage takes its time without
using a core, as a GPU kernel does from the host's point of view, so its rows measure the
schedule and the messages alone. In bubble rows, torch_s is the formula's step time
(m+p-1)(t_F+t_B) from the measured mean op times, and ratio = ours_s / torch_s.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from shardlib.checks.harness import (DTYPE, ELEMENT_SIZE, STEPS, TOLERANCE, adamw, compare_run, cpu_state, launch_on,
                                     reference_run, train_steps, verdict)
from shardlib.launch import current_device, launch
from shardlib.lessons.timed_stage import TimedStage
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.pipeline import check_pipeline, gpt_stage, pipeline_step
from shardlib.parallel.schedules import bubble_formula, measured_bubble
from shardlib.reference import compare_state
from shardlib.timing import interleaved_times

CHECK_GPT = GPTConfig(seq_len=16, n_layer=4, n_head=4, n_embd=32)


def global_batches(steps: int, batch_size: int) -> list:
    return random_token_batches(CHECK_GPT, batch_size, steps)


def build_check_gpt():
    return build_gpt(CHECK_GPT, seed=0).to(DTYPE)


def world_size_error(technique: str, world_size: int) -> str | None:
    """Why the check cannot run on `world_size` ranks (None: it can)."""
    try:
        check_pipeline(CHECK_GPT.n_layer, world_size)
    except ValueError as error:
        return f"{technique} cuts the check's GPT into p = world size stages: {error}"
    return None


def _train_on_rank(schedule: str, microbatch_counts: list[int], steps: int, batch_size: int) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    runs = {}
    for m in microbatch_counts:
        stage = gpt_stage(build_check_gpt().to(current_device()), rank, p)
        peaks, first_grads = [], {}

        def forward_backward(batch):
            result = pipeline_step(stage, batch, m, schedule)
            peaks.append(result.peak_stashed)
            if not first_grads:
                first_grads.update(cpu_state({name: q.grad for name, q in stage.named_parameters()}))
            return result.loss

        losses, ledgers = train_steps(adamw(stage.parameters()), global_batches(steps, batch_size), forward_backward)
        sends = [[(r.peers[0], r.sent_bytes) for r in ledger.records if r.kind == "send"] for ledger in ledgers]
        runs[m] = dict(state=cpu_state(stage.state_dict()), losses=losses, sends=sends, peak=max(peaks),
                       grads=first_grads)
    return runs


def _ledger_problems(sends_per_rank: list[list], m: int, batch_size: int) -> list[str]:
    """Each rank, each step: m sends of (b/m)*s*h elements to each neighbour, nothing else."""
    p, c = len(sends_per_rank), CHECK_GPT
    piece = batch_size // m * c.seq_len * c.n_embd * ELEMENT_SIZE  # bytes of one (b/m, s, h) activation or gradient
    problems = []
    for rank, steps in enumerate(sends_per_rank):
        expected = sorted([(rank + 1, piece)] * m * (rank < p - 1) + [(rank - 1, piece)] * m * (rank > 0))
        problems += [f"rank {rank} sent {len(sent)} messages, not {len(expected)} of {piece} B"
                     for sent in steps if sorted(sent) != expected]
    return problems


def verify_pipeline(world_size: int, technique: str = "pp-1f1b", steps: int = STEPS, device: str = "cpu") -> dict:
    """p = world_size stages, m in {1, p, 4p} micro-batches, against one device on the same batches:

    - parameters after `steps` AdamW steps and losses vs one device accumulating the same m
      micro-batches (the sums the pipeline makes), with the harness's policy;
    - the first step's gradients vs one device on the whole batch (accumulating m micro-batch
      gradients is the gradient of the mean loss);
    - the ledger: m sends of (b/m)*s*h elements (8 bytes) to each neighbour per step, nothing else;
    - peak stashed micro-batches per stage vs the schedule's formula.
    """
    schedule = technique.removeprefix("pp-")
    if world_size_error(technique, world_size):  # before any process starts
        raise ValueError(world_size_error(technique, world_size))
    p, batch_size = world_size, 8 * world_size
    microbatch_counts = sorted({1, p, 4 * p})
    per_rank = launch_on(_train_on_rank, p, args=(schedule, microbatch_counts, steps, batch_size), device=device,
                         timeout=240)
    batches = global_batches(steps, batch_size)
    comparisons, problems = [], []
    for m in microbatch_counts:
        reference = reference_run(build_check_gpt, batches, micro_batches=m, first_grads=True, device=device)
        union = lambda key: {name: t for r in per_rank for name, t in r[m][key].items()}  # noqa: E731
        comparisons.append(compare_run(union("state"), per_rank[-1][m]["losses"], reference["state"],
                                       reference["losses"]))
        grad_abs, grad_rel = compare_state(union("grads"), reference["grads"])
        comparisons.append({"max_abs_diff": grad_abs, "max_rel_diff": grad_rel, "passed": grad_rel <= TOLERANCE})
        problems += _ledger_problems([r[m]["sends"] for r in per_rank], m, batch_size)
        peaks = [r[m]["peak"] for r in per_rank]
        expected = [{"naive": 1, "gpipe": m, "1f1b": min(p - s, m)}[schedule] for s in range(p)]
        if peaks != expected:
            problems.append(f"m={m}: peak stashed micro-batches {peaks}, expected {expected}")
    notes = [f"m in {microbatch_counts}, b={batch_size}; ledger and peak stash "
             + ("DIFFER" if problems else "= formulas")]
    return verdict(comparisons, notes, problems[:3])


# ---------------------------------------------------------------------------------
# bench: the bubble against its formula; ours against torch.distributed.pipelining


BENCH_GPT = dict(seq_len=64, n_head=4, n_embd=192)  # two blocks per stage: n_layer = 2p
MICROBATCH = 4  # examples per micro-batch


def _stage_and_batch(kind: str, m: int):
    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    if kind == "timed":
        stage = TimedStage(rank, p)
        return stage, (torch.randn(MICROBATCH * m, 64, generator=g), torch.randn(MICROBATCH * m, 64, generator=g))
    config = GPTConfig(n_layer=2 * p, **BENCH_GPT)
    stage = gpt_stage(build_gpt(config, seed=0), rank, p)
    tokens = torch.randint(0, config.vocab_size, (MICROBATCH * m, config.seq_len + 1), generator=g)
    return stage, (tokens[:, :-1], tokens[:, 1:])  # (b, T) each


def _run_steps(kind: str, schedule: str, m: int, steps: int) -> list:
    torch.set_num_threads(1)  # p ranks share the cores: one thread each
    stage, batch = _stage_and_batch(kind, m)
    results = []
    for _ in range(steps + 1):  # the first step warms up
        stage.zero_grad(set_to_none=True)
        results.append(pipeline_step(stage, batch, m, schedule))
    return results[1:]


def _bubble_row(kind: str, schedule: str, p: int, m: int, steps: int) -> dict:
    per_rank = launch(_run_steps, p, args=(kind, schedule, m, steps), timeout=600)
    bubbles, step_s, model_s = [], [], []
    for step in range(steps):
        timeline = [event for r in per_rank for event in r[step].timeline]
        bubbles.append(statistics.mean(measured_bubble(timeline).values()))
        step_s.append(max(e.end for e in timeline) - min(e.start for e in timeline))
        t_f = statistics.mean(e.end - e.start for e in timeline if e.op == "F")
        t_b = statistics.mean(e.end - e.start for e in timeline if e.op == "B")
        model_s.append((m + p - 1) * (t_f + t_b))  # the formula's step, from the measured op times
    measured, formula = statistics.median(bubbles), bubble_formula(p, m, schedule)
    ours, predicted = statistics.median(step_s), statistics.median(model_s)
    return {"benchmark": "pp", "case": f"bubble {schedule} {kind} p={p} m={m} (torch_s: formula)",
            "ours_s": ours, "torch_s": predicted, "ratio": ours / predicted, "target": None,
            "bubble_measured": round(measured, 3), "bubble_formula": round(formula, 3),
            "bubble_within_0.05": abs(measured - formula) <= 0.05,
            "peak_stashed": [max(r[k].peak_stashed for k in range(steps)) for r in per_rank],
            "ranks_per_core": round(p / (os.cpu_count() or 1), 2)}


def _time_against_torch(m: int, repeats: int) -> dict:
    """Median step time of ours and torch's Schedule1F1B on the same stages, steps interleaved;
    and the largest relative difference between the two runs' gradients."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    ours, batch = _stage_and_batch("gpt", m)
    theirs, _ = _stage_and_batch("gpt", m)
    schedule = Schedule1F1B(PipelineStage(theirs, rank, p, batch[0].device), m, loss_fn=theirs.loss)

    def step_ours():
        ours.zero_grad(set_to_none=True)
        pipeline_step(ours, batch, m, "1f1b", measure_memory=False)

    def step_torch():
        theirs.zero_grad(set_to_none=True)
        kwargs = {"target": batch[1], "losses": []} if rank == p - 1 else {}
        schedule.step(*([batch[0]] if rank == 0 else []), **kwargs)

    medians = interleaved_times({"ours": step_ours, "torch": step_torch}, repeats, sync=dist.barrier)
    grads = [((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
             for a, b in zip(ours.parameters(), theirs.parameters())]
    return dict(medians, grad_rel=max(grads))


def bench_pipeline(quick: bool = False) -> list[dict]:
    """Measured bubble vs (p-1)/(m+p-1) for GPipe and 1F1B, p = 2, 4, m = 1, 4, 16, on timed
    stages and on GPT stages; then our 1F1B vs torch.distributed.pipelining.Schedule1F1B."""
    rows, steps = [], 1 if quick else 3
    for kind in ("timed", "gpt"):
        for p in (2, 4):
            for m in (1, 4, 16):
                for schedule in ("gpipe", "1f1b"):
                    rows.append(_bubble_row(kind, schedule, p, m, steps))
    for p in (2, 4):
        per_rank = launch(_time_against_torch, p, args=(8, 2 if quick else 6), timeout=600)
        ours, theirs = max(r["ours"] for r in per_rank), max(r["torch"] for r in per_rank)
        rows.append({"benchmark": "pp", "case": f"1f1b vs torch Schedule1F1B, GPT p={p} m=8 gloo",
                     "ours_s": ours, "torch_s": theirs, "ratio": ours / theirs, "target": None,
                     "grad_max_rel_diff": max(r["grad_rel"] for r in per_rank)})
    return rows


CHECKS = {name: (verify_pipeline, (2, 4)) for name in ("pp-naive", "pp-gpipe", "pp-1f1b")}
BENCHMARKS = {"pp": bench_pipeline}
