"""ZeRO-3 prefetch (shardlib.parallel.fsdp, prefetch=True): the same parameters and the same ledger as
without prefetch, all-gathers started one unit early in forward and backward order (from the second
step), at most the root and two blocks gathered at once, and a prefetch never left writing into freed
memory. Against the run without prefetch, and against one device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardlib import launch
from shardlib.comm import comm_ledger
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.fsdp import _units, full_state_dict, fully_shard
from shardlib.reference import model_loss, rank_slice

CONFIG = GPTConfig(seq_len=16, n_layer=3, n_head=4, n_embd=32)
STEPS = 3


def _train(prefetch: bool) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_gpt(CONFIG, seed=0)
    for block in model.blocks:
        fully_shard(block, prefetch=prefetch)
    fully_shard(model, prefetch=prefetch)
    units = [unit for _, unit in _units(model)]
    log, most_gathered = [], [0]
    for unit in units:
        unit.gather_log = log

    def count(module, args):
        most_gathered[0] = max(most_gathered[0], sum(u.gathered or u.pending is not None for u in units))

    for block in model.blocks:
        block.register_forward_pre_hook(count)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ledgers, orders = [], []
    for batch in random_token_batches(CONFIG, 4, STEPS):
        log.clear()
        optimizer.zero_grad()
        with comm_ledger() as ledger:
            model_loss(model, rank_slice(batch, rank, n)).backward()
        optimizer.step()
        ledgers.append(sorted((r.kind, r.nbytes, r.sent_bytes) for r in ledger.records))
        orders.append([(g["unit"], g["prefetch"]) for g in log])
    with torch.no_grad():  # evaluation with prefetch: gathers, frees, no backward
        model_loss(model, random_token_batches(CONFIG, 4, 1)[0])
    return dict(state=full_state_dict(model), ledgers=ledgers, orders=orders, most_gathered=most_gathered[0])


def _both():
    return {prefetch: _train(prefetch) for prefetch in (False, True)}


@pytest.fixture(scope="module")
def runs():
    return launch(_both, 2)


@pytest.mark.slow
def test_prefetch_changes_neither_the_result_nor_the_bytes(runs):
    for rank, r in enumerate(runs):
        for name, tensor in r[False]["state"].items():
            assert torch.equal(tensor, r[True]["state"][name]), f"rank {rank}: {name} differs with prefetch"
        assert r[True]["ledgers"] == r[False]["ledgers"], f"rank {rank}: prefetch changed the calls or bytes"


@pytest.mark.slow
def test_gathers_start_one_unit_early_from_the_second_step(runs):
    blocks = [f"blocks.{k}" for k in range(CONFIG.n_layer)]
    forward = ["root"] + blocks  # the root's pre-forward runs first, then the blocks in order
    backward = ["root"] + blocks[::-1]  # backward reaches the root's outputs (the logits) first
    for r in runs:
        assert not any(prefetched for _, prefetched in r[False]["orders"][1]), "prefetch=False prefetched"
        assert not any(prefetched for _, prefetched in r[True]["orders"][0]), "step 1 has no order to follow yet"
        assert [u for u, _ in r[True]["orders"][1]] == forward + backward, r[True]["orders"][1]
        prefetched = [u for u, p in r[True]["orders"][1] if p]
        assert prefetched == forward[1:] + backward[1:], f"prefetched {prefetched}: every unit but the first, both ways"


@pytest.mark.slow
def test_at_most_two_blocks_and_the_root_are_gathered(runs):
    for r in runs:
        assert r[False]["most_gathered"] <= 2, f"without prefetch: {r[False]['most_gathered']} units whole at once"
        assert r[True]["most_gathered"] <= 3, f"with prefetch: {r[True]['most_gathered']} units whole at once"


def _reshard_after_prefetch():
    model = build_gpt(CONFIG, seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    unit = model.blocks[1]._fsdp_unit
    unit.unshard(async_op=True)  # a prefetch, still in flight
    unit.reshard()  # must wait for it before freeing the storage
    return unit.pending is None and unit.flat.untyped_storage().nbytes() == 0


@pytest.mark.slow
def test_resharding_waits_for_a_prefetch_in_flight():
    assert all(launch(_reshard_after_prefetch, 2)), "reshard() freed a buffer a prefetch was writing into"


@pytest.mark.slow
def test_verify_prefetch_on_two_ranks():
    from shardlib.checks.time import verify_prefetch

    record = verify_prefetch(2)
    assert record["passed"], record["detail"]
