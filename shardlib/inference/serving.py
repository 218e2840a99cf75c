"""Sharded inference measured: one generation workload served by each layout on N CPU ranks.

`serve(layout, N, config, prompts, n)` launches N ranks, generates n tokens for every prompt with
shardlib.inference.generate under the layout ("single", "tp", "dp" or "pp"), and returns the token ids with
what was measured: tokens per second over all requests, latency per token (the time between two
tokens of one request), time to the first token, and each rank's bytes sent per decode step from
the communication ledger. `decode_traffic` is the formula the ledger is held against (see
shardlib/inference/generate.py). `python -m shardlib bench inference` runs every layout at 1, 2 and 4 ranks
beside one device and checks that the token ids are the single device's.

On CPU ranks the timings measure this machine: 1 thread per rank, ranks sharing its cores and
a gloo message costing tens to hundreds of microseconds. `emulated=EmulatedDevice(...)` gives each
forward pass the duration a memory-bandwidth- or compute-bound accelerator would take (the ranks
sleep out the rest), to see how the layouts compare when ranks do not share cores.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from shardlib.comm import comm_ledger
from shardlib.inference.generate import EmulatedDevice, generate, generate_pipelined
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt, load_course_text
from shardlib.parallel.pipeline import gpt_stage
from shardlib.parallel.tensor_gpt import check_tp_config, parallelize_gpt

__all__ = ["LAYOUTS", "course_prompts", "check_layout", "serve", "decode_traffic", "sweep"]

LAYOUTS = ("single", "tp", "dp", "pp")


def course_prompts(n_requests: int, length: int, seed: int = 0) -> torch.Tensor:
    """`n_requests` windows of `length` bytes of the course text: (n_requests, length) token ids."""
    tokens = load_course_text()
    starts = torch.randint(0, len(tokens) - length, (n_requests,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([tokens[i: i + length] for i in starts.tolist()])  # (b, T0)


def check_layout(layout: str, world_size: int, config: GPTConfig, prompts: torch.Tensor, max_new_tokens: int,
                 n_microbatches: int = 1) -> None:
    """Raise ValueError, saying what to change, before any process starts."""
    n_requests = prompts.shape[0]
    if prompts.dim() != 2 or prompts.dtype != torch.long:
        raise ValueError(f"prompts must be (requests, length) token ids (torch.long), got {tuple(prompts.shape)} "
                         f"{prompts.dtype}")
    if max_new_tokens < 1 or prompts.shape[1] + max_new_tokens > config.seq_len:
        raise ValueError(f"a prompt of {prompts.shape[1]} + {max_new_tokens} new tokens must fit seq_len="
                         f"{config.seq_len} (and max_new_tokens >= 1): shorten one or the other")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "single" and world_size != 1:
        raise ValueError("the single-device layout runs on 1 rank")
    if layout == "tp":
        check_tp_config(config, world_size)
    if layout == "dp" and n_requests % world_size:
        raise ValueError(f"{n_requests} requests do not split over {world_size} replicas: use a multiple")
    if layout == "pp" and world_size > config.n_layer:
        raise ValueError(f"{config.n_layer} layers cannot fill {world_size} pipeline stages")
    if n_requests % n_microbatches or (n_microbatches > 1 and layout != "pp"):
        raise ValueError(f"n_microbatches={n_microbatches}: only the pp layout takes groups of requests in "
                         f"flight, and they must divide the {n_requests} requests")


def _serve_on_rank(layout: str, config: GPTConfig, prompts: torch.Tensor, max_new_tokens: int,
                   n_microbatches: int, repeats: int, reference: bool, emulated: EmulatedDevice | None) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_gpt(config, seed=0).to(current_device()).eval()
    prompts = prompts.to(current_device())
    if layout == "tp":
        tp_model = parallelize_gpt(model)
        run = lambda ledger=None: generate(tp_model, prompts, max_new_tokens, emulated=emulated, ledger=ledger)  # noqa: E731
    elif layout == "pp":
        stage = gpt_stage(model, rank, n)
        run = lambda ledger=None: generate_pipelined(stage, prompts, max_new_tokens, n_microbatches,  # noqa: E731
                                                     emulated=emulated, ledger=ledger)
    else:  # single device, or one replica among n: its contiguous share of the requests
        share = prompts.chunk(n)[rank]  # (b/d, T0)
        run = lambda ledger=None: generate(model, share, max_new_tokens, emulated=emulated, ledger=ledger)  # noqa: E731
    for _ in range(repeats):  # warm-up runs
        dist.barrier()
        run()
    dist.barrier()
    with comm_ledger() as ledger:
        result = run(ledger)
    result.caches = []  # stays on its rank
    result.ids = None if result.ids is None else result.ids.cpu()
    out = dict(generation=result)
    if layout == "single" and reference:  # the model's own greedy decoding, no cache: the reference ids
        out["reference"] = model.generate(prompts, max_new_tokens).cpu()
    return out


def serve(layout: str, world_size: int, config: GPTConfig, prompts: torch.Tensor, max_new_tokens: int,
          n_microbatches: int = 1, repeats: int = 1, reference: bool = True,
          emulated: EmulatedDevice | None = None, device: str = "auto") -> dict:
    """Generate `max_new_tokens` for every prompt with `layout` on `world_size` ranks, and measure.

    Returns ids (b, T0 + n); tokens_per_s (all requests' new tokens / wall time, first prefill to last
    token); latency_s (median time between two tokens of one request); first_token_s (prefill);
    decode_sent_bytes (per rank, bytes sent per decode step, from the ledger); decode_records (rank 0's
    ledger of decode steps, as (kind, bytes)); and, single layout with `reference`, reference: the ids of
    GPT.generate (no cache, the whole sequence recomputed per token: slow for big models).
    repeats: warm-up runs before the measured one. emulated: see shardlib.inference.generate.EmulatedDevice.
    device: where the ranks run, as shardlib.launch's ("auto": GPUs when there are enough, else CPU)."""
    check_layout(layout, world_size, config, prompts, max_new_tokens, n_microbatches)
    per_rank = launch(_serve_on_rank, world_size, args=(layout, config, prompts, max_new_tokens, n_microbatches,
                                                         repeats, reference, emulated), timeout=600, device=device)
    gens = [r["generation"] for r in per_rank]
    if layout == "dp":
        ids = torch.cat([g.ids for g in gens])
    else:
        ids = next(g.ids for g in reversed(gens) if g.ids is not None)
        if layout == "tp" and not all(torch.equal(g.ids, ids) for g in gens):
            raise RuntimeError("tensor-parallel ranks disagree on the generated tokens")
    start = min(g.start for g in gens)
    last_token = max(t[-1] for g in gens for t in g.token_times)
    gaps = [b - a for g in gens for t in g.token_times for a, b in zip(t, t[1:])]
    steps = max(max_new_tokens - 1, 1)
    out = dict(layout=layout, ranks=world_size, n_microbatches=n_microbatches, ids=ids,
               tokens_per_s=prompts.shape[0] * max_new_tokens / (last_token - start),
               latency_s=statistics.median(gaps) if gaps else float("nan"),
               first_token_s=min(t[0] for g in gens for t in g.token_times) - start,
               decode_sent_bytes=[sum(r.sent_bytes for r in g.decode) / steps for g in gens],
               decode_records=[(r.kind, r.nbytes) for r in gens[0].decode])
    if "reference" in per_rank[0]:
        out["reference"] = per_rank[0]["reference"]
    return out


def decode_traffic(layout: str, world_size: int, config: GPTConfig, n_requests: int) -> list[float]:
    """Bytes each rank sends per decode step (fp32 activations, int64 token ids), from the formulas above."""
    b, h, V, L, n = n_requests, config.n_embd, config.vocab_size, config.n_layer, world_size
    if layout == "tp" and n > 1:
        return [4 * ((2 * L + 1) * 2 * (n - 1) / n * b * h + (n - 1) / n * b * V)] * n
    if layout == "pp" and n > 1:
        return [4 * b * h] * (n - 1) + [8 * b]
    return [0.0] * n


# ---------------------------------------------------------------------------------
# bench


BENCH_GPT = GPTConfig(seq_len=64, n_layer=4, n_head=8, n_embd=256)  # 3.3M parameters, 13 MB in fp32
# An accelerator scaled down to that model: reading its 13 MB of weights takes 53 ms, and it computes
# 2 FLOPs per weight and token at 5 GFLOP/s, so a pass is memory-bound below 2 * 5e9 / 0.25e9 = 40
# tokens (fp32) and compute-bound above. (An H100 in bf16: 989 TFLOP/s over 3.35 TB/s, ~300 tokens.)
EMULATED = EmulatedDevice(memory_bandwidth=0.25e9, flops=5e9)
# (name, emulated device or None, requests, prompt length, new tokens)
WORKLOADS = [("cpu", None, 8, 16, 32), ("memory-bound", EMULATED, 8, 8, 16), ("compute-bound", EMULATED, 64, 4, 16)]
SCALING = [("single", 1, 1), ("tp", 2, 1), ("tp", 4, 1), ("dp", 2, 1), ("dp", 4, 1),
           ("pp", 2, 1), ("pp", 2, 2), ("pp", 4, 1), ("pp", 4, 4)]


def sweep(workload: tuple, cases=SCALING, config: GPTConfig = BENCH_GPT, repeats: int = 1,
          device: str = "auto") -> list[dict]:
    """serve() for every (layout, N, m) of `cases` on one workload; each result gains `identical`:
    its ids equal GPT.generate's on one device."""
    _, emulated, n_requests, prompt_len, new_tokens = workload
    prompts = course_prompts(n_requests, prompt_len)
    results, reference = [], None
    for layout, n, m in cases:
        result = serve(layout, n, config, prompts, new_tokens, m, repeats=repeats, reference=reference is None,
                       emulated=emulated, device=device)
        reference = result.pop("reference", reference)
        results.append(result)
    for result in results:
        result["identical"] = bool(torch.equal(result["ids"], reference))
    return results
