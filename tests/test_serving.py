"""Serving under load: the paged KV cache, the scheduler's admission rules, continuous and static batching
against one-at-a-time greedy generation (one device, TP, PP), the load generator, the queueing formulas and
the autoscaler. No timing is asserted: only what the clock cannot change."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from shardlib.inference.autoscale import AutoscalePolicy, Autoscaler, serve_day
from shardlib.inference.batching import Request, Scheduler, run_engine
from shardlib.inference.kv_cache import PagedKVCache
from shardlib.inference.load import (
    day_rate,
    day_trace,
    percentile,
    poisson_requests,
    saturation_throughput,
    summarize,
)
from shardlib.inference.queueing import (
    ROUTERS,
    capacity,
    erlang_c,
    mean_latency,
    mean_wait,
    predicted_knee,
)
from shardlib.inference.under_load import random_routes, serve_traces
from shardlib.models import GPTConfig, build_gpt

CONFIG = GPTConfig(seq_len=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=32)


def requests(n: int = 10, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(i, torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist(),
                    int(torch.randint(1, 14, (1,), generator=g))) for i in range(n)]


@pytest.fixture(scope="module")
def model():
    return build_gpt(CONFIG, seed=0).eval()


@pytest.fixture(scope="module")
def one_at_a_time(model):
    """GPT.generate, one request at a time, no cache: the reference tokens."""
    return {r.id: model.generate(torch.tensor([r.prompt]), r.max_new_tokens)[0, len(r.prompt):].tolist()
            for r in requests()}


# ---------------------------------------------------------------------------------
# the paged cache and the scheduler


def test_paged_cache_stores_what_a_contiguous_one_would(model):
    cache = PagedKVCache(model, n_blocks=6, block_size=4)
    cache.allocate(7, 10)  # 3 blocks
    cache.allocate(8, 3)  # 1 block
    assert len(cache.free_blocks) == 2 and len(cache.tables[7]) == 3
    k, v = torch.randn(2, 10, 8), torch.randn(2, 10, 8)  # (n_kv, T, hd)
    keys, values = cache.update(0, 7, k[:, :6], v[:, :6], 0)
    other = cache.update(0, 8, torch.ones(2, 3, 8), torch.ones(2, 3, 8), 0)  # another sequence's blocks
    for t in range(6, 10):
        keys, values = cache.update(0, 7, k[:, t:t + 1], v[:, t:t + 1], t)
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert torch.equal(other[0], torch.ones(2, 3, 8))
    with pytest.raises(ValueError, match="past its 3 blocks"):
        cache.update(0, 7, k[:, :3], v[:, :3], 10)
    cache.free(7)
    assert sorted(cache.free_blocks) == sorted(set(range(6)) - set(cache.tables[8]))


def test_admission_is_first_come_first_served_under_both_limits(model):
    cache = PagedKVCache(model, n_blocks=8, block_size=4)
    scheduler = Scheduler(cache, max_batch=3)
    sizes = [(5, 4), (9, 8), (2, 2), (1, 2)]  # (prompt, output): 8, 16, 3, 2 positions = 2, 4, 1, 1 blocks
    for i, (T0, n) in enumerate(sizes):
        scheduler.add(Request(i, [1] * T0, n))
    assert [r.id for r in scheduler.admit(0.0)] == [0, 1, 2]  # 7 blocks; max_batch stops request 3
    assert len(cache.free_blocks) == 1
    scheduler.running[0].tokens = [0] * 4  # request 0 is done
    assert [r.id for r in scheduler.retire()] == [0]
    assert [r.id for r in scheduler.admit(1.0)] == [3] and scheduler.running[-1].admitted == 1.0


def test_the_head_of_the_queue_blocks_those_behind_it(model):
    scheduler = Scheduler(PagedKVCache(model, n_blocks=4, block_size=4), max_batch=8)
    for i, positions in enumerate([12, 8, 2]):  # 3, 2, 1 blocks
        scheduler.add(Request(i, [1] * positions, 1))
    assert [r.id for r in scheduler.admit(0.0)] == [0]  # request 1 does not fit; 2 would, but waits its turn


def test_static_batching_admits_only_into_an_empty_batch(model):
    scheduler = Scheduler(PagedKVCache(model, n_blocks=16, block_size=4), max_batch=2, policy="static")
    for i in range(4):
        scheduler.add(Request(i, [1, 2], 1 + i))
    assert [r.id for r in scheduler.admit(0.0)] == [0, 1]
    scheduler.running[0].tokens = [5]
    scheduler.retire()
    assert scheduler.admit(0.1) == []  # request 1 still runs
    scheduler.running[0].tokens = [5, 5]
    scheduler.retire()
    assert [r.id for r in scheduler.admit(0.2)] == [2, 3]


def test_reserving_the_whole_context_admits_fewer(model):
    def admitted(reserve):
        scheduler = Scheduler(PagedKVCache(model, n_blocks=8, block_size=4), 16, reserve=reserve, max_positions=32)
        for i in range(8):
            scheduler.add(Request(i, [1] * 3, 2))  # 4 positions: 1 block exactly, 8 with reserve="max"
        return len(scheduler.admit(0.0))
    assert (admitted("exact"), admitted("max")) == (8, 1)


def test_bad_scheduler_input_says_what_to_change(model):
    cache = PagedKVCache(model, n_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="needs 3 KV blocks and the cache has 2"):
        Scheduler(cache, 4).add(Request(0, [1] * 10, 2))
    with pytest.raises(ValueError, match="policy must be"):
        Scheduler(cache, 4, policy="greedy")
    with pytest.raises(ValueError, match="max_positions"):
        Scheduler(cache, 4, reserve="max")


# ---------------------------------------------------------------------------------
# batching gives one-at-a-time tokens


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_batched_tokens_are_one_at_a_time_tokens(model, one_at_a_time, policy):
    cache = PagedKVCache(model, n_blocks=10, block_size=4)
    served = run_engine(model, requests(), Scheduler(cache, max_batch=4, policy=policy))
    assert {r.id: r.tokens for r in served} == one_at_a_time
    assert len(cache.free_blocks) == 10
    assert all(len(r.token_times) == r.max_new_tokens and r.admitted is not None for r in served)


def test_route_and_tick(model, one_at_a_time):
    ticks = []

    def tick(now):
        ticks.append(now)
        return 0.05 if len(ticks) < 3 else math.inf
    served = run_engine(model, requests(), Scheduler(PagedKVCache(model, 16, 4), 4), route=lambda r: r.id % 2 == 0,
                        tick=tick)
    assert [r.id for r in served] == [0, 2, 4, 6, 8]
    assert all(r.tokens == one_at_a_time[r.id] for r in served)
    assert len(ticks) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("layout,n", [("tp", 2), ("tp", 4), ("pp", 2), ("pp", 4), ("replicas", 2)])
def test_every_layout_under_load_gives_one_at_a_time_tokens(one_at_a_time, layout, n):
    trace = requests()
    for i, r in enumerate(trace):
        r.arrival = 0.01 * i
    served = serve_traces(layout, n, CONFIG, [trace], max_batch=3, kv_blocks=12, block_size=4, device="cpu")[0]
    assert {r.id: r.tokens for r in served} == one_at_a_time
    assert all(len(r.token_times) == r.max_new_tokens and r.token_times[0] >= r.arrival for r in served)


# ---------------------------------------------------------------------------------
# load


def test_poisson_arrivals_and_lengths():
    a, b = poisson_requests(50.0, 4000, seed=3), poisson_requests(50.0, 4000, seed=3)
    assert [(r.arrival, r.prompt, r.max_new_tokens) for r in a] == [(r.arrival, r.prompt, r.max_new_tokens) for r in b]
    gaps = [y.arrival - x.arrival for x, y in zip(a, a[1:])]
    # exponential gaps of mean 1/50: the sample mean of 4000 is within 4% of it (5 standard errors of 1.6%)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.08)
    assert sum(g > 3 / 50 for g in gaps) / len(gaps) == pytest.approx(math.exp(-3), abs=0.02)  # P(gap > 3/rate)
    assert {len(r.prompt) for r in a} == set(range(4, 17)) and {r.max_new_tokens for r in a} == set(range(4, 13))


def test_day_trace_follows_its_rate():
    trace = day_trace(100.0, 5.0, 45.0, seed=1)
    expected = sum(day_rate(t + 0.5, 100.0, 5.0, 45.0) for t in range(100))  # integral of the rate, ~20 per s
    assert len(trace) == pytest.approx(expected, rel=0.06)  # Poisson: sd sqrt(2000) = 2.2%
    night = sum(r.arrival < 20 or r.arrival >= 80 for r in trace)
    noon = sum(40 <= r.arrival < 60 for r in trace)
    assert noon / night == pytest.approx(sum(day_rate(t + 0.5, 100, 5, 45) for t in range(40, 60))
                                         / sum(day_rate(t + 0.5, 100, 5, 45) for t in [*range(20), *range(80, 100)]),
                                         rel=0.15)


def test_summary_of_hand_made_requests():
    done = []
    for i, (arrival, times) in enumerate([(0.0, [0.1, 0.2, 0.3]), (1.0, [1.5, 1.6, 1.7]), (2.0, [2.1, 2.4, 2.7])]):
        done.append(Request(i, [1], 3, arrival=arrival, tokens=[1, 2, 3], token_times=times))
    s = summarize(done, ttft_slo=0.2, tpot_slo=0.2)
    assert s["ttft_p50"] == pytest.approx(0.1) and s["tpot_p50"] == pytest.approx(0.1)
    assert s["e2e_mean"] == pytest.approx((0.3 + 0.7 + 0.7) / 3)
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # request 1 misses TTFT, request 2 misses TPOT
    assert s["tokens_per_s"] == pytest.approx(9 / 2.7) and s["requests_per_s"] == pytest.approx(3 / 2.7)
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="did not finish"):
        summarize([Request(9, [1], 2)], ttft_slo=1, tpot_slo=1)


# ---------------------------------------------------------------------------------
# queueing formulas


def test_queueing_formulas_against_textbook_cases():
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # M/M/2 at a = 1: P0 = 1/3, C = a^2/2 * 2 * P0
    assert erlang_c(1, 0.7) == pytest.approx(0.7)  # M/M/1: P(wait) = rho
    assert mean_wait(0.5, 1, 1.0, 1.0) == pytest.approx(1.0)  # M/M/1: rho / (mu - lambda)
    assert mean_wait(0.5, 1, 1.0, 0.0) == pytest.approx(0.5)  # M/D/1: rho S / (2 (1 - rho))
    assert mean_wait(9.0, 8, 1.0, 1.0) == math.inf
    assert capacity(8, 0.02, 8) == pytest.approx(50.0)
    k = predicted_knee(8, 0.02, 8, 6.67, factor=2.0)
    assert mean_latency(k, 8, 0.02, 8, 6.67) == pytest.approx(2 * mean_latency(0, 8, 0.02, 8, 6.67), rel=1e-6)


def simulated_mean_wait(rate: float, slots: int, replicas: int, router: str, step_s: float, n: int = 200_000) -> float:
    """First-come-first-served slots, event by event: the independent reference for the formulas' waits.
    Poisson arrivals; a request holds a slot for (uniform 4..12 tokens) x step_s; "random" sends it to a
    replica drawn at random, "central" to the first slot that frees anywhere."""
    import heapq
    import random

    draw = random.Random(7)
    free = [[0.0] * slots for _ in range(replicas)] if router == "random" else [[0.0] * (slots * replicas)]
    t, waited = 0.0, 0.0
    for _ in range(n):
        t += draw.expovariate(rate)
        queue = free[draw.randrange(replicas)] if router == "random" else free[0]
        start = max(t, heapq.heappop(queue))  # the earliest slot to free in the queue this request joined
        heapq.heappush(queue, start + draw.randint(4, 12) * step_s)
        waited += start - t
    return waited / n


@pytest.mark.parametrize("router", ROUTERS)
def test_replica_routers_queue_as_the_formula_says(router):
    """Two replicas of 8 slots at 85% of their capacity: the formula's mean wait (Lee-Longton) against an
    event-by-event simulation of the same queue(s); a random router waits several times longer than a central one.
    Lee-Longton's (1 + C_s^2) / 2 scaling of the M/M/c wait is an approximation: for these nearly constant service
    times it runs 9-13% below the simulated wait (M/M/c itself agrees within 2%), hence the 20% tolerance."""
    step, mean_n, var_n = 0.025, 8, 80 / 12
    rate = 0.85 * capacity(8, step, mean_n, replicas=2)
    formula = mean_latency(rate, 8, step, mean_n, var_n, replicas=2, router=router) - mean_n * step - step / 2
    simulated = simulated_mean_wait(rate, 8, 2, router, step)
    assert formula == pytest.approx(simulated, rel=0.2), f"{router}: formula {formula * 1e3:.2f} ms, " \
        f"simulated {simulated * 1e3:.2f} ms"
    other = "central" if router == "random" else "random"
    other_wait = mean_latency(rate, 8, step, mean_n, var_n, replicas=2, router=other) - mean_n * step - step / 2
    assert (formula > 2 * other_wait) == (router == "random"), f"random should wait > 2x central: {router} " \
        f"{formula * 1e3:.2f} ms, {other} {other_wait * 1e3:.2f} ms"
    with pytest.raises(ValueError, match="router must be one of"):
        mean_latency(rate, 8, step, mean_n, var_n, replicas=2, router="nearest")


# ---------------------------------------------------------------------------------
# autoscaling


def test_autoscaler_adds_with_warm_up_and_drains_before_letting_go():
    policy = AutoscalePolicy(ttft_slo=1.0, min_replicas=1, max_replicas=3, up=0.5, down=0.2, calm_windows=2)
    scaler = Autoscaler(policy)
    for p99 in [0.3, 0.9, 0.9, 0.9, 0.1, 0.1, 0.1, 0.3, math.nan, 0.1]:
        scaler.end_window(p99)
    # window:                    0  1  2  3  4  5  6  7  8  9 10   (p99 of window w-1 decides window w)
    assert scaler.routable == [1, 1, 1, 2, 3, 3, 2, 2, 2, 2, 1]  # a replica warms up one window; removal needs
    assert scaler.provisioned == [1, 1, 2, 3, 3, 3, 3, 2, 2, 2, 2]  # 2 calm windows without change; paid from the
    #                                                                 add, and through one window of drain
    fixed = Autoscaler(None, replicas=4)
    fixed.end_window(9.0)
    assert fixed.provisioned == fixed.routable == [4, 4]
    with pytest.raises(ValueError, match="not both"):
        Autoscaler(AutoscalePolicy(ttft_slo=1.0), replicas=2)


def test_random_routes_are_uniform_and_seeded():
    trace = poisson_requests(10.0, 3000, seed=0)
    routes = random_routes(trace, 3, seed=5)
    assert routes == random_routes(trace, 3, seed=5)
    assert [sum(v == i for v in routes.values()) / 3000 for i in range(3)] == pytest.approx([1 / 3] * 3, abs=0.04)


@pytest.mark.slow
def test_a_short_day_serves_every_request_and_bills_the_replicas(one_at_a_time):
    trace = copy.deepcopy(requests())
    for i, r in enumerate(trace):
        r.arrival = 0.1 * i
    fixed = serve_day(CONFIG, trace, window=0.5, duration=1.0, replicas=2, max_batch=2, kv_blocks=8, block_size=4,
                      device="cpu")
    assert {r.id: r.tokens for r in fixed["requests"]} == one_at_a_time
    assert fixed["provisioned"] == [2, 2] and fixed["device_hours"] == pytest.approx(48.0)
    scaled = serve_day(CONFIG, trace, window=0.5, duration=1.0, policy=AutoscalePolicy(ttft_slo=10.0, max_replicas=2),
                       max_batch=2, kv_blocks=8, block_size=4, device="cpu")
    assert {r.id: r.tokens for r in scaled["requests"]} == one_at_a_time
    assert scaled["routable"] == [1, 1] and scaled["device_hours"] == pytest.approx(24.0)  # never scaled: SLO 10 s


def test_a_request_longer_than_the_model_fails_before_serving(model):
    with pytest.raises(ValueError, match="more positions than the model's seq_len=32"):
        run_engine(model, [Request(0, [1] * 30, 5)], Scheduler(PagedKVCache(model, 8, 4), 4))


def test_saturation_throughput_is_the_completion_rate_of_a_full_server():
    # 50 requests finishing every 0.1 s from t = 1: 10 per second, whatever the first and last few do
    done = [Request(i, [1], 1, arrival=0.0, tokens=[1], token_times=[1.0 + 0.1 * i]) for i in range(50)]
    done[0].token_times, done[-1].token_times = [0.2], [30.0]  # a slow start, a straggler
    assert saturation_throughput(done) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="too few"):
        saturation_throughput(done[:3])
