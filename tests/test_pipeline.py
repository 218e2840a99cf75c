"""shardlib.parallel.pipeline: schedules hold their defining properties, runs equal the single-device
reference and PyTorch's own pipeline, the ledger counts b*s*h per micro-batch per boundary,
stashes hold what the formulas say, and bad input fails clearly.

References are independent of the code under test: the formulas (p-1)/(m+p-1), m, min(p-s, m)
written out here; byte counts worked out from the model's shapes; one device training on the
same batches (shardlib.reference); torch.distributed.pipelining.Schedule1F1B.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlib import RankError, launch
from shardlib.comm import comm_ledger
from shardlib.models import GPTConfig, build_gpt
from shardlib.parallel.pipeline import balanced_split, check_microbatches, gpt_stage, pipeline_step
from shardlib.checks.harness import TOLERANCE
from shardlib.checks.pipeline import verify_pipeline
from shardlib.parallel.schedules import (check_actions, measured_bubble, peak_in_flight, schedule_1f1b,
                                         schedule_gpipe, schedule_naive, simulate)

SCHEDULES = {"naive": schedule_naive, "gpipe": schedule_gpipe, "1f1b": schedule_1f1b}
CONFIG = GPTConfig(seq_len=16, n_layer=4, n_head=4, n_embd=32)


# ---------------------------------------------------------------------------------
# schedule orders (no processes)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_order_runs_each_microbatch_forward_then_backward(name):
    for p in range(1, 6):
        for m in range(1, 10):
            for s in range(p):
                actions = SCHEDULES[name](p, m, s)
                assert [i for op, i in actions if op == "F"] == list(range(m))
                assert [i for op, i in actions if op == "B"] == list(range(m))
                assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))


def test_most_microbatches_in_flight_per_stage():
    for p in range(1, 6):
        for m in range(1, 10):
            for s in range(p):
                assert peak_in_flight(schedule_naive(p, m, s)) == 1
                assert peak_in_flight(schedule_gpipe(p, m, s)) == m
                assert peak_in_flight(schedule_1f1b(p, m, s)) == min(p - s, m)


def test_1f1b_alternates_after_warmup():
    p, m = 4, 8
    for s in range(p):
        ops = "".join(op for op, _ in schedule_1f1b(p, m, s))
        warmup = p - s - 1
        assert ops == "F" * warmup + "FB" * (m - warmup) + "B" * warmup


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_ideal_devices_idle_the_formula(name):
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 4, 7, 16):
            timeline = simulate(name, p, m, t_forward=1.0, t_backward=2.0)
            assert max(e.end for e in timeline) == pytest.approx(3.0 * (m + p - 1))
            for fraction in measured_bubble(timeline).values():
                assert fraction == pytest.approx((p - 1) / (m + p - 1))


def test_naive_idles_all_but_one_stage():
    timeline = simulate("naive", 4, 5)
    assert all(f == pytest.approx(3 / 4) for f in measured_bubble(timeline).values())


def test_a_deadlocking_order_is_caught_before_running():
    def no_warmup_on_stage_0(p, m, s):
        return schedule_naive(p, m, s) if s == 0 else schedule_1f1b(p, m, s)

    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(no_warmup_on_stage_0, 3, 4)


def test_bad_orders_are_refused():
    with pytest.raises(ValueError, match="before their forward"):
        check_actions([("B", 0), ("F", 0)], 1)
    with pytest.raises(ValueError, match="once on each"):
        check_actions([("F", 1), ("F", 0), ("B", 0), ("B", 1)], 2)
    with pytest.raises(ValueError, match="unknown"):
        check_actions([("X", 0)], 1)


def test_balanced_split_by_size():
    assert balanced_split([1] * 8, 4) == [2, 2, 2, 2]
    assert balanced_split([1] * 8, 3) in ([3, 3, 2], [3, 2, 3], [2, 3, 3])
    assert balanced_split([1] * 6, 2, first_extra=2) == [2, 4]  # 2+2 vs 4
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]


# ---------------------------------------------------------------------------------
# errors


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="at most 4 stages"):
        gpt_stage(build_gpt(CONFIG), 0, 5)
    with pytest.raises(ValueError, match="add up to n_layer=4"):
        gpt_stage(build_gpt(CONFIG), 0, 2, layers_per_stage=[1, 2])


def test_batch_not_divisible_into_microbatches():
    expected = r"cannot be cut into 4 equal micro-batches: use n_microbatches in \[1, 2, 3, 6\]"
    with pytest.raises(ValueError, match=expected):
        check_microbatches(6, 4)


def _stage_1_raises():
    rank = dist.get_rank()
    stage = gpt_stage(build_gpt(CONFIG), rank, 2)
    if rank == 1:
        stage.blocks["3"].register_forward_hook(lambda *_: (_ for _ in ()).throw(FloatingPointError("NaN in block 3")))
    x = torch.zeros(4, CONFIG.seq_len, dtype=torch.long)
    pipeline_step(stage, (x, x), 2, "1f1b")


def _batch_of_6_in_4():
    stage = gpt_stage(build_gpt(CONFIG), dist.get_rank(), 2)
    x = torch.zeros(6, CONFIG.seq_len, dtype=torch.long)
    pipeline_step(stage, (x, x), 4, "gpipe")


def test_indivisible_batch_fails_on_the_ranks_with_the_reason():
    with pytest.raises(RankError, match="cannot be cut into 4 equal micro-batches"):
        launch(_batch_of_6_in_4, 2, timeout=60)


def test_a_stage_that_raises_is_named():
    with pytest.raises(RankError) as error:
        launch(_stage_1_raises, 2, timeout=60)
    assert error.value.rank == 1 and "NaN in block 3" in str(error.value)


# ---------------------------------------------------------------------------------
# runs on ranks


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 4])
def test_equals_single_device(schedule, p):
    """5 AdamW steps, m in {1, p, 4p}: parameters, losses, first gradients, ledger, peak stash."""
    result = verify_pipeline(p, f"pp-{schedule}")
    assert result["passed"], result
    assert result["max_rel_diff"] <= TOLERANCE


def _sends_and_stash(schedule: str, m: int, batch_size: int):
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = gpt_stage(build_gpt(CONFIG), rank, p)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch_size, CONFIG.seq_len + 1), generator=g)
    with comm_ledger() as ledger:
        result = pipeline_step(stage, (tokens[:, :-1], tokens[:, 1:]), m, schedule)
    sends = [(r.peers[0], r.sent_bytes) for r in ledger.records if r.kind == "send"]
    return sends, result.peak_stashed, result.peak_stashed_bytes, result.timeline


def test_ledger_stash_and_timeline_on_4_stages():
    p, m, b = 4, 8, 16
    piece = (b // m) * CONFIG.seq_len * CONFIG.n_embd * 4  # one (b/m, s, h) fp32 activation or gradient
    gpipe = launch(_sends_and_stash, p, args=("gpipe", m, b), timeout=120)
    one_f_one_b = launch(_sends_and_stash, p, args=("1f1b", m, b), timeout=120)
    for rank in range(p):
        for sends, *_ in (gpipe[rank], one_f_one_b[rank]):
            neighbours = [rank + 1] * m * (rank < p - 1) + [rank - 1] * m * (rank > 0)
            assert sorted(peer for peer, _ in sends) == sorted(neighbours)
            assert all(nbytes == piece for _, nbytes in sends)
    assert [r[1] for r in gpipe] == [8, 8, 8, 8]
    assert [r[1] for r in one_f_one_b] == [4, 3, 2, 1]
    # bytes held for backward: the peak is (micro-batches stashed) x (bytes per micro-batch)
    for rank in range(p):
        per_microbatch = gpipe[rank][2] / 8
        assert one_f_one_b[rank][2] == pytest.approx((4 - rank) * per_microbatch, rel=0.02)
    # timelines: 2m actions per rank, none overlapping, forwards causal along the pipeline
    events = {(e.rank, e.op, e.microbatch): e for r in one_f_one_b for e in r[3]}
    assert len(events) == 2 * m * p
    for rank in range(p):
        mine = sorted((e for e in events.values() if e.rank == rank), key=lambda e: e.start)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
    for rank in range(p - 1):
        for i in range(m):
            assert events[(rank, "F", i)].end <= events[(rank + 1, "F", i)].start
            assert events[(rank + 1, "B", i)].end <= events[(rank, "B", i)].start


def _ours_and_torch(m: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    ours, theirs = gpt_stage(build_gpt(CONFIG), rank, p), gpt_stage(build_gpt(CONFIG), rank, p)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4 * m, CONFIG.seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    result = pipeline_step(ours, (x, y), m, "1f1b")
    losses = []
    schedule = Schedule1F1B(PipelineStage(theirs, rank, p, torch.device("cpu")), m, loss_fn=theirs.loss)
    schedule.step(*([x] if rank == 0 else []), **({"target": y, "losses": losses} if rank == p - 1 else {}))
    grads = {name: (a.grad, b.grad) for (name, a), b in zip(ours.named_parameters(), theirs.parameters())}
    return grads, result.loss, [loss.item() for loss in losses]


def test_1f1b_equals_torch_pipelining():
    """torch.distributed.pipelining's Schedule1F1B (gloo) on the same stages: same gradients, same loss."""
    m = 4
    for rank, (grads, loss, losses) in enumerate(launch(_ours_and_torch, 2, args=(m,), timeout=120)):
        for name, (ours, theirs) in grads.items():
            rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
            assert rel <= 1e-6, f"{name}: gradients {rel:.1e} apart, more than 1e-6 relative"
        if rank == 1:
            assert loss == pytest.approx(sum(losses) / m, rel=1e-6)


def _tied_gradients(sync: bool):
    from shardlib.parallel.tied_embeddings import embedding_group, sync_tied_embeddings

    rank, p = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32, tie_embeddings=True)
    stage = gpt_stage(build_gpt(config).double(), rank, p)
    group = embedding_group([list(range(p))], rank)
    tokens = torch.randint(0, 256, (4, config.seq_len + 1), generator=torch.Generator().manual_seed(2))
    pipeline_step(stage, (tokens[:, :-1], tokens[:, 1:]), 2, "1f1b")
    if sync:
        sync_tied_embeddings(stage, group=group)
    return stage.tied_embedding().grad


def test_tied_embeddings_on_two_stages_get_the_shared_gradient():
    # one device: the (V, h) matrix is one Parameter, its gradient the embedding's plus the output layer's
    config = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32, tie_embeddings=True)
    model = build_gpt(config).double()
    assert model.lm_head.weight is model.tok_emb.weight
    tokens = torch.randint(0, 256, (4, config.seq_len + 1), generator=torch.Generator().manual_seed(2))
    loss = sum(model(x, y)[1] for x, y in zip(tokens[:, :-1].chunk(2), tokens[:, 1:].chunk(2))) / 2
    loss.backward()
    first, last = launch(_tied_gradients, 2, args=(True,), timeout=120)
    torch.testing.assert_close(first, model.tok_emb.weight.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(last, model.tok_emb.weight.grad, rtol=1e-9, atol=1e-12)
    unsynced = launch(_tied_gradients, 2, args=(False,), timeout=120)  # each end alone has only its part
    assert all((g - model.tok_emb.weight.grad).abs().max() > 1e-6 for g in unsynced), "without the sum"
