"""ZeRO-1/2/3 held against their references: one device, the paper's formulas, and PyTorch.

- `verify_zero` (`python -m shardlib verify --technique zero1|zero2|zero3`): N ranks vs one
  device on the concatenated batch, AdamW; the ledger vs 2(N-1)/N Psi (stages 1, 2) or
  3(N-1)/N Psi (stage 3) elements per rank and step; the bytes each rank holds vs
  shardlib.memory.zero_model_state_bytes (ZeRO paper, arXiv 1910.02054, Figure 1).
- `bench_zero` (`python -m shardlib bench zero`): ours beside torch.distributed's
  ZeroRedundancyOptimizer (stage 1) and FSDP2 `fully_shard` (stage 3), same model and ranks.
- `measure_zero_memory` and `plot_zero_memory`: the per-rank memory picture of lesson 03.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlib import memory
from shardlib.checks.harness import interleaved_step_times
from shardlib.comm import comm_ledger
from shardlib.launch import launch
from shardlib.models import GPTConfig, build_gpt, build_mlp, mlp_batch, random_token_batches
from shardlib.parallel.zero_stages import apply_zero, n_flat_buffers, zero_full_state_dict, zero_state_bytes
from shardlib.reference import INERT_KEY_BIAS, compare_state, model_loss, rank_slice, train_reference

MLP = dict(d_in=13, hidden=29, n_blocks=2, n_out=3)  # Psi = 1634: N = 3 and 4 need padding
GPT = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)  # Psi = 42368; units pad at N = 3
# The key bias's gradient is rounding noise (reference.INERT_KEY_BIAS); after Adam it is noise
# of about lr/1000 here, so it is checked to stay that small (a real gradient would move it by
# ~lr per step) instead of relative to itself.
# Adam's first steps move each element by about lr * sign(gradient), so where a gradient is
# near zero a rounding difference of 1e-7 (another summation order) becomes a difference of
# up to lr. On the GPT, lr = 1e-2 turns that into ~2e-5 relative (measured), lr = 3e-4 into ~3e-6.
# Adam also ignores a constant factor on the gradients: the tests repeat the check with SGD.
LR = {"mlp": 1e-2, "gpt": 3e-4}


def build(kind: str, seed: int = 0) -> nn.Module:
    return build_mlp(seed, **MLP) if kind == "mlp" else build_gpt(GPT, seed=seed)


def n_params(kind: str) -> int:
    """Psi from the models' formulas (not from the code under test)."""
    if kind == "gpt":
        return GPT.n_params
    d, h, blocks, out = MLP["d_in"], MLP["hidden"], MLP["n_blocks"], MLP["n_out"]
    return blocks * (2 * d * h + h + d) + d * out + out


def global_batches(kind: str, steps: int, batch_size: int = 12) -> list:
    """The same global batches on every rank and on the reference; 12 splits over N = 1, 2, 3, 4."""
    if kind == "mlp":
        return [mlp_batch(batch_size, d_in=MLP["d_in"], n_out=MLP["n_out"], seed=step) for step in range(steps)]
    return random_token_batches(GPT, batch_size, steps)


# ---------------------------------------------------------------------------------
# verify


def _train_on_rank(stage: int, steps: int, bucket_numel: dict) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in ("mlp", "gpt"):
        model = build(kind)
        optimizer = apply_zero(model, stage, torch.optim.AdamW, lr=LR[kind], bucket_numel=bucket_numel.get(kind))
        losses, sent = [], []
        for batch in global_batches(kind, steps):
            optimizer.zero_grad()
            with comm_ledger() as ledger:
                loss = model_loss(model, rank_slice(batch, rank, n))
                loss.backward()
                optimizer.step()
            losses.append(loss.item())
            sent.append(ledger.sent_bytes() / 4)  # fp32 elements
        held = zero_state_bytes(model, optimizer)  # after a step, before zero_grad: what lives between steps
        out[kind] = dict(state=zero_full_state_dict(model, optimizer), losses=losses, sent=sent, held=held,
                         buffers=n_flat_buffers(model, optimizer))
    return out


def _reference_on_rank(steps: int) -> dict:
    """One device on the whole batch, plain AdamW: {kind: (state dict, losses)}."""
    out = {}
    for kind in ("mlp", "gpt"):
        model, losses = train_reference(lambda: build(kind), global_batches(kind, steps),
                                        lambda p: torch.optim.AdamW(p, lr=LR[kind]))
        out[kind] = (model.state_dict(), losses)
    return out


def compare_with_reference(state: dict, reference: dict, lr: float, steps: int) -> tuple[float, float, bool]:
    """(max abs diff, max rel diff, ok): per tensor, relative 1e-5; the zero-gradient tensors stay noise."""
    noisy = [k for k in reference if k.endswith(INERT_KEY_BIAS)]
    clean = {k: v for k, v in reference.items() if k not in noisy}
    max_abs, max_rel = compare_state({k: state[k] for k in clean}, clean)
    noise_ok = all(state[k].abs().max() <= 0.01 * lr * steps for k in noisy)
    return max_abs, max_rel, max_rel <= 1e-5 and noise_ok


def verify_zero(world_size: int, technique: str = "zero1", steps: int = 5) -> dict:
    """Parameters and losses vs one device, ledger vs 2 or 3 (N-1)/N Psi, bytes held vs the ZeRO formula."""
    stages = {"zero1": 1, "zero2": 2, "zero3": 3}
    if technique not in stages:
        raise ValueError(f"technique must be one of {sorted(stages)}, got {technique!r}")
    stage, n = stages[technique], world_size
    bucket_numel = {"mlp": 600, "gpt": 12000} if stage == 2 else {}  # stage 2: several buckets
    per_rank = launch(_train_on_rank, n, args=(stage, steps, bucket_numel), timeout=240)
    max_abs = max_rel = 0.0
    ok, notes = True, []
    references = launch(_reference_on_rank, 1, args=(steps,), timeout=240)[0]  # one device
    for kind in ("mlp", "gpt"):
        reference, ref_losses = references[kind]
        psi = n_params(kind)
        comm = memory.zero_comm_elements(psi, n, stage)
        formula = memory.zero_model_state_bytes(psi, n, stage, recipe="fp32_adam")
        for r in per_rank:
            a, rel, params_ok = compare_with_reference(r[kind]["state"], reference, LR[kind], steps)
            losses = [sum(q[kind]["losses"][i] for q in per_rank) / n for i in range(steps)]  # mean of equal slices
            loss_rel = max(abs(x - y) / abs(y) for x, y in zip(losses, ref_losses))
            max_abs, max_rel = max(max_abs, a), max(max_rel, rel, loss_rel)
            passes, pad = (3 if stage == 3 else 2), r[kind]["buffers"] * (n - 1)  # padding: < N per buffer
            comm_ok = all(comm - 1e-6 <= s <= comm + passes * pad for s in r[kind]["sent"])
            held = r[kind]["held"]
            pad_bytes = {"params": 4 * pad, "grads": 4 * pad, "optimizer": 8 * pad}
            memory_ok = all(abs(held[k] - formula[k]) <= 0.05 * formula[k] + pad_bytes[k] for k in pad_bytes)
            ok &= params_ok and loss_rel <= 1e-5 and comm_ok and memory_ok
        held0 = per_rank[0][kind]["held"]
        notes.append(f"{kind}: Psi={psi}, sent {per_rank[0][kind]['sent'][0]:.0f} el/step vs {comm:.0f}; "
                     f"held p/g/o {held0['params']}/{held0['grads']}/{held0['optimizer']} B vs "
                     f"{formula['params']:.0f}/{formula['grads']:.0f}/{formula['optimizer']:.0f}")
    return {"passed": bool(ok), "max_abs_diff": max_abs, "max_rel_diff": max_rel, "detail": "; ".join(notes)}


# ---------------------------------------------------------------------------------
# bench: ours beside PyTorch's, same model, same ranks, same run


def _torch_zero1(config: GPTConfig):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    model = build_gpt(config, seed=0)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    return TorchDDP(model, gradient_as_bucket_view=True), optimizer  # DDP averages, ZeRO shards the step


def _torch_fsdp2(config: GPTConfig):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = build_gpt(config, seed=0)
    for block in model.blocks:
        torch_fully_shard(block)
    torch_fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _ours(config: GPTConfig, stage: int):
    model = build_gpt(config, seed=0)
    return model, apply_zero(model, stage, torch.optim.AdamW, lr=1e-3)


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
