"""Data parallelism (naive and DDP-style) against one device, the ring formula, and bad input.

Every multi-rank run is compared with a single-process reference trained on the concatenated
batch (shardlib.reference), in float64 with the checks' AdamW (shardlib/checks/harness.py says why),
and every ledger count with 2(N-1)/N * Psi.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib import RankError, launch
from shardlib.comm import comm_ledger, ring_sent_bytes
from shardlib.parallel.ddp import DistributedDataParallel, all_reduce_gradients, assign_buckets
from shardlib.checks.ddp import verify_data_parallel
from shardlib.checks.harness import DTYPE, TOLERANCE, adamw, reference_run
from shardlib.models import GPTConfig, build_gpt, build_mlp, mlp_batch, random_token_batches
from shardlib.reference import compare_state, model_loss, rank_slice, train_reference

SMALL_GPT = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)


def build_small_gpt(seed: int = 0) -> nn.Module:
    return build_gpt(SMALL_GPT, seed=seed).to(DTYPE)


def build_mlp64(seed: int = 0) -> nn.Module:
    return build_mlp(seed).to(DTYPE)


def mlp_batch64(batch_size: int, seed: int) -> tuple:
    x, y = mlp_batch(batch_size, seed=seed)
    return x.to(DTYPE), y.to(DTYPE)


def gpt_batches(steps: int, batch_size: int) -> list:
    return random_token_batches(SMALL_GPT, batch_size, steps)


# ---------------------------------------------------------------------------------
# equivalence with one device, and bytes against the formula


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("technique", ["dp", "ddp"])
def test_matches_single_device_and_ring_formula(technique, world_size):
    """MLP and GPT, 5 AdamW steps: parameters and losses within 1e-5 relative; every rank sends
    2(N-1)/N * Psi * 8 bytes per step (float64) and all-reduces each gradient once (verify_data_parallel)."""
    result = verify_data_parallel(world_size, technique=technique)
    assert result["passed"], result
    assert result["max_rel_diff"] <= TOLERANCE


def _train_ring(steps: int, bucket_cap_mb: float):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_mlp64(0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, ring=True)
    optimizer = adamw(model.parameters())
    sent, expected = [], []
    for step in range(steps):
        optimizer.zero_grad()
        with comm_ledger() as ledger:
            model_loss(ddp, rank_slice(mlp_batch64(12, seed=step), rank, n)).backward()
        optimizer.step()
        sent.append(ledger.sent_bytes("send"))
        expected.append(sum(ring_sent_bytes("all_reduce", b.buffer.numel(), n, element_size=8) for b in ddp.buckets))
    return model.state_dict(), sent, expected, [b.buffer.numel() for b in ddp.buckets]


def test_ring_all_reduce_buckets_send_the_ring_bytes_exactly():
    """With shardlib's ring all-reduce the ledger sees every send: exactly 2(N-1) chunks of
    ceil(numel/N) per bucket; N=3 does not divide the buckets, so padding is counted too."""
    n, steps = 3, 3
    results = launch(_train_ring, n, args=(steps, 0.02))
    reference, _ = train_reference(build_mlp64, [mlp_batch64(12, seed=s) for s in range(steps)], adamw)
    numels = results[0][3]
    assert sum(numels) == 8648 and len(numels) > 1  # Psi of build_mlp(): 2*(2*32*64+64+32) + 32*8+8
    padded = sum(2 * (n - 1) * math.ceil(k / n) * 8 for k in numels)  # float64
    for state, sent, expected, _ in results:
        assert sent == expected == [padded] * steps
        assert compare_state(state, reference.state_dict())[1] <= TOLERANCE


# ---------------------------------------------------------------------------------
# buckets


def test_bucket_assignment_walks_parameters_in_reverse_and_closes_at_the_cap():
    fp32 = [torch.empty(k) for k in (10, 20, 30, 40)]  # 40, 80, 120, 160 bytes
    assert assign_buckets(fp32, 100) == [[3], [2], [1, 0]]
    assert assign_buckets(fp32, 10**9) == [[3, 2, 1, 0]]
    assert assign_buckets(fp32, 1) == [[3], [2], [1], [0]]
    mixed = [torch.empty(10), torch.empty(10, dtype=torch.float64), torch.empty(10), torch.empty(10, dtype=torch.float64)]
    assert assign_buckets(mixed, 80) == [[3], [1], [2, 0]]  # one open bucket per dtype
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(fp32, 0)


def test_gpt_buckets_hold_every_trainable_parameter_once():
    model = build_gpt(SMALL_GPT)
    params = list(model.parameters())
    cap = 20_000
    buckets = assign_buckets(params, cap)
    assert sorted(i for b in buckets for i in b) == list(range(len(params)))
    assert buckets[0][0] == len(params) - 1  # the last registered (lm_head) goes first
    for bucket in buckets:
        sizes = [params[i].numel() * 4 for i in bucket]
        assert bucket == sorted(bucket, reverse=True)
        assert sum(sizes[:-1]) < cap  # closed as soon as it reached the cap...
    assert all(sum(params[i].numel() * 4 for i in b) >= cap for b in buckets[:-1])  # ...and not before


def _timeline(bucket_cap_mb: float):
    model = build_gpt(SMALL_GPT)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, record_timeline=True)
    x, y = rank_slice(gpt_batches(1, 4)[0], dist.get_rank(), dist.get_world_size())
    model_loss(ddp, (x, y)).backward()
    return ddp.timeline, len(ddp.buckets)


def test_all_reduces_start_while_backward_is_still_running():
    """Overlap: bucket 0 (the last layers) starts before the first layers' gradients exist."""
    timeline, n_buckets = launch(_timeline, 2, args=(0.02,))[0]
    assert n_buckets >= 3
    events = [event for _, event, _ in sorted(timeline)]
    last_ready = max(t for t, event, _ in timeline if event == "grad_ready")
    first_start = min(t for t, event, _ in timeline if event == "start")
    assert first_start < last_ready
    starts = [b for _, event, b in sorted(timeline) if event == "start"]
    assert starts == list(range(n_buckets))  # in index order
    assert sorted(b for _, event, b in timeline if event == "done") == list(range(n_buckets))
    assert events.count("grad_ready") == len(list(build_gpt(SMALL_GPT).parameters()))


# ---------------------------------------------------------------------------------
# gradient accumulation


def _accumulate(steps: int, micro_batches: int):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_small_gpt()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    optimizer = adamw(model.parameters())
    calls_in_no_sync = []
    for batch in gpt_batches(steps, 8):
        x, y = rank_slice(batch, rank, n)  # (8/N, T)
        optimizer.zero_grad()
        for k, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = k == micro_batches - 1
            with comm_ledger() as ledger:
                if last:
                    (model_loss(ddp, (xm, ym)) / micro_batches).backward()
                else:
                    with ddp.no_sync():
                        (model_loss(ddp, (xm, ym)) / micro_batches).backward()
            if not last:
                calls_in_no_sync.append(ledger.calls())
        optimizer.step()
    return model.state_dict(), calls_in_no_sync


def test_no_sync_accumulation_equals_the_larger_batch():
    steps = 3
    results = launch(_accumulate, 2, args=(steps, 2))
    reference = reference_run(build_small_gpt, gpt_batches(steps, 8))["state"]  # one device, the whole batch
    for state, calls in results:
        assert calls == [0] * steps  # nothing sent while accumulating
        assert compare_state(state, reference)[1] <= TOLERANCE


# ---------------------------------------------------------------------------------
# inputs that need care: tied, frozen, mixed dtypes


class TiedLM(nn.Module):
    """Embedding and output head share one weight; a frozen scale; an fp64 layer (the rest fp32)."""

    def __init__(self, vocab: int = 50, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d).double()
        self.scale = nn.Parameter(torch.full((d,), 0.5), requires_grad=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):  # (B, T) -> (B, T, V)
        h = self.emb(idx)
        h = h + self.mix(h.double()).float() * self.scale
        return self.head(h)


def tied_loss(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def tied_batches(steps):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 50, (12, 6), generator=g), torch.randint(0, 50, (12, 6), generator=g)) for _ in range(steps)]


def build_tied(seed=0):
    torch.manual_seed(seed)
    return TiedLM()


def _train_tied(steps):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_tied(seed=rank)  # replicas start apart: the broadcast makes them equal
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    optimizer = adamw(p for p in model.parameters() if p.requires_grad)
    reduced, dtypes = [], [{p.dtype for p in b.params} for b in ddp.buckets]
    for batch in tied_batches(steps):
        optimizer.zero_grad()
        with comm_ledger() as ledger:
            tied_loss(ddp, rank_slice(batch, rank, n)).backward()
        optimizer.step()
        reduced.append(ledger.bytes("all_reduce"))
    bucketed = sum(len(b.params) for b in ddp.buckets)
    return model.state_dict(), reduced, dtypes, bucketed


def test_tied_frozen_and_mixed_dtype_parameters():
    steps = 3
    results = launch(_train_tied, 3, args=(steps,))
    reference, _ = train_reference(build_tied, tied_batches(steps),
                                   lambda ps: adamw(p for p in ps if p.requires_grad), loss_fn=tied_loss)
    # trainable and unique: the tied weight once (50*16, fp32), mix (16*16+16, fp64); scale frozen
    psi_bytes = 50 * 16 * 4 + (16 * 16 + 16) * 8
    for state, reduced, dtypes, bucketed in results:
        assert reduced == [psi_bytes] * steps
        assert all(len(kinds) == 1 for kinds in dtypes)  # one dtype per bucket
        assert bucketed == 3  # emb/head weight, mix.weight, mix.bias
        assert compare_state(state, reference.state_dict())[1] <= TOLERANCE
        assert torch.equal(state["scale"], torch.full((16,), 0.5))


# ---------------------------------------------------------------------------------
# bad input and failures


def test_bad_arguments_fail_before_any_communication():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(build_mlp(0), bucket_cap_mb=0)
    frozen = build_mlp(0).requires_grad_(False)
    with pytest.raises(ValueError, match="requires grad"):
        DistributedDataParallel(frozen)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _unused_parameter():
    ddp = DistributedDataParallel(WithUnused())
    ddp(torch.ones(2, 4)).sum().backward()


def _naive_without_backward():
    all_reduce_gradients(build_mlp(0))


def _sparse_embedding():
    ddp = DistributedDataParallel(nn.Embedding(10, 4, sparse=True))
    ddp(torch.tensor([1, 2])).sum().backward()


@pytest.mark.parametrize("fn, message", [
    (_unused_parameter, "unused.weight"),
    (_naive_without_backward, "has no gradient"),
    (_sparse_embedding, "sparse gradients are not supported"),
])
def test_bad_input_is_a_clear_error(fn, message):
    with pytest.raises(RankError, match=message):
        launch(fn, 2, timeout=60)


def _crash_mid_step(crashing_rank: int):
    model = build_gpt(SMALL_GPT)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    x, y = rank_slice(gpt_batches(1, 6)[0], dist.get_rank(), dist.get_world_size())
    loss = model_loss(ddp, (x, y))
    if dist.get_rank() == crashing_rank:
        raise RuntimeError("simulated crash between forward and backward")
    loss.backward()  # its peers wait in the bucket all-reduces for a rank that is gone
    return "finished"


def test_a_rank_that_crashes_mid_step_ends_the_job_with_its_error():
    with pytest.raises(RankError, match="simulated crash") as error:
        launch(_crash_mid_step, 3, args=(1,), timeout=60)
    assert error.value.rank == 1


def _broadcast_within_subgroups():
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    model = build_mlp(seed=rank)  # four different replicas
    DistributedDataParallel(model, group=groups[rank // 2], broadcast_from=1)  # `src` is a rank within the group
    return model.state_dict()


def test_broadcast_from_is_a_rank_within_the_group():
    """Groups {0, 1} and {2, 3}, broadcast_from=1: each group ends with its second rank's weights
    (global ranks 1 and 3), not global rank 1's everywhere."""
    states = launch(_broadcast_within_subgroups, 4)
    for rank, state in enumerate(states):
        source = build_mlp(seed=2 * (rank // 2) + 1).state_dict()
        assert all(torch.equal(state[k], source[k]) for k in source), f"rank {rank} did not get its group's rank 1"
    with pytest.raises(RankError, match="broadcast_from=2 is not a rank of a group of 2"):
        launch(_bad_broadcast_from, 2)


def _bad_broadcast_from():
    DistributedDataParallel(build_mlp(0), broadcast_from=2)
