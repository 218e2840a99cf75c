"""ZeRO-1/2/3 held against their references: one device, the paper's formulas, and PyTorch.

- `verify_zero` (`python -m shardlib verify --technique zero1|zero2|zero3`): N ranks vs one
  device on the concatenated batch, with the harness's policy (float64 AdamW); the ledger vs
  2(N-1)/N Psi (stages 1, 2) or 3(N-1)/N Psi (stage 3) elements per rank and step; the bytes each
  rank holds vs shardlib.memory.zero_model_state_bytes (ZeRO paper, arXiv 1910.02054, Figure 1).
- `bench_zero` (`python -m shardlib bench zero`): ours beside torch.distributed's
  ZeroRedundancyOptimizer (stage 1) and FSDP2 `fully_shard` (stage 3), same model and ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlib import memory
from shardlib.checks.harness import BATCH, CHECK_GPT  # noqa: F401 - the models of these checks, for other checks
from shardlib.checks.harness import (ELEMENT_SIZE, LR, RECIPE, STEPS, adamw, batch_split_error, build_check_model,
                                     check_batches, check_model_params, compare_run, cpu_state, interleaved_step_times,
                                     launch_on, mean_losses, reference_run, train_steps, verdict)
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt
from shardlib.parallel.zero_stages import apply_zero, n_flat_buffers, zero_full_state_dict, zero_state_bytes
from shardlib.reference import model_loss, rank_slice

# stage 2 cuts the model into several buckets: 600 (MLP, Psi = 1634) and 12,000 (GPT) elements
STAGE2_BUCKET_CAP_MB = {"mlp": 600 * ELEMENT_SIZE / 2**20, "gpt": 12000 * ELEMENT_SIZE / 2**20}
STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
world_size_error = batch_split_error  # for the registry: which world sizes the checks run on


# ---------------------------------------------------------------------------------
# verify


def _train_on_rank(stage: int, steps: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in ("mlp", "gpt"):
        model = build_check_model(kind).to(current_device())
        optimizer = apply_zero(model, stage, adamw, bucket_cap_mb=STAGE2_BUCKET_CAP_MB[kind] if stage == 2 else None)

        def forward_backward(batch):
            loss = model_loss(model, rank_slice(batch, rank, n))
            loss.backward()
            return loss

        losses, ledgers = train_steps(optimizer, check_batches(kind, steps), forward_backward)
        held = zero_state_bytes(model, optimizer)  # after a step, before zero_grad: what lives between steps
        out[kind] = dict(state=cpu_state(zero_full_state_dict(model, optimizer)), losses=losses, held=held,
                         sent=[ledger.sent_bytes() / ELEMENT_SIZE for ledger in ledgers],  # elements
                         buffers=n_flat_buffers(model, optimizer))
    return out


def verify_zero(world_size: int, technique: str = "zero1", steps: int = STEPS, device: str = "cpu") -> dict:
    """Parameters and losses vs one device, ledger vs 2 or 3 (N-1)/N Psi, bytes held vs the ZeRO formula."""
    if technique not in STAGES:
        raise ValueError(f"technique must be one of {sorted(STAGES)}, got {technique!r}")
    if world_size_error(technique, world_size):
        raise ValueError(world_size_error(technique, world_size))
    stage, n = STAGES[technique], world_size
    per_rank = launch_on(_train_on_rank, n, args=(stage, steps), device=device, timeout=240)
    comparisons, problems, notes = [], [], []
    for kind in ("mlp", "gpt"):
        reference = reference_run(lambda kind=kind: build_check_model(kind), check_batches(kind, steps), device=device)
        losses = mean_losses([r[kind]["losses"] for r in per_rank])  # mean of equal slices
        psi = check_model_params(kind)
        comm = memory.zero_comm_elements(psi, n, stage)
        formula = memory.zero_model_state_bytes(psi, n, stage, recipe=RECIPE)  # float64 AdamW
        for r in per_rank:
            comparisons.append(compare_run(r[kind]["state"], losses, reference["state"], reference["losses"]))
            passes, pad = (3 if stage == 3 else 2), r[kind]["buffers"] * (n - 1)  # padding: < N per buffer
            comm_ok = all(comm - 1e-6 <= s <= comm + passes * pad for s in r[kind]["sent"])
            held = r[kind]["held"]
            pad_bytes = {k: getattr(RECIPE, k) * pad for k in ("params", "grads", "optimizer")}
            memory_ok = all(abs(held[k] - formula[k]) <= 0.05 * formula[k] + pad_bytes[k] for k in pad_bytes)
            if not (comm_ok and memory_ok):
                problems.append(f"{kind}: LEDGER OR BYTES HELD DIFFER from the formulas")
        held0 = per_rank[0][kind]["held"]
        notes.append(f"{kind}: Psi={psi}, sent {per_rank[0][kind]['sent'][0]:.0f} el/step vs {comm:.0f}; "
                     f"held p/g/o {held0['params']}/{held0['grads']}/{held0['optimizer']} B vs "
                     f"{formula['params']:.0f}/{formula['grads']:.0f}/{formula['optimizer']:.0f}")
    return verdict(comparisons, notes, sorted(set(problems)))


# ---------------------------------------------------------------------------------
# bench: ours beside PyTorch's, same model, same ranks, same run


def _torch_zero1(config: GPTConfig):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    model = build_gpt(config, seed=0)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return TorchDDP(model, gradient_as_bucket_view=True), optimizer  # DDP averages, ZeRO shards the step


def _torch_fsdp2(config: GPTConfig):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = build_gpt(config, seed=0)
    for block in model.blocks:
        torch_fully_shard(block)
    torch_fully_shard(model)
    return model, adamw(model.parameters())


def _ours(config: GPTConfig, stage: int):
    model = build_gpt(config, seed=0)
    return model, apply_zero(model, stage, adamw)


def _held(model, optimizer) -> int:
    """Model-state bytes of any of the four (torch's ZeRO keeps its state in .optim, DDP the model in .module)."""
    if hasattr(optimizer, "optim"):
        return memory.model_state_bytes(model.module, optimizer.optim)["total"]
    return zero_state_bytes(model, optimizer)["total"]


def _time_zero_steps(config: GPTConfig, batch_per_rank: int, repeats: int) -> dict:
    """Median step times and bytes held, ours and torch's, steps interleaved so both see the same machine."""
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, config.vocab_size, (batch_per_rank, config.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])  # (B/N, T) each
    runs = {"zero1": {"ours": _ours(config, 1), "torch": _torch_zero1(config)},
            "zero3": {"ours": _ours(config, 3), "torch": _torch_fsdp2(config)}}
    flat = {(case, impl): pair[impl] for case, pair in runs.items() for impl in ("ours", "torch")}
    medians = interleaved_step_times(flat, batch, model_loss, repeats)
    return {key: (seconds, _held(*flat[key])) for key, seconds in medians.items()}


def bench_zero(quick: bool = False) -> list[dict]:
    """shardlib ZeRO-1 vs ZeroRedundancyOptimizer (+DDP), shardlib ZeRO-3 vs FSDP2 fully_shard: GPT, 2 and 4 ranks."""
    config = GPTConfig(seq_len=64, n_layer=4, n_head=4, n_embd=128)
    names = {"zero1": "ZeRO-1 vs ZeroRedundancyOpt", "zero3": "ZeRO-3 vs FSDP2 fully_shard"}
    rows = []
    for world_size in (2, 4):
        per_rank = launch(_time_zero_steps, world_size, args=(config, 4, 3 if quick else 15), timeout=600)
        for case in ("zero1", "zero3"):
            ours_s, theirs_s = (max(r[(case, impl)][0] for r in per_rank) for impl in ("ours", "torch"))
            ours_b, theirs_b = (max(r[(case, impl)][1] for r in per_rank) for impl in ("ours", "torch"))
            case_name = f"{names[case]}, GPT {config.n_params / 1e6:.2f}M, N={world_size}"
            rows.append({"benchmark": "zero", "case": case_name,
                         "ours_s": ours_s, "torch_s": theirs_s, "ratio": ours_s / theirs_s, "target": 1.5,
                         "ours_bytes": ours_b, "torch_bytes": theirs_b, "bytes_ratio": round(ours_b / theirs_b, 3),
                         "bytes_ratio_target": (0.90, 1.10)})
    return rows


CHECKS = {name: (verify_zero, (1, 2, 3, 4)) for name in ("zero1", "zero2", "zero3")}
BENCHMARKS = {"zero": bench_zero}
