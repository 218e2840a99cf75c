"""Context parallelism (shardlib/parallel/context.py, ring_attention.py, ulysses.py, allgather_attention.py,
context_gpt.py)
against PyTorch's own attention on one device, and its ledger against hand-written formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardlib
from shardlib.comm import comm_ledger
from shardlib.parallel.allgather_attention import allgather_attention, allgather_sent_bytes
from shardlib.memory import saved_activation_bytes
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.context import (SequenceLayout, check_context_parallel, ring_attention_sent_bytes,
                                       ulysses_sent_bytes)
from shardlib.parallel.context_gpt import context_parallel_loss, sync_context_parallel_grads
from shardlib.parallel.ring_attention import block_attention, merge_attention, ring_attention, scores_computed
from shardlib.parallel.ulysses import ulysses_attention
from shardlib.reference import model_loss



# ---------------------------------------------------------------------------------
# on one process


@pytest.mark.parametrize("seq_len", [8, 9, 61, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("zigzag", [True, False])
def test_the_ranks_hold_every_position_once(seq_len, world_size, zigzag):
    layout = SequenceLayout(seq_len, world_size, zigzag)
    held = torch.cat([layout.positions(r) for r in range(world_size)])
    assert sorted(held.tolist()) == list(range(seq_len))
    lengths = [layout.length(r) for r in range(world_size)]
    assert max(lengths) - min(lengths) <= (2 if zigzag else 1), lengths


def test_zigzag_gives_rank_i_chunks_i_and_2n_minus_1_minus_i():
    layout = SequenceLayout(16, 4, zigzag=True)  # 8 chunks of 2
    assert layout.positions(0).tolist() == [0, 1, 14, 15]
    assert layout.positions(3).tolist() == [6, 7, 8, 9]


def test_too_short_a_sequence_or_heads_that_do_not_split_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="seq_len >= 8"):
        SequenceLayout(7, 4, zigzag=True)
    SequenceLayout(7, 4, zigzag=False)  # 4 chunks: fine
    with pytest.raises(ValueError, match="not divisible by N=3"):
        check_context_parallel(64, 3, "ulysses", n_head=4)
    check_context_parallel(64, 3, "ring", n_head=4)  # ring splits no heads
    with pytest.raises(ValueError, match="n_kv_head=2"):
        check_context_parallel(64, 4, "ulysses", n_head=4, n_kv_head=2)
    with pytest.raises(ValueError, match="method"):
        check_context_parallel(64, 2, "all-gather", n_head=4)


def test_merging_two_partial_attentions_equals_attention_on_all_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k2, v2 = (torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    scores_a, scores_b = q @ k.transpose(-2, -1) / math.sqrt(8), q @ k2.transpose(-2, -1) / math.sqrt(8)
    part_a = (scores_a.softmax(-1) @ v, scores_a.logsumexp(-1))
    part_b = (scores_b.softmax(-1) @ v2, scores_b.logsumexp(-1))
    out, lse = merge_attention(*part_a, *part_b)
    full = F.scaled_dot_product_attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2))
    assert torch.allclose(out, full, atol=1e-12)
    assert torch.allclose(lse, torch.cat([scores_a, scores_b], -1).logsumexp(-1), atol=1e-12)


def test_block_attention_is_causal_attention_by_positions():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = block_attention(q, k, v, torch.arange(6), torch.arange(6), causal=True)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-12)


def test_zigzag_balances_the_scores_each_rank_computes():
    s, n = 64, 4
    zigzag = [scores_computed(SequenceLayout(s, n, True), r) for r in range(n)]
    contiguous = [scores_computed(SequenceLayout(s, n, False), r) for r in range(n)]
    c = s // (2 * n)  # zigzag: 2N-1 full chunk pairs and 2 diagonal ones per rank
    assert zigzag == [(2 * n + 1) * c * c] * n
    block = s // n  # contiguous: rank r sees r blocks in full and its own diagonal block
    assert contiguous == [(r + 1) * block * block for r in range(n)]


def test_formulas_reduce_to_the_papers_for_equal_blocks():
    b, s, h, n, e = 2, 64, 32, 4, 2
    forward, backward = ring_attention_sent_bytes(b, s, h, n, element_size=e)
    assert forward == (n - 1) * 2 * b * (s // n) * h * e  # N-1 K,V blocks (arXiv 2310.01889)
    assert backward == forward + n * 2 * b * (s // n) * h * e  # and N hops of dK,dV
    forward, backward = ulysses_sent_bytes(b, s, h, h, n, element_size=e)
    assert forward == backward == 4 * (n - 1) * b * (s // n) * h * e // n  # 4 all-to-alls (arXiv 2309.14509)
    assert ring_attention_sent_bytes(b, s, h, 1) == ulysses_sent_bytes(b, s, h, h, 1) == (0, 0)


def test_allgather_sends_n_minus_one_blocks_each_way_padded_to_the_longest():
    b, h, e = 2, 16, 2
    for n in (1, 2, 4):  # even blocks: (N-1)/N of the whole K, V each way (arXiv 2407.21783, Sec. 3.3.2)
        assert allgather_sent_bytes(b, 64, h, n, element_size=e) == ((n - 1) * 2 * b * (64 // n) * h * e,) * 2
    assert allgather_sent_bytes(b, 61, h, 4, element_size=e) == (3 * 2 * b * 16 * h * e,) * 2  # blocks 15..16


# ---------------------------------------------------------------------------------
# on ranks


def _attention_vs_sdpa(method, seq_len, zigzag, n_kv, overlap):
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    B, nh, d = 2, 4, 8
    q, w = (torch.randn(B, nh, seq_len, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, n_kv, seq_len, d, generator=g, dtype=torch.float64) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=n_kv != nh)
    (reference * w).sum().backward()
    layout = SequenceLayout(seq_len, n, zigzag)
    mine = [layout.shard(t, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    with comm_ledger() as forward:
        if method == "ring":
            out = ring_attention(*mine, layout, group=dist.group.WORLD, overlap=overlap)
        elif method == "ulysses":
            out = ulysses_attention(*mine, layout, group=dist.group.WORLD)
        else:
            out = allgather_attention(*mine, layout, group=dist.group.WORLD)
    with comm_ledger() as backward:
        (out * layout.shard(w, rank, dim=2)).sum().backward()
    diffs = [(out - layout.shard(reference, rank, 2)).abs().max().item()]
    diffs += [(m.grad - layout.shard(f.grad, rank, 2)).abs().max().item() for m, f in zip(mine, full)]
    return max(diffs), forward.summary(), backward.summary()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seq_len,zigzag,n_kv", [(64, True, 4), (61, True, 4), (61, False, 2), (9, True, 4)])
def test_forward_and_backward_equal_sdpa_and_the_ledger_the_formula(method, world_size, seq_len, zigzag, n_kv):
    if seq_len < 2 * world_size and zigzag:
        pytest.skip("zigzag needs 2N tokens")
    if method == "ulysses" and n_kv % world_size:
        pytest.skip("Ulysses needs N to divide the kv heads (check_context_parallel says so before launching)")
    results = shardlib.launch(_attention_vs_sdpa, world_size, args=(method, seq_len, zigzag, n_kv, True),
                              device="cpu")
    B, d, h = 2, 8, 4 * 8
    for rank, (diff, forward, backward) in enumerate(results):
        assert diff < 1e-12, f"rank {rank}: output or gradient differs from SDPA by {diff}"
        if method == "ring":
            expected = ring_attention_sent_bytes(B, seq_len, n_kv * d, world_size, element_size=8, rank=rank,
                                                 zigzag=zigzag)
            kind = "send"
            calls = (world_size - 1, 2 * world_size - 1)  # K,V blocks forward; K,V and dK,dV backward
        elif method == "allgather":  # one all-gather of K,V forward, one reduce-scatter of dK,dV backward
            expected = allgather_sent_bytes(B, seq_len, n_kv * d, world_size, element_size=8, zigzag=zigzag)
            assert forward.keys() == {"all_gather"} and backward.keys() == {"reduce_scatter"}, (forward, backward)
            assert (forward["all_gather"]["sent_bytes"], backward["reduce_scatter"]["sent_bytes"]) == expected
            assert forward["all_gather"]["calls"] == backward["reduce_scatter"]["calls"] == 1
            continue
        else:
            expected = ulysses_sent_bytes(B, seq_len, h, n_kv * d, world_size, element_size=8, rank=rank,
                                          zigzag=zigzag)
            kind, calls = "all_to_all", (4, 4)
        assert (forward[kind]["sent_bytes"], backward[kind]["sent_bytes"]) == expected, (rank, forward, backward)
        assert (forward[kind]["calls"], backward[kind]["calls"]) == calls


@pytest.mark.slow
def test_without_overlap_the_ring_gives_the_same_result():
    overlapped = shardlib.launch(_attention_vs_sdpa, 3, args=("ring", 30, True, 4, True), device="cpu")
    serial = shardlib.launch(_attention_vs_sdpa, 3, args=("ring", 30, True, 4, False), device="cpu")
    assert max(r[0] for r in overlapped + serial) < 1e-12
    assert [r[1:] for r in overlapped] == [r[1:] for r in serial]


def _gpt_vs_one_device(method):
    config = GPTConfig()
    inputs, targets = random_token_batches(config, 2, 1)[0]
    batch = (inputs[:, :61], targets[:, :61])
    reference = build_gpt(config, seed=0).double()
    reference_loss = model_loss(reference, batch)
    reference_loss.backward()
    model = build_gpt(config, seed=0).double()
    share = context_parallel_loss(model, batch, group=dist.group.WORLD, method=method)
    share.backward()
    sync_context_parallel_grads(model, group=dist.group.WORLD)
    total = share.detach().clone()
    dist.all_reduce(total)
    grad_diff = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
    return abs(total.item() - reference_loss.item()), grad_diff


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather"])
def test_the_gpt_on_a_split_sequence_has_the_loss_and_gradients_of_one_device(method):
    for loss_diff, grad_diff in shardlib.launch(_gpt_vs_one_device, 4, args=(method,), device="cpu"):
        assert loss_diff < 1e-12 and grad_diff < 1e-12, (loss_diff, grad_diff)


def _saved_bytes(method, seq_len):
    config = GPTConfig(seq_len=seq_len)
    model = build_gpt(config, seed=0)
    batch = random_token_batches(config, 2, 1)[0]
    return saved_activation_bytes(lambda: context_parallel_loss(model, batch, group=dist.group.WORLD, method=method))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_activations_per_rank_are_one_nth_of_one_device(method):
    one = shardlib.launch(_saved_bytes, 1, args=(method, 128), device="cpu")[0]
    for n in (2, 4):
        per_rank = shardlib.launch(_saved_bytes, n, args=(method, 128), device="cpu")
        for rank, saved in enumerate(per_rank):
            # within 1%: the position indices (s int64 values, a few per layer) are not split
            assert abs(saved * n - one) <= 0.01 * one, f"N={n} rank {rank}: {saved} B x N vs {one} B on one rank"
