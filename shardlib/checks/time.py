"""Where the time goes (lesson 13): prefetch, interleaved and zero-bubble pipelines, recomputation.

verify (each against one device, the harness's policy: float64, AdamW, STEPS steps, 1e-5 relative):

    zero3-prefetch        fully_shard per block + root with prefetch on; also off, in the same launch:
                          parameters and losses equal one device; the two ledgers hold the same calls
                          and bytes (sorted); prefetches really happened (from the second step on)
    pp-interleaved        p = N ranks, v = 2 chunks each (gpt_stage(model, c*p + s, 2p)), m in {p, 2p}
    pp-zero-bubble        p = N ranks, split backward (B, W), ZB-H1, m in {p, 2p}
                          both: parameters and losses equal one device accumulating the same m
                          micro-batches; each message (b/m)*s*h elements; peak stash = the formula
    recompute-selective   N data-parallel ranks (gradients all-reduced) of the GPT with the attention
    recompute-full        core / each block recomputed, against the plain GPT (PyTorch's fused attention)
                          on one device

bench:

    prefetch     timed units (sleeping compute, lessons/timed_work.py) and real GPT blocks, with and
                 without prefetch, steps taken in turns, best step of each; ours_s = with, torch_s =
                 without (the baseline). Target for timed units: not slower. Real blocks on CPU: no
                 target (compute and gloo's threads share the cores, so overlap gains little or loses)
    recompute    step time of selective and full recomputation over none (torch_s), one process, and
                 the FLOP ratio PyTorch's FlopCounterMode counts
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from shardlib.checks.harness import (DTYPE, ELEMENT_SIZE, STEPS, adamw, compare_run, cpu_state, launch_on,
                                     mean_losses, reference_run, train_steps, worst)
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.ddp import all_reduce_gradients
from shardlib.parallel.fsdp import _units, full_state_dict, fully_shard
from shardlib.parallel.pipeline import gpt_stage, pipeline_step
from shardlib.parallel.recompute import apply_recompute
from shardlib.parallel.schedules import schedule_interleaved_1f1b, stash_formula
from shardlib.parallel.split_backward import split_weight_gradients
from shardlib.reference import model_loss, rank_slice
from shardlib.timing import interleaved_times

CHECK_GPT = GPTConfig(seq_len=16, n_layer=4, n_head=4, n_embd=32)
PIPELINE_GPT = GPTConfig(seq_len=16, n_layer=8, n_head=4, n_embd=32)  # 2 chunks per rank: 2p <= 8 virtual stages
VIRTUAL_STAGES = 2


def build_check_gpt(config: GPTConfig = CHECK_GPT):
    return build_gpt(config, seed=0).to(DTYPE)


def world_size_error(technique: str, world_size: int) -> str | None:
    """Why the check cannot run on `world_size` ranks (None: it can)."""
    if technique.startswith("pp-") and VIRTUAL_STAGES * world_size > PIPELINE_GPT.n_layer:
        return (f"{technique} cuts the check's GPT ({PIPELINE_GPT.n_layer} blocks) into {VIRTUAL_STAGES} chunks per "
                f"rank: use at most {PIPELINE_GPT.n_layer // VIRTUAL_STAGES} ranks")
    if world_size < 2 and technique == "zero3-prefetch":
        return f"{technique} needs 2 or more ranks: with one there is nothing to gather"
    return None


def _refuse(technique: str, world_size: int) -> None:
    problem = world_size_error(technique, world_size)
    if problem:
        raise ValueError(problem)


# ---------------------------------------------------------------------------------
# zero3-prefetch


def _fsdp_on_rank(steps: int, batch_size: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for prefetch in (True, False):
        model = build_check_gpt().to(current_device())
        for block in model.blocks:
            fully_shard(block, prefetch=prefetch)
        fully_shard(model, prefetch=prefetch)
        gathers = []
        for _, unit in _units(model):
            unit.gather_log = gathers
        losses, ledgers = train_steps(adamw(model.parameters()), random_token_batches(CHECK_GPT, batch_size, steps),
                                      lambda batch: _backward(model, rank_slice(batch, rank, n)))
        out[prefetch] = dict(state=cpu_state(full_state_dict(model)), losses=losses,
                             prefetched=sum(g["prefetch"] for g in gathers),
                             ledgers=[sorted((r.kind, r.nbytes, r.sent_bytes) for r in ledger.records)
                                      for ledger in ledgers])
    return out


def _backward(model, batch):
    loss = model_loss(model, batch)
    loss.backward()
    return loss


def verify_prefetch(world_size: int, technique: str = "zero3-prefetch", steps: int = STEPS, device: str = "cpu") -> dict:
    _refuse(technique, world_size)
    batch_size = 12
    per_rank = launch_on(_fsdp_on_rank, world_size, args=(steps, batch_size), device=device, timeout=240)
    reference = reference_run(build_check_gpt, random_token_batches(CHECK_GPT, batch_size, steps), device=device)
    on = [r[True] for r in per_rank]
    result = worst([compare_run(r["state"], mean_losses([q["losses"] for q in on]), reference["state"],
                                reference["losses"]) for r in on])
    same_ledger = all(r[True]["ledgers"] == r[False]["ledgers"] for r in per_rank)
    prefetched = min(r["prefetched"] for r in on)
    expected = (steps - 1) * 2 * CHECK_GPT.n_layer  # from step 2, both ways: each of the n_layer + 1 units but the last
    result["passed"] = result["passed"] and same_ledger and prefetched == expected
    result["detail"] = (f"ledger with prefetch {'== without' if same_ledger else 'DIFFERS from without'}; "
                        f"{prefetched} all-gathers prefetched per rank (expected {expected})")
    return result


# ---------------------------------------------------------------------------------
# pp-interleaved, pp-zero-bubble


def _pipeline_on_rank(schedule: str, m: int, steps: int, batch_size: int) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    model = build_check_gpt(PIPELINE_GPT).to(current_device())
    if schedule == "interleaved":
        chunks = [gpt_stage(model, c * p + rank, VIRTUAL_STAGES * p) for c in range(VIRTUAL_STAGES)]
        run_schedule = functools.partial(schedule_interleaved_1f1b, virtual_stages=VIRTUAL_STAGES)
    else:
        chunks = [gpt_stage(model, rank, p)]
        split_weight_gradients(chunks[0])
        run_schedule = schedule
    params = [q for chunk in chunks for q in chunk.parameters()]
    peaks = []

    def forward_backward(batch):
        result = pipeline_step(chunks if len(chunks) > 1 else chunks[0], batch, m, run_schedule)
        peaks.append(result.peak_stashed)
        return result.loss

    losses, ledgers = train_steps(adamw(params), random_token_batches(PIPELINE_GPT, batch_size, steps), forward_backward)
    state = {name: t for chunk in chunks for name, t in cpu_state(chunk.state_dict()).items()}
    sends = [sorted(r.sent_bytes for r in ledger.records if r.kind == "send") for ledger in ledgers]
    return dict(state=state, losses=losses, peak=max(peaks), sends=sends)


def _expected_sends(schedule: str, rank: int, p: int, m: int, piece: int) -> list[int]:
    """Messages one rank sends per step: per chunk, m activations on (not from the last virtual stage)
    and m gradients back (not from virtual stage 0), each a (b/m, s, h) tensor of `piece` bytes."""
    v = VIRTUAL_STAGES if schedule == "interleaved" else 1
    stages = [c * p + rank for c in range(v)]
    count = sum(m * (k < v * p - 1) + m * (k > 0) for k in stages)
    return [piece] * count


def verify_pipeline_schedule(world_size: int, technique: str = "pp-interleaved", steps: int = STEPS,
                             device: str = "cpu") -> dict:
    _refuse(technique, world_size)
    schedule, p = technique.removeprefix("pp-"), world_size
    batch_size, comparisons, problems = 4 * p, [], []
    batches = random_token_batches(PIPELINE_GPT, batch_size, steps)
    for m in (p, 2 * p):
        per_rank = launch_on(_pipeline_on_rank, p, args=(schedule, m, steps, batch_size), device=device, timeout=240)
        reference = reference_run(lambda: build_check_gpt(PIPELINE_GPT), batches, micro_batches=m, device=device)
        state = {name: t for r in per_rank for name, t in r["state"].items()}
        comparisons.append(compare_run(state, per_rank[-1]["losses"], reference["state"], reference["losses"]))
        piece = batch_size // m * PIPELINE_GPT.seq_len * PIPELINE_GPT.n_embd * ELEMENT_SIZE
        for rank, r in enumerate(per_rank):
            expected = _expected_sends(schedule, rank, p, m, piece)
            problems += [f"m={m} rank {rank}: {len(sent)} messages, expected {len(expected)} of {piece} B"
                         for sent in r["sends"] if sent != expected]
        peaks = [r["peak"] for r in per_rank]
        want = [stash_formula(p, m, s, schedule, virtual_stages=VIRTUAL_STAGES) for s in range(p)]
        if peaks != want:
            problems.append(f"m={m}: peak stash {peaks}, formula {want}")
    result = worst(comparisons)
    result["passed"] = result["passed"] and not problems
    result["detail"] = (f"m in {[p, 2 * p]}, b={batch_size}" + (f", v={VIRTUAL_STAGES}" if schedule == "interleaved"
                                                                 else ", B/W split")
                        + "; messages and peak stash " + ("= formulas" if not problems else "DIFFER: " + "; ".join(problems[:3])))
    return result


# ---------------------------------------------------------------------------------
# recompute-selective, recompute-full


def _recompute_on_rank(mode: str, steps: int, batch_size: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = apply_recompute(build_check_gpt().to(current_device()), mode)

    def forward_backward(batch):
        loss = _backward(model, rank_slice(batch, rank, n))
        all_reduce_gradients(model)
        return loss

    losses, _ = train_steps(adamw(model.parameters()), random_token_batches(CHECK_GPT, batch_size, steps),
                            forward_backward)
    return dict(state=cpu_state(model.state_dict()), losses=losses)


def verify_recompute(world_size: int, technique: str = "recompute-full", steps: int = STEPS, device: str = "cpu") -> dict:
    mode = technique.removeprefix("recompute-")
    batch_size = 12
    per_rank = launch_on(_recompute_on_rank, world_size, args=(mode, steps, batch_size), device=device, timeout=240)
    reference = reference_run(build_check_gpt, random_token_batches(CHECK_GPT, batch_size, steps), device=device)
    losses = mean_losses([r["losses"] for r in per_rank])
    result = worst([compare_run(r["state"], losses, reference["state"], reference["losses"]) for r in per_rank])
    result["detail"] = f"{mode} recomputation, data parallel over {world_size}, vs the plain GPT on one device"
    return result


# ---------------------------------------------------------------------------------
# bench


def _prefetch_steps(kind: str, repeats: int) -> dict:
    from shardlib.lessons.timed_work import TimedUnits

    x_or_batch = None
    runs = {}
    for prefetch in (True, False):
        torch.manual_seed(0)
        if kind == "timed":
            model = TimedUnits(n_units=4, width=1024, t_forward=0.01, t_backward=0.02)  # lesson 13's
            units = list(model.units)
            x_or_batch = torch.randn(8, 1024)
        else:
            model = build_gpt(GPTConfig(seq_len=64, n_layer=4, n_head=4, n_embd=256), seed=0)
            units = list(model.blocks)
            x_or_batch = random_token_batches(model.config, 4, 1)[0]
        for unit in units:
            fully_shard(unit, prefetch=prefetch)
        fully_shard(model, prefetch=prefetch)
        runs[prefetch] = model

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(x_or_batch).square().mean() if kind == "timed" else model_loss(model, x_or_batch)
        loss.backward()

    return interleaved_times({p: functools.partial(step, m) for p, m in runs.items()}, repeats, warmup=2,
                             statistic=min, sync=dist.barrier)  # best step: the least disturbed by other programs


def bench_prefetch(quick: bool = False) -> list[dict]:
    """ZeRO-3 forward + backward with prefetch over without, 2 ranks: timed units, then real GPT blocks."""
    rows = []
    for kind in ("timed", "gpt"):
        per_rank = launch(_prefetch_steps, 2, args=(kind, 3 if quick else 9), timeout=600)
        on, off = (max(r[p] for r in per_rank) for p in (True, False))
        rows.append({"benchmark": "prefetch", "case": f"ZeRO-3 prefetch on / off, {kind} units, N=2 (torch_s: off)",
                     "ours_s": on, "torch_s": off, "ratio": on / off, "target": 1.0 if kind == "timed" else None})
    return rows


def _recompute_times(repeats: int) -> dict:
    config = GPTConfig(seq_len=128, n_layer=4, n_head=4, n_embd=128)
    batch = random_token_batches(config, 8, 1)[0]
    models = {mode: apply_recompute(build_gpt(config, seed=0), mode) for mode in (None, "selective", "full")}

    def step(model):
        model.zero_grad(set_to_none=True)
        model_loss(model, batch).backward()

    flops = {}
    for mode, model in models.items():
        with FlopCounterMode(display=False) as counter:
            step(model)
        flops[mode] = counter.get_total_flops()
    times = interleaved_times({mode: functools.partial(step, m) for mode, m in models.items()}, repeats, warmup=1)
    return {mode: (times[mode], flops[mode]) for mode in models}


def bench_recompute(quick: bool = False) -> list[dict]:
    """Step time with selective and full recomputation over none: GPT, one process, one thread."""
    measured = launch(_recompute_times, 1, args=(3 if quick else 9,), timeout=600)[0]
    base_s, base_flops = measured[None]
    return [{"benchmark": "recompute", "case": f"{mode} recomputation over none, GPT (torch_s: none)",
             "ours_s": measured[mode][0], "torch_s": base_s, "ratio": measured[mode][0] / base_s, "target": None,
             "flops_ratio": round(measured[mode][1] / base_flops, 3)} for mode in ("selective", "full")]


CHECKS = {"zero3-prefetch": (verify_prefetch, (2, 4)),
          "pp-interleaved": (verify_pipeline_schedule, (2, 4)),
          "pp-zero-bubble": (verify_pipeline_schedule, (2, 4)),
          "recompute-selective": (verify_recompute, (2, 4)),
          "recompute-full": (verify_recompute, (2, 4))}
BENCHMARKS = {"prefetch": bench_prefetch, "recompute": bench_recompute}
