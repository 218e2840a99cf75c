"""Checks and benchmark of shardlib.parallel.ddp (`python -m shardlib verify --technique dp|ddp`,
`python -m shardlib bench ddp`).

verify: N ranks against one device trained on the concatenated batch, on the MLP and the GPT,
after 5 AdamW steps with the harness's policy (shardlib/checks/harness.py: float64, parameters and
losses within 1e-5 relative), and the ledger's bytes per rank per step against the ring all-reduce's
2(N-1)/N * Psi elements (8 bytes each in float64).
bench: shardlib's DistributedDataParallel beside torch.nn.parallel.DistributedDataParallel, same
model, same ranks, steps interleaved, median step times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlib.checks.harness import (ELEMENT_SIZE, STEPS, adamw, batch_split_error, build_check_model, check_batches,
                                     check_model_params, compare_run, cpu_state, interleaved_step_times, launch_on,
                                     mean_losses, reference_run, train_steps, verdict)
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt
from shardlib.parallel.ddp import DistributedDataParallel, all_reduce_gradients
from shardlib.reference import model_loss, rank_slice

world_size_error = batch_split_error  # for the registry: which world sizes the checks run on


def _train_on_rank(technique: str, steps: int, bucket_cap_mb: float) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in ("mlp", "gpt"):
        # DDP: replicas start from different seeds; the broadcast when wrapping must make them equal
        model = build_check_model(kind, seed=0 if technique == "dp" else rank).to(current_device())
        wrapped = DistributedDataParallel(model, bucket_cap_mb) if technique == "ddp" else model
        optimizer = adamw(model.parameters())

        def forward_backward(batch):
            loss = model_loss(wrapped, rank_slice(batch, rank, n))
            loss.backward()
            if technique == "dp":
                all_reduce_gradients(model)
            return loss

        losses, ledgers = train_steps(optimizer, check_batches(kind, steps), forward_backward)
        out[kind] = dict(state=cpu_state(model.state_dict()), losses=losses,
                         ledger=[(led.sent_bytes(), led.bytes("all_reduce"), led.calls()) for led in ledgers])
    return out


def verify_data_parallel(world_size: int, technique: str = "ddp", steps: int = STEPS, bucket_cap_mb: float = 0.02,
                         device: str = "cpu") -> dict:
    """N ranks vs one device on the concatenated batch: parameters and losses after `steps` AdamW
    steps, on the MLP and the GPT; ledger bytes per rank per step vs 2(N-1)/N * Psi * 8 (float64)."""
    if technique not in ("dp", "ddp"):
        raise ValueError(f"technique must be 'dp' or 'ddp', got {technique!r}")
    if world_size_error(technique, world_size):
        raise ValueError(world_size_error(technique, world_size))
    per_rank = launch_on(_train_on_rank, world_size, args=(technique, steps, bucket_cap_mb), device=device, timeout=240)
    n, comparisons, problems, notes = world_size, [], [], []
    for kind in ("mlp", "gpt"):
        reference = reference_run(lambda kind=kind: build_check_model(kind), check_batches(kind, steps), device=device)
        losses = mean_losses([r[kind]["losses"] for r in per_rank])  # mean of equal slices
        comparisons += [compare_run(r[kind]["state"], losses, reference["state"], reference["losses"])
                        for r in per_rank]
        psi_bytes = check_model_params(kind) * ELEMENT_SIZE
        expected = 2 * (n - 1) / n * psi_bytes
        # every gradient reduced exactly once; the ledger rounds each call down to a whole byte
        if not all(reduced == psi_bytes and expected - calls <= sent <= expected
                   for sent, reduced, calls in (step for r in per_rank for step in r[kind]["ledger"])):
            problems.append(f"{kind}: LEDGER DIFFERS from the formula")
        sent, _, calls = per_rank[0][kind]["ledger"][0]
        notes.append(f"{kind}: Psi={check_model_params(kind)}, sent {sent} B/step/rank in {calls} calls vs "
                     f"2(N-1)/N*Psi*{ELEMENT_SIZE} = {expected:.0f}")
    return verdict(comparisons, notes, problems)


def _time_steps(config: GPTConfig, batch_per_rank: int, bucket_cap_mb: float, repeats: int) -> dict:
    """Median step time of ours and torch's DDP on the same model, steps interleaved."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, config.vocab_size, (batch_per_rank, config.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])  # (B/N, T) each
    runs = {}
    for name, wrap in (("ours", DistributedDataParallel), ("torch", TorchDDP)):
        model = build_gpt(config, seed=0)
        runs[name] = (wrap(model, bucket_cap_mb=bucket_cap_mb), adamw(model.parameters()))
    return interleaved_step_times(runs, batch, model_loss, repeats)


def bench_ddp(quick: bool = False) -> list[dict]:
    """shardlib DDP vs torch.nn.parallel.DistributedDataParallel: GPT training step, 2 and 4 ranks."""
    config = GPTConfig(seq_len=64, n_layer=4, n_head=4, n_embd=128)
    rows = []
    for world_size in (2, 4):
        per_rank = launch(_time_steps, world_size, args=(config, 4, 1.0, 3 if quick else 15), timeout=600)
        ours, theirs = max(r["ours"] for r in per_rank), max(r["torch"] for r in per_rank)
        rows.append({"benchmark": "ddp", "case": f"GPT {config.n_params / 1e6:.2f}M, N={world_size} gloo",
                     "ours_s": ours, "torch_s": theirs, "ratio": ours / theirs, "target": 1.2,
                     "bucket_cap_mb": 1.0})
    return rows


CHECKS = {"dp": (verify_data_parallel, (1, 2, 3, 4)), "ddp": (verify_data_parallel, (1, 2, 3, 4))}
BENCHMARKS = {"ddp": bench_ddp}
