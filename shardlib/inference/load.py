"""Load for a server: requests arriving over time, and what each one experienced (lesson 10).

Arrivals. `poisson_requests(rate, n)`: a Poisson process of `rate` requests per second (independent
exponential gaps of mean 1/rate: many users acting independently), bounded at n requests.
`day_trace(duration, base_rate, peak_rate)`: a day compressed into `duration` seconds, its rate
rising from `base_rate` at night to `peak_rate` at midday,
    rate(t) = base + (peak - base) * ((1 - cos(2 pi t / duration)) / 2)^2,
drawn as a non-homogeneous Poisson process by thinning (Lewis and Shedler, 1979).

Lengths. Prompt and output lengths are whole numbers drawn uniformly from [low, high] (stated per
call); prompts are windows of the course text; a request generates exactly its output length (no
end-of-text token), as serving benchmarks do when they ignore the end token. Everything is drawn
from `seed`: the same call gives the same requests.

Per request (times from the request's arrival):
    TTFT   time to first token: queueing + admission + the prompt's pass
    TPOT   time per output token after the first: (last token - first token) / (n - 1)
    E2E    end-to-end latency: last token - arrival
Per run: p50 and p99 of each, throughput (new tokens per second and requests per second, over the
span from the first arrival to the last token) and SLO attainment: the share of requests whose TTFT
and TPOT both meet their objectives (the metric of DistServe, Zhong et al., arXiv 2401.09670).
`saturation_throughput`: a server's capacity, measured from a run offered more than it can serve: the
rate at which requests complete between the 10th and the 90th percentile of completions, while the
server is full.
"""

from __future__ import annotations

import math

import torch

from shardlib.inference.batching import Request
from shardlib.models import load_course_text

__all__ = ["poisson_requests", "day_rate", "day_trace", "ttft", "tpot", "e2e", "percentile", "summarize",
           "saturation_throughput"]


def _draw_requests(arrivals: list[float], prompt_len: tuple[int, int], output_len: tuple[int, int],
                   generator: torch.Generator) -> list[Request]:
    for low, high in (prompt_len, output_len):
        if not 1 <= low <= high:
            raise ValueError(f"a length range must be 1 <= low <= high, got ({low}, {high})")
    text = load_course_text()
    n = len(arrivals)
    prompts = torch.randint(prompt_len[0], prompt_len[1] + 1, (n,), generator=generator).tolist()
    outputs = torch.randint(output_len[0], output_len[1] + 1, (n,), generator=generator).tolist()
    starts = torch.randint(0, len(text) - prompt_len[1], (n,), generator=generator).tolist()
    return [Request(i, text[s: s + T0].tolist(), n_out, arrival=t)
            for i, (t, T0, n_out, s) in enumerate(zip(arrivals, prompts, outputs, starts))]


def poisson_requests(rate: float, n_requests: int, *, prompt_len: tuple[int, int] = (4, 16),
                     output_len: tuple[int, int] = (4, 12), seed: int = 0) -> list[Request]:
    """`n_requests` requests arriving as a Poisson process of `rate` per second, the first after one gap."""
    if rate <= 0 or n_requests < 1:
        raise ValueError(f"rate must be > 0 and n_requests >= 1, got {rate} and {n_requests}")
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n_requests, dtype=torch.float64).exponential_(rate, generator=g)  # mean 1/rate each
    return _draw_requests(gaps.cumsum(0).tolist(), prompt_len, output_len, g)


def day_rate(t: float, duration: float, base_rate: float, peak_rate: float) -> float:
    """Requests per second at time t of a day compressed into `duration` seconds (peak at duration / 2)."""
    return base_rate + (peak_rate - base_rate) * ((1 - math.cos(2 * math.pi * t / duration)) / 2) ** 2


def day_trace(duration: float, base_rate: float, peak_rate: float, *, prompt_len: tuple[int, int] = (4, 16),
              output_len: tuple[int, int] = (4, 12), seed: int = 0) -> list[Request]:
    """A day of requests: Poisson arrivals at day_rate(t), by thinning a Poisson process of peak_rate."""
    if not 0 <= base_rate <= peak_rate or peak_rate <= 0 or duration <= 0:
        raise ValueError(f"need 0 <= base_rate <= peak_rate, peak_rate > 0, duration > 0; got {base_rate}, "
                         f"{peak_rate}, {duration}")
    g = torch.Generator().manual_seed(seed)
    arrivals, t = [], 0.0
    while True:
        t += torch.empty(1, dtype=torch.float64).exponential_(peak_rate, generator=g).item()
        if t >= duration:
            break
        if torch.rand(1, generator=g, dtype=torch.float64).item() * peak_rate < day_rate(t, duration, base_rate,
                                                                                         peak_rate):
            arrivals.append(t)  # kept with probability rate(t) / peak_rate
    return _draw_requests(arrivals, prompt_len, output_len, g)


# ---------------------------------------------------------------------------------
# what each request experienced


def ttft(r: Request) -> float:
    return r.token_times[0] - r.arrival


def tpot(r: Request) -> float:
    return (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) if len(r.token_times) > 1 else 0.0


def e2e(r: Request) -> float:
    return r.token_times[-1] - r.arrival


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    return torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100).item()


def summarize(requests: list[Request], *, ttft_slo: float, tpot_slo: float) -> dict:
    """p50/p99 of TTFT, TPOT and E2E (seconds), throughput, and the share of requests meeting both SLOs."""
    done = [r for r in requests if r.done]
    if len(done) != len(requests):
        raise ValueError(f"{len(requests) - len(done)} of {len(requests)} requests did not finish")
    out = {"requests": len(done)}
    for name, metric in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        values = [metric(r) for r in done]
        out.update({f"{name}_p50": percentile(values, 50), f"{name}_p99": percentile(values, 99),
                    f"{name}_mean": sum(values) / len(values)})
    span = max(r.token_times[-1] for r in done) - min(r.arrival for r in done)
    out["tokens_per_s"] = sum(len(r.tokens) for r in done) / span
    out["requests_per_s"] = len(done) / span
    out["slo_attainment"] = sum(ttft(r) <= ttft_slo and tpot(r) <= tpot_slo for r in done) / len(done)
    return out


def saturation_throughput(requests: list[Request]) -> float:
    """Requests completed per second between the 10% and the 90% completion (run offered more than the
    server can take, so that it is full all that time): its capacity."""
    if len(requests) < 20:
        raise ValueError(f"{len(requests)} requests are too few to measure a rate: use 20 or more")
    finishes = sorted(r.token_times[-1] for r in requests)
    first, last = len(finishes) // 10, len(finishes) - 1 - len(finishes) // 10
    return (last - first) / (finishes[last] - finishes[first])
