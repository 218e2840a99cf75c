"""shardlib.comm: ring collectives equal torch.distributed's, the ledger counts what is sent,
and the alpha-beta model says what its formula says.

References are independent of the code under test: torch.distributed's own collectives,
the same sums computed in one process, and byte counts worked out here from the ring
schedule (N-1 or 2(N-1) messages of one padded chunk of ceil(numel/N) elements).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from shardlib import launch
from shardlib.comm import (AlphaBeta, comm_ledger, ops, fit_alpha_beta, ring_all_gather, ring_all_reduce,
                           ring_broadcast, ring_reduce_scatter, ring_sent_bytes)

SHAPES = [(1,), (7,), (1001,), (5, 3), (12,)]  # 12 divides by 1..4; the others mostly do not


def rank_input(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """What rank `rank` holds: the same in the ranks and in the test process."""
    g = torch.Generator().manual_seed(1000 * rank + math.prod(shape))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def run_every_collective():
    """On each rank: ours and torch's for every collective and shape, with ledger bytes."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for shape in SHAPES:
        for dtype in (torch.float32, torch.float64, torch.int64):
            x = rank_input(rank, shape, dtype)
            row = {"shape": shape, "dtype": dtype}
            with comm_ledger() as ledger:
                row["ours_all_reduce"] = ring_all_reduce(x.clone())
            row["sent_all_reduce"] = ledger.sent_bytes()
            row["sends_all_reduce"] = [r.peers for r in ledger.records if r.kind == "send"]
            theirs = x.clone()
            dist.all_reduce(theirs)
            row["torch_all_reduce"] = theirs

            with comm_ledger() as ledger:
                row["ours_all_gather"] = ring_all_gather(x)
            row["sent_all_gather"] = ledger.sent_bytes()
            gathered = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(gathered, x)
            row["torch_all_gather"] = torch.stack(gathered)

            with comm_ledger() as ledger:
                row["ours_reduce_scatter"] = ring_reduce_scatter(x)
            row["sent_reduce_scatter"] = ledger.sent_bytes()

            for src in {0, n - 1}:
                with comm_ledger() as ledger:
                    row[f"ours_broadcast_{src}"] = ring_broadcast(x.clone(), src=src)
                row[f"sent_broadcast_{src}"] = ledger.sent_bytes()
                theirs = x.clone()
                dist.broadcast(theirs, src=src)
                row[f"torch_broadcast_{src}"] = theirs
            out.append(row)
    return out


def torch_reduce_scatter_padded(numel_per_rank: int):
    """torch's reduce-scatter needs equal shards: pad each rank's input to N*c ourselves."""
    rank, n = dist.get_rank(), dist.get_world_size()
    c = math.ceil(numel_per_rank / n)
    x = rank_input(rank, (numel_per_rank,))
    padded = torch.zeros(n * c)
    padded[:numel_per_rank] = x
    shard = torch.empty(c)
    ops.reduce_scatter_tensor(shard, padded)  # torch.distributed's, whatever this torch names it
    return shard, ring_reduce_scatter(x)


def close(a, b, dtype) -> bool:
    if dtype.is_floating_point:
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    return torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_collectives_equal_torch_and_send_the_ring_bytes(n):
    per_rank = launch(run_every_collective, n, timeout=120)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            shape, dtype = row["shape"], row["dtype"]
            where = f"N={n} rank={rank} shape={shape} {dtype}"
            numel, size = math.prod(shape), torch.empty((), dtype=dtype).element_size()
            inputs = [rank_input(r, shape, dtype) for r in range(n)]
            total = torch.stack(inputs).sum(0)  # the single-process reference
            c = math.ceil(numel / n)  # elements per chunk, padding included

            assert close(row["ours_all_reduce"], row["torch_all_reduce"], dtype), where
            assert close(row["ours_all_reduce"], total, dtype), where
            assert torch.equal(row["ours_all_gather"], row["torch_all_gather"]), where
            assert torch.equal(row["ours_all_gather"], torch.stack(inputs)), where
            shard = total.reshape(-1)[rank * c: (rank + 1) * c]  # cut at numel: may be short or empty
            assert close(row["ours_reduce_scatter"], shard, dtype), where
            for src in {0, n - 1}:
                assert torch.equal(row[f"ours_broadcast_{src}"], row[f"torch_broadcast_{src}"]), where
                assert torch.equal(row[f"ours_broadcast_{src}"], inputs[src]), where

            # bytes: 2(N-1) messages of one chunk for all-reduce, N-1 for the others
            assert row["sent_all_reduce"] == 2 * (n - 1) * c * size, where
            assert row["sent_all_reduce"] == ring_sent_bytes("all_reduce", numel, n, size), where
            assert row["sends_all_reduce"] == [((rank + 1) % n,)] * (2 * (n - 1)), where  # right neighbour
            ideal = Fraction(2 * (n - 1), n) * numel * size  # 2(N-1)/N * S, no padding; exact
            padding_at_most = Fraction(2 * (n - 1), n) * (n - 1) * size  # the ring's share of <= N-1 zeros
            assert 0 <= row["sent_all_reduce"] - ideal <= padding_at_most, where
            if numel % n == 0:
                assert row["sent_all_reduce"] == ideal, where
            assert row["sent_all_gather"] == (n - 1) * numel * size, where  # S = N*numel: chunks are whole
            assert row["sent_all_gather"] == ring_sent_bytes("all_gather", n * numel, n, size), where
            assert row["sent_reduce_scatter"] == (n - 1) * c * size, where
            assert row["sent_reduce_scatter"] == ring_sent_bytes("reduce_scatter", numel, n, size), where
            for src in {0, n - 1}:
                end_of_chain = (src - 1) % n  # the chain src -> src+1 -> ... ends here
                expected = 0 if rank == end_of_chain or n == 1 else n * c * size
                assert row[f"sent_broadcast_{src}"] == expected, where
                assert row[f"sent_broadcast_{src}"] == ring_sent_bytes("broadcast", numel, n, size, rank, src), where


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_reduce_scatter_matches_torch_on_padded_input(n):
    for numel in (5, 1001):
        for theirs, ours in launch(torch_reduce_scatter_padded, n, args=(numel,)):
            assert torch.allclose(theirs[: ours.numel()], ours, atol=1e-5)
            assert theirs[ours.numel():].abs().sum() == 0  # the rest is padding


def ring_on_a_subgroup():
    """Ranks 0 and 2 of 3 all-reduce among themselves; rank 1 stays out."""
    group = dist.new_group([0, 2])
    rank = dist.get_rank()
    x = rank_input(rank, (7,))
    if rank == 1:
        return None
    with comm_ledger() as ledger:
        ours = ring_all_reduce(x.clone(), group=group)
    theirs = x.clone()
    dist.all_reduce(theirs, group=group)
    return ours, theirs, [(r.kind, r.peers, r.sent_bytes) for r in ledger.records]


def test_ring_all_reduce_on_a_subgroup():
    results = launch(ring_on_a_subgroup, 3)
    assert results[1] is None
    expected = rank_input(0, (7,)) + rank_input(2, (7,))
    for rank, other in ((0, 2), (2, 0)):
        ours, theirs, records = results[rank]
        assert torch.allclose(ours, expected) and torch.allclose(ours, theirs)
        # two ranks: chunks of 4 elements, one message each way per phase
        assert records == [("send", (other,), 16), ("recv", (other,), 0)] * 2


# ---------------------------------------------------------------------------------
# the ledger around PyTorch's own calls


def record_torch_calls():
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    x = torch.arange(10, dtype=torch.float32)  # 40 bytes
    with comm_ledger(record_torch=True) as ledger:
        dist.all_reduce(x.clone())
        dist.broadcast(x.clone(), src=0)
        dist.all_gather([torch.empty(10) for _ in range(n)], x)  # S = n * 40 bytes
        request = dist.isend(x, right)
        dist.recv(torch.empty(10), left)
        request.wait()
        if rank == 0:
            dist.send(torch.ones(3, dtype=torch.float64), 1)  # 24 bytes; recorded once, not as isend too
        elif rank == 1:
            dist.recv(torch.empty(3, dtype=torch.float64), 0)
        ops = [dist.P2POp(dist.isend, torch.ones(2), right), dist.P2POp(dist.irecv, torch.empty(2), left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    dist.all_reduce(x.clone())  # after the ledger closed: not recorded
    return [(r.kind, r.nbytes, r.sent_bytes, r.peers) for r in ledger.records]


def test_ledger_records_torch_collectives_and_point_to_point():
    n = 3
    everyone = tuple(range(n))
    for rank, records in enumerate(launch(record_torch_calls, n)):
        right, left = (rank + 1) % n, (rank - 1) % n
        expected = [
            ("all_reduce", 40, 2 * (n - 1) * 40 // n, everyone),  # charged at the ring's 2(N-1)/N * S
            ("broadcast", 40, 40, everyone),
            ("all_gather", n * 40, (n - 1) * 40, everyone),  # (N-1)/N of the gathered S
            ("send", 40, 40, (right,)),
            ("recv", 40, 0, (left,)),
        ]
        if rank == 0:
            expected.append(("send", 24, 24, (1,)))
        elif rank == 1:
            expected.append(("recv", 24, 0, (0,)))
        expected += [("send", 8, 8, (right,)), ("recv", 8, 0, (left,))]
        assert records == expected, f"rank {rank}"


def nested_ledgers():
    n = dist.get_world_size()
    x = torch.ones(12)
    with comm_ledger(record_torch=True) as outer:
        ring_all_reduce(x)
        with comm_ledger(record_torch=True) as inner:
            dist.all_reduce(x)
            ring_all_gather(x)
        dist.broadcast(x, src=0)
    return ([r.kind for r in outer.records], [r.kind for r in inner.records],
            outer.sent_bytes(), inner.sent_bytes(), outer.calls("send"), n)


def test_nested_ledgers_each_see_what_ran_while_they_were_open():
    for outer, inner, outer_sent, inner_sent, outer_sends, n in launch(nested_ledgers, 3):
        ring_all_reduce_msgs = ["send", "recv"] * (2 * (n - 1))
        ring_all_gather_msgs = ["send", "recv"] * (n - 1)
        assert inner == ["all_reduce"] + ring_all_gather_msgs
        assert outer == ring_all_reduce_msgs + inner + ["broadcast"]
        assert inner_sent == 2 * (n - 1) * 4 * 4 + (n - 1) * 12 * 4  # torch's all-reduce + ring all-gather
        assert outer_sent == 2 * (n - 1) * 4 * 4 + inner_sent + 12 * 4
        assert outer_sends == 2 * (n - 1) + (n - 1)


def test_ledger_restores_torch_functions_on_exit_even_after_an_error():
    names = ["all_reduce", "broadcast", "all_gather", "send", "recv", "isend", "irecv",
             "batch_isend_irecv", "P2POp", "reduce_scatter", "barrier"]
    originals = {name: getattr(dist, name) for name in names}
    with comm_ledger():
        assert all(getattr(dist, name) is originals[name] for name in names), "a plain ledger patched torch"
    with comm_ledger(record_torch=True):
        assert all(getattr(dist, name) is not originals[name] for name in names), "nothing was patched"
        with comm_ledger(record_torch=True):
            pass
        assert dist.all_reduce is not originals["all_reduce"], "closing the inner ledger unpatched the outer"
    assert all(getattr(dist, name) is originals[name] for name in names)
    with pytest.raises(RuntimeError, match="inside"):
        with comm_ledger(record_torch=True):
            raise RuntimeError("inside")
    assert all(getattr(dist, name) is originals[name] for name in names)


def test_ledger_summary_adds_up():
    from shardlib.comm import CommLedger, CommRecord

    ledger = CommLedger()
    ledger.records += [CommRecord("send", 8, 8, (1,)), CommRecord("send", 4, 4, (1,)), CommRecord("recv", 8, 0, (1,))]
    assert ledger.calls() == 3 and ledger.calls("send") == 2
    assert ledger.bytes() == 20 and ledger.sent_bytes() == 12 and ledger.sent_bytes("recv") == 0
    assert ledger.summary() == {"send": {"calls": 2, "bytes": 12, "sent_bytes": 12},
                                "recv": {"calls": 1, "bytes": 8, "sent_bytes": 0}}


# ---------------------------------------------------------------------------------
# the alpha-beta model


def test_ring_sent_bytes_by_hand():
    assert ring_sent_bytes("all_reduce", 1000, 4) == 6 * 250 * 4  # 2(N-1) chunks of 250 fp32
    assert ring_sent_bytes("all_reduce", 1001, 4) == 6 * 251 * 4  # padded to 1004
    assert ring_sent_bytes("all_reduce", 1001, 4, element_size=2) == 6 * 251 * 2
    assert ring_sent_bytes("reduce_scatter", 10, 3) == 2 * 4 * 4
    assert ring_sent_bytes("all_gather", 12, 3) == 2 * 4 * 4
    assert ring_sent_bytes("broadcast", 10, 3, rank=0, src=0) == 3 * 4 * 4
    assert ring_sent_bytes("broadcast", 10, 3, rank=2, src=0) == 0  # end of the chain 0 -> 1 -> 2
    assert ring_sent_bytes("all_reduce", 10**6, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        ring_sent_bytes("all_to_everyone", 10, 2)


def test_alpha_beta_time_by_hand():
    link = AlphaBeta(alpha=1e-5, bandwidth=1e9)  # 10 us per message, 1 GB/s
    # all-reduce, N=4, S=1 MB: 6 steps of (10 us + 250 kB / 1 GB/s = 250 us) = 1.56 ms
    assert link.time("all_reduce", 1e6, 4) == pytest.approx(1.56e-3, rel=1e-12)
    assert link.time("all_reduce", 1e6, 2) == pytest.approx(1.02e-3, rel=1e-12)  # 2 * (10 + 500) us
    assert link.time("reduce_scatter", 1e6, 4) == pytest.approx(0.78e-3, rel=1e-12)  # 3 * 260 us
    assert link.time("all_gather", 1e6, 4) == pytest.approx(0.78e-3, rel=1e-12)
    assert link.time("broadcast", 1e6, 4) == pytest.approx(1.56e-3, rel=1e-12)  # (k+N-2)=6 pieces of S/4
    assert link.time("all_reduce", 1e6, 1) == 0.0
    assert link.time("all_reduce", 0, 4) == pytest.approx(6e-5, rel=1e-12)  # latency only


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_model_bytes_term_equals_what_the_ring_sends(kind, n):
    numel = 12 * 1000  # N divides it: no padding
    bytes_only = AlphaBeta(alpha=0.0, bandwidth=1.0)  # seconds == bytes through one link
    s = numel * 4 * (n if kind == "all_gather" else 1)
    assert bytes_only.time(kind, s, n) == pytest.approx(ring_sent_bytes(kind, s // 4, n), rel=1e-12)


@pytest.mark.parametrize("kind, n", [("all_reduce", 2), ("all_reduce", 4), ("all_gather", 3), ("broadcast", 4)])
def test_fit_recovers_alpha_and_bandwidth(kind, n):
    alpha, bandwidth = 5e-5, 2e9
    steps = 2 * (n - 1) if kind in ("all_reduce", "broadcast") else n - 1
    sizes = [2.0**k for k in range(10, 27, 2)]
    exact = [steps * (alpha + s / n / bandwidth) for s in sizes]  # written out here, not via AlphaBeta
    fitted = fit_alpha_beta(kind, n, sizes, exact)
    assert fitted.alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(bandwidth, rel=1e-6)

    g = torch.Generator().manual_seed(0)
    noise = 1 + 0.02 * torch.randn(len(sizes), generator=g, dtype=torch.float64)  # 2% jitter
    noisy = [t * float(e) for t, e in zip(exact, noise)]
    fitted = fit_alpha_beta(kind, n, sizes, noisy)
    assert fitted.bandwidth == pytest.approx(bandwidth, rel=0.05)
    assert fitted.alpha == pytest.approx(alpha, rel=0.05)  # an unweighted fit misses by ~30% here


def _positional_group_calls():
    group = dist.new_group([0, 1])
    with comm_ledger(record_torch=True) as ledger:
        if dist.get_rank() < 2:
            dist.all_reduce(torch.ones(3), dist.ReduceOp.SUM, group)  # group passed positionally
            dist.broadcast(torch.ones(2), 0, group)
            dist.barrier(group)
    return [(r.kind, r.peers) for r in ledger.records]


def test_ledger_reads_a_group_passed_positionally():
    records = launch(_positional_group_calls, 3, timeout=60)
    expected = [("all_reduce", (0, 1)), ("broadcast", (0, 1)), ("barrier", (0, 1))]
    assert records == [expected, expected, []]


def shardlib_calls_record_themselves_torch_calls_only_when_asked():
    x = torch.ones(8)
    with comm_ledger() as plain:
        with comm_ledger(record_torch=True) as everything:
            ops.all_reduce(x.clone())  # shardlib's: both ledgers
            dist.all_reduce(x.clone())  # PyTorch's own: only the ledger that asked
        dist.all_reduce(x.clone())  # no ledger records PyTorch's calls any more
    return [r.kind for r in plain.records], [r.kind for r in everything.records]


def test_shardlib_calls_record_themselves_and_torch_calls_only_when_asked():
    for plain, everything in launch(shardlib_calls_record_themselves_torch_calls_only_when_asked, 2):
        assert plain == ["all_reduce"], plain
        assert everything == ["all_reduce", "all_reduce"], everything


def a_call_the_ledger_cannot_describe(monkeypatch_describe):
    import shardlib.comm.ledger as ledger_module

    if monkeypatch_describe:
        def broken(*args, **kwargs):
            raise KeyError("cannot describe")
        ledger_module._describe_torch_call = broken
    x = torch.ones(4)
    with comm_ledger(record_torch=True) as ledger:
        dist.all_reduce(x)
    return x.tolist(), [r.kind for r in ledger.records]


def test_recording_never_raises_inside_the_call_it_records():
    for values, kinds in launch(a_call_the_ledger_cannot_describe, 2, args=(True,)):
        assert values == [2.0] * 4, "the all-reduce did not run"
        assert kinds == ["unknown:all_reduce"], kinds


def test_ledgers_record_from_several_threads_without_losing_records():
    import threading

    from shardlib.comm.ledger import CommRecord, record

    per_thread, n_threads = 2000, 4
    with comm_ledger() as ledger:
        threads = [threading.Thread(target=lambda: [record(CommRecord("send", 1, 1, (0,))) for _ in range(per_thread)])
                   for _ in range(n_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert ledger.calls("send") == per_thread * n_threads
