"""Queueing formulas for a continuously batched server: where latency turns up (lesson 10).

Model. A server (one replica, a TP group, or a pipeline) runs at most c requests at once (its batch
slots: max_batch, or m * max_batch for a pipeline of m groups in flight). A request holds a slot for
its service time S = n * s: n iterations (its prompt's pass gives the first token, each later pass
one more) of s seconds each. While decoding is memory-bound, s does not depend on how many requests
share the iteration, so the slots work independently: an M/G/c queue (Kendall's notation: Poisson
arrivals, a general service-time distribution, c servers).

    offered load       a = lambda * E[S]      (busy slots on average; utilization rho = a / c)
    capacity           lambda_max = c / E[S]   (requests per second; past it the queue grows without bound)
    P(wait)            C(c, a), Erlang's C formula (exact for M/M/c)
    mean wait          W_q ~ (1 + C_s^2) / 2 * C(c, a) * E[S] / (c - a)
                       (C_s^2 = Var(S) / E[S]^2; the M/M/c wait scaled by (1 + C_s^2) / 2, the
                       Lee-Longton approximation, exact for c = 1: the Pollaczek-Khinchine formula)
    mean latency       E[S] + W_q + s / 2   (an arrival also waits on average half an iteration
                       for the current one to end before it can be admitted)

Replicas. How d replicas of c slots each share one stream decides which queue they are:
    router="random"    each request goes to a replica drawn at random on arrival (what
                       shardlib.inference.under_load builds): d independent M/G/c queues, each fed
                       lambda / d (splitting a Poisson process gives Poisson processes). Capacity
                       d * c / E[S]; latency at lambda that of ONE replica at lambda / d.
    router="central"   one queue in front of all replicas, each request handed to the first slot
                       that frees anywhere: one M/G/(d * c) queue fed lambda. Same capacity, but a
                       queue forms only when all d * c slots are busy, so latency stays low closer
                       to capacity.

Assumptions to keep in mind: Poisson arrivals; s constant (memory-bound, no KV-cache limit binding
before the slots do). `predicted_knee`: the offered load at which mean latency reaches `factor` times
its value with no queue; for an M/G/c it sits closer to capacity the more slots share one queue
(for a factor of 1.5 and the lesson's output lengths: 91% of capacity at c = 8, 97% at c = 32). A
random router over d replicas of 8 slots keeps one replica's 91%; a central queue over them reaches
the 97% of 32 slots.
"""

from __future__ import annotations

import math

__all__ = ["ROUTERS", "erlang_c", "mean_wait", "mean_latency", "capacity", "predicted_knee"]

ROUTERS = ("random", "central")


def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with offered load a = lambda * E[S] < c."""
    if a >= c:
        return 1.0
    term, total = 1.0, 1.0  # a^k / k!, summed for k < c
    for k in range(1, c):
        term *= a / k
        total += term
    last = term * a / c / (1 - a / c)  # a^c / c! * c / (c - a)
    return last / (total + last)


def mean_wait(rate: float, c: int, mean_service: float, scv: float) -> float:
    """Mean time in the queue of an M/G/c server (Lee-Longton); inf at or past capacity."""
    a = rate * mean_service
    if a >= c:
        return math.inf
    return (1 + scv) / 2 * erlang_c(c, a) * mean_service / (c - a)


def _queue(rate: float, c: int, replicas: int, router: str) -> tuple[float, int]:
    """(arrival rate, slots) of the one M/G/c queue a request joins (see Replicas above)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return (rate / replicas, c) if router == "random" else (rate, c * replicas)


def mean_latency(rate: float, c: int, step_s: float, mean_tokens: float, var_tokens: float, *,
                 replicas: int = 1, router: str = "random") -> float:
    """Mean end-to-end latency of requests of n tokens (mean, variance) at `rate` requests/s on `replicas`
    servers of c slots each, iterations of step_s, shared through `router` ("random" or "central")."""
    rate, c = _queue(rate, c, replicas, router)
    mean_service = mean_tokens * step_s
    return mean_service + mean_wait(rate, c, mean_service, var_tokens / mean_tokens ** 2) + step_s / 2


def capacity(c: int, step_s: float, mean_tokens: float, *, replicas: int = 1) -> float:
    """Requests per second `replicas` servers of c slots can serve: replicas * c / E[S] (either router)."""
    return replicas * c / (mean_tokens * step_s)


def predicted_knee(c: int, step_s: float, mean_tokens: float, var_tokens: float, factor: float = 2.0, *,
                   replicas: int = 1, router: str = "random") -> float:
    """The offered load at which `mean_latency` reaches `factor` times its no-queue value (bisection)."""
    def latency(rate):
        return mean_latency(rate, c, step_s, mean_tokens, var_tokens, replicas=replicas, router=router)

    target = factor * latency(0.0)
    low, high = 0.0, capacity(c, step_s, mean_tokens, replicas=replicas)
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if latency(mid) < target else (low, mid)
    return low
