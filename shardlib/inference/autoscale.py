"""Autoscaling replicas through a day of traffic, against fixed provisioning (lesson 10).

Traffic to a chatbot follows the day: quiet at night, a peak at midday. Provisioning for the peak
all day pays for idle devices most of the time; provisioning for the mean misses the SLO at the peak.
An autoscaler follows the load, here with a rule on measured tail latency, evaluated every `window`
seconds over the requests whose first token came in the last window:

    p99 TTFT > up * SLO     add a replica (it takes traffic `warmup_windows` later: loading weights)
    p99 TTFT < down * SLO   in each of the last `calm_windows` windows: remove one (it takes no new
                            requests, and is paid one more window to drain)

between min_replicas and max_replicas. Cost is device-hours: provisioned replicas times time, the
compressed day scaled back to 24 hours. Real autoscalers (Kubernetes' HPA, KServe, SageMaker) apply
the same kind of rule to a metric (queue length, latency, utilization) with cool-downs; their
warm-up is minutes, since a 70B model's 140 GB must be loaded.

`serve_day(config, trace, ...)` launches max_replicas ranks; each is a replica running
shardlib.inference.batching's server on the whole trace, taking the requests the router gives it:
each request goes, on arrival, to a replica drawn at random (seeded) among those taking traffic, and
stays there. At each window's end every rank joins one all-gather of the TTFTs it measured in the
window (N float64 per rank, N = requests in the trace, unused entries NaN), so all ranks see the same
p99 and take the same decision. Memory per device: a whole replica, Psi and the KV cache of its own
requests; communication: that one all-gather per window, nothing per token.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardlib.comm import ops
from shardlib.inference.batching import Request, Scheduler, run_engine
from shardlib.inference.generate import EmulatedDevice
from shardlib.inference.kv_cache import PagedKVCache
from shardlib.inference.load import percentile
from shardlib.inference.under_load import shared_start
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt

__all__ = ["AutoscalePolicy", "Autoscaler", "serve_day"]


@dataclass(frozen=True)
class AutoscalePolicy:
    ttft_slo: float  # seconds
    min_replicas: int = 1
    max_replicas: int = 4
    up: float = 0.3  # add a replica when p99 TTFT > up * ttft_slo
    down: float = 0.2  # remove one when p99 TTFT < down * ttft_slo
    warmup_windows: int = 1
    calm_windows: int = 4  # scale down only after this many calm windows in a row (no flapping)

    def __post_init__(self):
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if not 0 <= self.down < self.up:
            raise ValueError(f"need 0 <= down < up, got down={self.down}, up={self.up}")


class Autoscaler:
    """Per window: replicas provisioned (paid: serving, warming up or draining), replicas taking traffic
    (replicas 0..n-1), and the p99 TTFT measured in it. Scale-ups may follow each other while replicas
    warm up; a scale-up during a drain takes the draining replica back (its weights are still loaded); a
    scale-down waits for calm_windows calm windows without any change (Kubernetes' autoscaler calls this
    a stabilization window). `policy=None` with `replicas=n`: n, fixed."""

    def __init__(self, policy: AutoscalePolicy | None, replicas: int | None = None):
        if (policy is None) == (replicas is None):
            raise ValueError("give an AutoscalePolicy, or a fixed number of replicas, not both")
        self.policy, self.serving = policy, replicas if policy is None else policy.min_replicas
        self.warming: list[int] = []  # the windows at which replicas being added start taking traffic
        self.draining_until: int | None = None  # the window at which the replica being removed is let go
        self.provisioned, self.routable, self.p99 = [self.serving], [self.serving], []

    @property
    def max_replicas(self) -> int:
        return self.serving if self.policy is None else self.policy.max_replicas

    def end_window(self, p99: float) -> None:
        """The window just ended with this p99 TTFT (NaN: no first token in it): set up the next one."""
        window, policy = len(self.routable), self.policy
        self.p99.append(p99)
        self.serving += sum(w <= window for w in self.warming)
        self.warming = [w for w in self.warming if w > window]
        if self.draining_until is not None and self.draining_until <= window:
            self.draining_until = None
        if policy is not None and not math.isnan(p99):
            if p99 > policy.up * policy.ttft_slo and self.serving + len(self.warming) < policy.max_replicas:
                if self.draining_until is not None or policy.warmup_windows == 0:
                    self.serving, self.draining_until = self.serving + 1, None
                else:
                    self.warming.append(window + policy.warmup_windows)
            elif (self.serving > policy.min_replicas and not self.warming and self.draining_until is None
                  and self._calm(policy)):
                self.serving, self.draining_until = self.serving - 1, window + 1
        self.provisioned.append(self.serving + len(self.warming) + (self.draining_until is not None))
        self.routable.append(self.serving)

    def _calm(self, policy: AutoscalePolicy) -> bool:
        """p99 below down * SLO (or NaN) in each of the last calm_windows windows, with no change among them."""
        recent = self.p99[-policy.calm_windows:]
        unchanged = all(len(set(counts[-policy.calm_windows:])) == 1 for counts in (self.provisioned, self.routable))
        return (len(recent) == policy.calm_windows and unchanged
                and all(math.isnan(p) or p < policy.down * policy.ttft_slo for p in recent))


def _window_p99(requests: list[Request], begin: float, end: float, group=None) -> float:
    """p99 TTFT over every rank's requests whose first token came in [begin, end): one all-gather."""
    mine = [r.token_times[0] - r.arrival for r in requests if r.token_times and begin <= r.token_times[0] < end]
    slots = torch.full((len(requests),), math.nan, dtype=torch.float64, device=current_device())  # (N,) NaN: unused
    slots[:len(mine)] = torch.tensor(mine, dtype=torch.float64)
    gathered = [torch.empty_like(slots) for _ in range(dist.get_world_size(group))]
    ops.all_gather(gathered, slots, group=group)  # every rank's (N,)
    values = torch.cat(gathered)
    return percentile(values[~values.isnan()].tolist(), 99)


def _day_on_rank(config, trace, policy, replicas, window, duration, max_batch, kv_blocks, block_size, emulated,
                 seed):
    rank = dist.get_rank()
    model = build_gpt(config, seed=0).to(current_device()).eval()
    requests = copy.deepcopy(trace)
    draws = torch.rand(len(requests), generator=torch.Generator().manual_seed(seed)).tolist()
    uniform = {r.id: u for r, u in zip(sorted(requests, key=lambda r: r.id), draws)}
    scaler = Autoscaler(policy, replicas)
    n_windows = math.ceil(duration / window)

    def route(request: Request) -> bool:  # uniformly among the replicas taking traffic in its window
        k = min(int(request.arrival // window), len(scaler.routable) - 1)
        return int(uniform[request.id] * scaler.routable[k]) == rank

    def tick(now: float) -> float:  # at each window's end: measure, decide
        while len(scaler.routable) < n_windows and now >= len(scaler.routable) * window:
            k = len(scaler.routable)
            scaler.end_window(_window_p99(requests, (k - 1) * window, k * window))
        return len(scaler.routable) * window if len(scaler.routable) < n_windows else math.inf

    warm_up = Scheduler(PagedKVCache(model, kv_blocks, block_size), max_batch)
    run_engine(model, [Request(-1, [1, 2, 3], 2)], warm_up)  # first calls into torch are slow
    dist.barrier()
    scheduler = Scheduler(PagedKVCache(model, kv_blocks, block_size), max_batch)
    served = run_engine(model, requests, scheduler, emulated=emulated, start_time=shared_start(), route=route,
                        tick=tick)
    return {"served": served, "provisioned": scaler.provisioned, "routable": scaler.routable, "p99": scaler.p99}


def serve_day(config: GPTConfig, trace: list[Request], *, window: float, duration: float,
              policy: AutoscalePolicy | None = None, replicas: int | None = None, max_batch: int = 8,
              kv_blocks: int = 64, block_size: int = 16, emulated: EmulatedDevice | None = None, seed: int = 0,
              device: str = "auto", timeout: float = 600.0) -> dict:
    """Serve a day's trace with autoscaled replicas (`policy`) or a fixed number (`replicas`).
    Returns requests (all, in order of arrival), and per window: provisioned, routable, p99 (TTFT, s),
    and device_hours."""
    scaler = Autoscaler(policy, replicas)  # checks the arguments before any process starts
    if window <= 0 or duration < window:
        raise ValueError(f"need 0 < window <= duration, got window={window}, duration={duration}")
    per_rank = launch(_day_on_rank, scaler.max_replicas,
                      args=(config, trace, policy, replicas, window, duration, max_batch, kv_blocks, block_size,
                            emulated, seed), device=device, timeout=timeout)
    first = per_rank[0]
    served = sorted((r for result in per_rank for r in result["served"]), key=lambda r: r.arrival)
    if len(served) != len(trace):
        raise RuntimeError(f"{len(served)} of {len(trace)} requests were served: the router lost some")
    hours = sum(first["provisioned"]) * window / duration * 24
    return {"requests": served, "provisioned": first["provisioned"], "routable": first["routable"],
            "p99": first["p99"], "device_hours": hours}
