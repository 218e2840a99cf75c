"""Interleaved 1F1B and the zero-bubble schedule (ZB-H1): the orders are well formed, their ideal timelines
give the papers' bubbles (written out here: (p-1)/(v m + p - 1), Narayanan et al. arXiv 2104.04473; a
step of m(t_f + t_b + t_w) + (p-1)(t_f + t_b - t_w), Qi et al. arXiv 2401.10241), messages match their
receives, the split backward gives the gradients of an ordinary backward, and on ranks both schedules
equal one device (the verify checks)."""

from __future__ import annotations

import functools

import pytest
import torch

from shardlib import launch
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.pipeline import gpt_stage, pipeline_step
from shardlib.parallel.schedules import (check_actions, measured_bubble, message_order_problems, peak_in_flight,
                                         schedule_1f1b, schedule_interleaved_1f1b, schedule_zero_bubble, simulate,
                                         unpack)
from shardlib.parallel.split_backward import pending_bytes, split_weight_gradients
from shardlib.reference import model_loss

CONFIG = GPTConfig(seq_len=16, n_layer=4, n_head=4, n_embd=32)


def interleaved(v):
    return functools.partial(schedule_interleaved_1f1b, virtual_stages=v)


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_orders_are_well_formed(v):
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p):
            for s in range(p):
                actions = [unpack(a) for a in interleaved(v)(p, m, s)]
                check_actions(actions, m, s)
                assert len(actions) == 2 * m * v, f"p={p} m={m} s={s}: {len(actions)} actions"
                assert {c for _, _, c in actions} == set(range(v))


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_is_divided_by_v(v):
    for p in (2, 3, 4):
        for m in (p, 2 * p, 4 * p):
            idle = measured_bubble(simulate(interleaved(v), p, m, t_forward=1.0, t_backward=2.0))
            want = (p - 1) / (v * m + p - 1)
            assert all(abs(f - want) < 1e-9 for f in idle.values()), f"p={p} v={v} m={m}: {idle} vs {want}"


def test_interleaved_holds_more_activations_than_1f1b():
    p, m, v = 4, 8, 2
    for s in range(p):
        chunks = peak_in_flight(interleaved(v)(p, m, s))  # chunk-micro-batches, each 1/v of the stage
        assert chunks == min(2 * (p - s - 1) + (v - 1) * p + 1, v * m), f"stage {s}: {chunks}"
    assert peak_in_flight(interleaved(v)(p, m, 0)) / v > peak_in_flight(schedule_1f1b(p, m, 0))


def test_interleaved_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="multiple of 4"):
        schedule_interleaved_1f1b(4, 6, 0)
    with pytest.raises(ValueError, match="use '1f1b'"):
        schedule_interleaved_1f1b(4, 8, 0, virtual_stages=1)


def test_zero_bubble_orders_are_well_formed_and_hold_p_microbatches():
    for p in (2, 3, 4):
        for m in (1, p, 2 * p, 3 * p + 1):
            for s in range(p):
                actions = schedule_zero_bubble(p, m, s)
                check_actions(actions, m, s)
                assert peak_in_flight(actions) == min(p, m), f"p={p} m={m} s={s}"


@pytest.mark.parametrize("times", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5)])
def test_zero_bubble_step_time(times):
    t_f, t_b, t_w = times  # B takes t_b, W takes t_w; a whole backward t_b + t_w
    for p in (2, 3, 4):
        for m in (p, 3 * p):
            events = simulate(schedule_zero_bubble, p, m, t_forward=t_f, t_backward=t_b + t_w, t_weight=t_w)
            step = max(e.end for e in events) - min(e.start for e in events)
            want = m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w)
            assert step == pytest.approx(want), f"p={p} m={m} times={times}: {step} vs {want}"


def test_zero_bubble_idles_a_third_of_1f1b_at_equal_times():
    p, m = 4, 8
    zb = simulate(schedule_zero_bubble, p, m, t_forward=1.0, t_backward=2.0, t_weight=1.0)
    one_f_one_b = simulate(schedule_1f1b, p, m, t_forward=1.0, t_backward=2.0)
    idle_time = lambda events: max(e.end for e in events) - 3 * m  # noqa: E731 - each stage works 3m
    assert idle_time(zb) == pytest.approx(idle_time(one_f_one_b) / 3)


def test_messages_match_their_receives():
    for p in (2, 3, 4):
        for m in (p, 2 * p):
            for schedule in ("gpipe", "1f1b", "zero-bubble", interleaved(2), interleaved(3)):
                assert message_order_problems(schedule, p, m) == [], f"{schedule} p={p} m={m}"

    def shallow_warmup(p, m, s, v=2):  # a warm-up of (p-s-1) + (v-1)p: as fast, but at p = 2 messages cross
        total, actions = m * v, []
        order = [(i, c) for g in range(m // p) for c in range(v) for i in range(g * p, g * p + p)]
        warm = min(p - s - 1 + (v - 1) * p, total)
        actions += [("F", *order[k]) for k in range(warm)]
        for k in range(total - warm):
            actions += [("F", *order[warm + k]), ("B", order[k][0], v - 1 - order[k][1])]
        return actions + [("B", order[k][0], v - 1 - order[k][1]) for k in range(total - warm, total)]

    assert message_order_problems(shallow_warmup, 2, 4), "rank 0 -> 1 carries activations and gradients out of order"


def test_split_backward_gives_the_ordinary_gradients():
    batch = random_token_batches(CONFIG, 3, 1)[0]
    plain = build_gpt(CONFIG, seed=0)
    model_loss(plain, batch).backward()
    split = build_gpt(CONFIG, seed=0)
    store = split_weight_gradients(split)
    store.defer = True
    model_loss(split, batch).backward()
    work = store.take()
    assert split.lm_head.weight.grad is None and split.blocks[0].ln_1.weight.grad is not None, \
        "after B the linear layers' weight gradients wait for W, the LayerNorms' are done"
    linears = [m for m in split.modules() if isinstance(m, torch.nn.Linear)]
    assert len(work) == len(linears), f"{len(work)} deferred pieces for {len(linears)} linear layers"
    for weight_gradient, _ in work:
        weight_gradient()
    for (name, a), b in zip(split.named_parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-8), f"{name}: split gradient differs"
    assert pending_bytes(work) > 0


def _pipeline_errors(case: str):
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    model = build_gpt(GPTConfig(seq_len=16, n_layer=4, n_head=4, n_embd=32), seed=0)
    batch = random_token_batches(model.config, 4, 1)[0]
    try:
        if case == "unsplit":
            pipeline_step(gpt_stage(model, rank, p), batch, 2, "zero-bubble")
        else:  # one stage given to an interleaved schedule
            pipeline_step(gpt_stage(model, rank, p), batch, 2, "interleaved")
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_pipeline_step_refuses_clearly():
    assert all("split_weight_gradients" in e for e in launch(_pipeline_errors, 2, args=("unsplit",))), \
        "a zero-bubble step on a stage without a split backward must say what to call"
    assert all("chunk" in e for e in launch(_pipeline_errors, 2, args=("chunks",))), \
        "an interleaved step on one stage per rank must say it needs chunks"


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["pp-interleaved", "pp-zero-bubble"])
def test_verify_on_two_ranks(technique):
    from shardlib.checks.time import verify_pipeline_schedule

    record = verify_pipeline_schedule(2, technique=technique)
    assert record["passed"], record["detail"]
