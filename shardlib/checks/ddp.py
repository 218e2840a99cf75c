"""Checks and benchmark of shardlib.parallel.ddp (`python -m shardlib verify --technique dp|ddp`,
`python -m shardlib bench ddp`).

verify: N ranks against one device trained on the concatenated batch, on the MLP and the GPT,
after 5 AdamW steps: parameters and losses within 1e-5 relative, and the ledger's bytes per rank
per step against the ring all-reduce's 2(N-1)/N * Psi elements (4 bytes each in fp32).
bench: shardlib's DistributedDataParallel beside torch.nn.parallel.DistributedDataParallel, same
model, same ranks, steps interleaved, median step times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlib.checks.harness import interleaved_step_times
from shardlib.comm import comm_ledger
from shardlib.launch import launch
from shardlib.models import GPTConfig, build_gpt, build_mlp, mlp_batch, random_token_batches
from shardlib.parallel.ddp import DistributedDataParallel, all_reduce_gradients
from shardlib.reference import compare_state, freeze_inert_key_biases, model_loss, rank_slice, train_reference

_GPT = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)
_MLP = dict(d_in=32, hidden=64, n_blocks=2, n_out=8)


def _build(kind: str, seed: int) -> nn.Module:
    """The check's models. The GPT's key biases are frozen: softmax ignores a shift common to all
    keys, so their exact gradient is zero and the fp32 one is rounding noise, which Adam scales
    up to full-size steps (comparing them would compare noise). They also test the frozen path."""
    if kind == "mlp":
        return build_mlp(seed, **_MLP)
    return freeze_inert_key_biases(build_gpt(_GPT, seed=seed))


def _psi(kind: str) -> int:
    """Trainable Psi from the models' formulas, independent of the code under test."""
    if kind == "gpt":
        return _GPT.n_params - _GPT.n_layer * _GPT.n_embd  # less the frozen key biases
    d, h, blocks, out = _MLP["d_in"], _MLP["hidden"], _MLP["n_blocks"], _MLP["n_out"]
    return blocks * (2 * d * h + h + d) + d * out + out


def _global_batches(kind: str, steps: int, batch_size: int = 12) -> list:
    if kind == "mlp":
        return [mlp_batch(batch_size, seed=step) for step in range(steps)]
    return random_token_batches(_GPT, batch_size, steps)


def _adamw(params) -> torch.optim.Optimizer:
    # Adam divides each gradient by its own running size, so fp32 rounding in near-zero gradients
    # (ranks sum in another order than one device) becomes parameter differences in proportion to
    # lr: about 3e-6 relative here at lr 3e-4 (8e-6 at 1e-3, too close to the 1e-5 bound)
    return torch.optim.AdamW(params, lr=3e-4)


def _train_on_rank(technique: str, steps: int, bucket_cap_mb: float) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in ("mlp", "gpt"):
        # DDP: replicas start from different seeds; the broadcast when wrapping must make them equal
        model = _build(kind, seed=0 if technique == "dp" else rank)
        wrapped = DistributedDataParallel(model, bucket_cap_mb) if technique == "ddp" else model
        optimizer = _adamw(model.parameters())
        losses, ledgers = [], []
        for batch in _global_batches(kind, steps):
            optimizer.zero_grad(set_to_none=True)
            with comm_ledger() as ledger:
                loss = model_loss(wrapped, rank_slice(batch, rank, n))
                loss.backward()
                if technique == "dp":
                    all_reduce_gradients(model)
            optimizer.step()
            losses.append(loss.item())
            ledgers.append((ledger.sent_bytes(), ledger.bytes("all_reduce"), ledger.calls()))
        out[kind] = (model.state_dict(), losses, ledgers)
    return out


def verify_data_parallel(world_size: int, technique: str = "ddp", steps: int = 5, bucket_cap_mb: float = 0.02) -> dict:
    """N ranks vs one device on the concatenated batch: parameters and losses after `steps` AdamW
    steps, on the MLP and the GPT; ledger bytes per rank per step vs 2(N-1)/N * Psi * 4."""
    if technique not in ("dp", "ddp"):
        raise ValueError(f"technique must be 'dp' or 'ddp', got {technique!r}")
    per_rank = launch(_train_on_rank, world_size, args=(technique, steps, bucket_cap_mb), timeout=240)
    n, max_abs, max_rel, ledger_ok, notes = world_size, 0.0, 0.0, True, []
    for kind in ("mlp", "gpt"):
        reference, ref_losses = train_reference(lambda: _build(kind, 0), _global_batches(kind, steps), _adamw)
        for state, _, _ in (r[kind] for r in per_rank):
            abs_diff, rel_diff = compare_state(state, reference.state_dict())
            max_abs, max_rel = max(max_abs, abs_diff), max(max_rel, rel_diff)
        losses = [sum(r[kind][1][step] for r in per_rank) / n for step in range(steps)]  # mean of equal slices
        max_rel = max(max_rel, *(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)))
        psi_bytes = _psi(kind) * 4
        expected = 2 * (n - 1) / n * psi_bytes
        for sent, reduced, calls in (step for r in per_rank for step in r[kind][2]):
            # every gradient reduced exactly once; the ledger rounds each call down to a whole byte
            ledger_ok &= reduced == psi_bytes and expected - calls <= sent <= expected
        notes.append(f"{kind}: Psi={_psi(kind)}, sent {per_rank[0][kind][2][0][0]} B/step/rank in "
                     f"{per_rank[0][kind][2][0][2]} calls vs 2(N-1)/N*Psi*4 = {expected:.0f}")
    return {"passed": max_rel <= 1e-5 and ledger_ok, "max_abs_diff": max_abs, "max_rel_diff": max_rel,
            "detail": "; ".join(notes) + ("" if ledger_ok else "; LEDGER DIFFERS from the formula")}


def _time_steps(config: GPTConfig, batch_per_rank: int, bucket_cap_mb: float, repeats: int) -> dict:
    """Median step time of ours and torch's DDP on the same model, steps interleaved."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, config.vocab_size, (batch_per_rank, config.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])  # (B/N, T) each
    runs = {}
    for name, wrap in (("ours", DistributedDataParallel), ("torch", TorchDDP)):
        model = build_gpt(config, seed=0)
        runs[name] = (wrap(model, bucket_cap_mb=bucket_cap_mb), torch.optim.AdamW(model.parameters(), lr=1e-3))
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
