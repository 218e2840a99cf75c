"""Precision and bytes (lesson 13): mixed precision, 8-bit collectives, CPU offload of the optimizer.

verify:

    precision-bf16, precision-fp16   N data-parallel ranks, 16-bit parameters, fp32 master weights (and
        dynamic loss scaling for fp16), STEPS AdamW steps, against PyTorch's own mixed precision on one
        device (fp32 parameters under torch.autocast, torch.amp.GradScaler for fp16) and an fp32 run.
        16-bit runs cannot equal fp32 to 1e-5, so the policy is relative to PyTorch: for every tensor,
        the update (parameters after the steps minus before) is compared with the fp32 run's update,
        ||du - du_fp32|| / ||du_fp32||, and ours must stay within twice PyTorch's own distance plus 0.01,
        skip the same steps, and give losses within 1e-3 of fp32's. Without master weights the bf16
        update of a LayerNorm weight (1.0) is lost whole: a distance of 1.0 (tests/test_precision.py).
    int8-collectives   quantized all-gather and reduce-scatter (ZeRO++) against PyTorch's fp32 ones: every
        element within its rounding bound (max_rel_diff = the largest error over its bound, <= 1), and
        the bytes sent equal the formula (1 + 4/block) per element against fp32's 4.
    zero3-offload      fully_shard + CPUOffloadOptimizer against one device (the harness's policy), and
        the bytes moved each step equal to the rank's shard, down and up.

bench:

    int8-comm   quantized all-gather and reduce-scatter against PyTorch's fp32 ones, gloo, 2 ranks: time
                (ours_s) and bytes (bytes_ratio, target about a quarter)
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from shardlib.checks.harness import (DTYPE, ELEMENT_SIZE, LR, STEPS, compare_run, cpu_state, launch_on,
                                     mean_losses, reference_run, train_steps)
from shardlib.comm import comm_ledger, ops
from shardlib.comm.quantized import (max_quantization_error, quantized_all_gather, quantized_reduce_scatter,
                                     quantized_sent_bytes)
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.fsdp import _units, full_state_dict, fully_shard
from shardlib.parallel.offload import CPUOffloadOptimizer
from shardlib.parallel.precision import MixedPrecisionOptimizer
from shardlib.reference import model_loss, rank_slice
from shardlib.timing import interleaved_times

CHECK_GPT = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BATCH = 12


def _batches(steps: int) -> list:
    return random_token_batches(CHECK_GPT, BATCH, steps)


# ---------------------------------------------------------------------------------
# precision-bf16, precision-fp16


def _mixed_on_rank(dtype_name: str, steps: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_gpt(CHECK_GPT, seed=0).to(current_device())
    optimizer = MixedPrecisionOptimizer(model, torch.optim.AdamW, dtype=DTYPES[dtype_name], lr=LR,
                                        group=dist.group.WORLD)
    losses = []
    for x, y in _batches(steps):
        optimizer.zero_grad()
        loss = model_loss(model, rank_slice((x.to(current_device()), y.to(current_device())), rank, n))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return dict(state=cpu_state(optimizer.full_state_dict()), losses=losses, skipped=optimizer.skipped_steps)


def _torch_amp_on_rank(dtype_name: str, steps: int) -> dict:
    """PyTorch's mixed precision on one device: fp32 parameters, autocast, GradScaler for fp16."""
    device = current_device()
    model = build_gpt(CHECK_GPT, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype_name == "fp16")
    losses, skipped = [], 0
    for x, y in _batches(steps):
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=DTYPES[dtype_name]):
            loss = model_loss(model, (x.to(device), y.to(device)))
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale
        losses.append(loss.item())
    return dict(state=cpu_state(model.state_dict()), losses=losses, skipped=skipped)


def update_distance(state: dict, reference: dict, initial: dict) -> float:
    """max over tensors of ||(state - initial) - (reference - initial)|| / ||reference - initial||."""
    worst = 0.0
    for name, start in initial.items():
        ours, theirs = state[name].double() - start.double(), reference[name].double() - start.double()
        worst = max(worst, ((ours - theirs).norm() / theirs.norm().clamp_min(1e-30)).item())
    return worst


def verify_precision(world_size: int, technique: str = "precision-bf16", steps: int = STEPS, device: str = "cpu") -> dict:
    dtype_name = technique.removeprefix("precision-")
    if dtype_name not in DTYPES:
        raise ValueError(f"technique must be precision-bf16 or precision-fp16, got {technique!r}")
    ours = launch_on(_mixed_on_rank, world_size, args=(dtype_name, steps), device=device, timeout=240)
    amp = launch_on(_torch_amp_on_rank, 1, args=(dtype_name, steps), device=device, timeout=240)[0]
    fp32 = reference_run(lambda: build_gpt(CHECK_GPT, seed=0), _batches(steps), device=device)
    initial = {name: t.detach().clone() for name, t in build_gpt(CHECK_GPT, seed=0).state_dict().items()}
    ours_distance = max(update_distance(r["state"], fp32["state"], initial) for r in ours)
    amp_distance = update_distance(amp["state"], fp32["state"], initial)
    losses = mean_losses([r["losses"] for r in ours])
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, fp32["losses"]))
    max_abs = max((r["state"][k].double() - v.double()).abs().max().item() for r in ours for k, v in fp32["state"].items())
    bound = 2 * amp_distance + 0.01
    skipped = {r["skipped"] for r in ours} | {amp["skipped"]}
    passed = ours_distance <= bound and loss_rel <= 1e-3 and len(skipped) == 1
    return {"passed": passed, "max_abs_diff": max_abs, "max_rel_diff": ours_distance,
            "detail": f"update distance to fp32: ours {ours_distance:.3f}, torch autocast {amp_distance:.3f} "
                      f"(bound {bound:.3f}); losses {loss_rel:.1e} from fp32; skipped steps {sorted(skipped)}"}


# ---------------------------------------------------------------------------------
# int8-collectives


def _int8_on_rank(numel: int, block_size: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    device = current_device()
    inputs = [torch.randn(n * numel, generator=torch.Generator().manual_seed(r)).to(device) for r in range(n)]  # every rank's
    shard = inputs[rank][:numel]  # (c,)
    gathered, exact = torch.empty(n * numel, device=device), torch.empty(n * numel, device=device)
    with comm_ledger() as gather_ledger:
        quantized_all_gather(gathered, shard, block_size=block_size)
    ops.all_gather_into_tensor(exact, shard)
    gather_bound = torch.cat([max_quantization_error(x[:numel], block_size) for x in inputs])  # (N*c,)
    reduced, exact_sum = torch.empty(numel, device=device), torch.empty(numel, device=device)
    with comm_ledger() as scatter_ledger:
        quantized_reduce_scatter(reduced, inputs[rank], block_size=block_size)
    ops.reduce_scatter_tensor(exact_sum, inputs[rank].clone())
    scatter_bound = sum(max_quantization_error(x[rank * numel:(rank + 1) * numel], block_size) for x in inputs)
    ratio = lambda err, bound: (err / (bound * (1 + 1e-5) + 1e-6)).max().item()  # noqa: E731 - slack: fp32 rounding
    return dict(gather_ratio=ratio((gathered - exact).abs(), gather_bound),
                scatter_ratio=ratio((reduced - exact_sum).abs(), scatter_bound),
                gather_error=(gathered - exact).abs().max().item(), scatter_error=(reduced - exact_sum).abs().max().item(),
                gather_sent=gather_ledger.sent_bytes(), scatter_sent=scatter_ledger.sent_bytes())


def verify_int8(world_size: int, technique: str = "int8-collectives", device: str = "cpu") -> dict:
    numel, block_size = 1000, 256  # 1000 is no multiple of 256: the last block is padded
    per_rank = launch_on(_int8_on_rank, world_size, args=(numel, block_size), device=device, timeout=120)
    formula = quantized_sent_bytes(world_size * numel, world_size, block_size)
    fp32 = (world_size - 1) / world_size * world_size * numel * 4
    bytes_ok = all(r["gather_sent"] == formula and r["scatter_sent"] == formula for r in per_rank)
    within = max(max(r["gather_ratio"], r["scatter_ratio"]) for r in per_rank)
    return {"passed": bytes_ok and within <= 1.0, "max_rel_diff": within,
            "max_abs_diff": max(max(r["gather_error"], r["scatter_error"]) for r in per_rank),
            "detail": f"sent {per_rank[0]['gather_sent']} B per call vs formula {formula:.0f} (fp32 {fp32:.0f}); "
                      f"errors within the rounding bound" + ("" if within <= 1.0 else " NOT")}


# ---------------------------------------------------------------------------------
# zero3-offload


def _offload_on_rank(steps: int) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_gpt(CHECK_GPT, seed=0).to(DTYPE).to(current_device())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = _RecordMoved(CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR))

    def forward_backward(batch):
        loss = model_loss(model, rank_slice(batch, rank, n))
        loss.backward()
        return loss

    losses, _ = train_steps(optimizer, _batches(steps), forward_backward)
    shard = sum(unit.layout.shard_numel for _, unit in _units(model))  # elements this rank owns, padding included
    return dict(state=cpu_state(full_state_dict(model)), losses=losses, moved=optimizer.moved, shard=shard)


class _RecordMoved:
    """The offloading optimizer, keeping what each step moved."""

    def __init__(self, optimizer: CPUOffloadOptimizer):
        self.optimizer, self.moved = optimizer, []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        self.optimizer.step()
        self.moved.append(dict(self.optimizer.moved))


def verify_offload(world_size: int, technique: str = "zero3-offload", steps: int = STEPS, device: str = "cpu") -> dict:
    per_rank = launch_on(_offload_on_rank, world_size, args=(steps,), device=device, timeout=240)
    reference = reference_run(lambda: build_gpt(CHECK_GPT, seed=0).to(DTYPE), _batches(steps), device=device)
    losses = mean_losses([r["losses"] for r in per_rank])
    results = [compare_run(r["state"], losses, reference["state"], reference["losses"]) for r in per_rank]
    moved_ok = all(m == {"to_host": r["shard"] * ELEMENT_SIZE, "to_device": r["shard"] * ELEMENT_SIZE}
                   for r in per_rank for m in r["moved"])
    psi = CHECK_GPT.n_params
    return {"passed": all(c["passed"] for c in results) and moved_ok,
            "max_abs_diff": max(c["max_abs_diff"] for c in results), "max_rel_diff": max(c["max_rel_diff"] for c in results),
            "detail": f"moved per step {per_rank[0]['moved'][0]} B = shard of {per_rank[0]['shard']} elements x "
                      f"{ELEMENT_SIZE} B each way {'ok' if moved_ok else 'DIFFERS'} (Psi/N = {psi / world_size:.0f})"}


# ---------------------------------------------------------------------------------
# bench


def _int8_times(numel: int, repeats: int) -> dict:
    n = dist.get_world_size()
    shard = torch.randn(numel)
    full = torch.randn(n * numel)
    out_all, out_one = torch.empty(n * numel), torch.empty(numel)
    fns = {"ours": lambda: (quantized_all_gather(out_all, shard), quantized_reduce_scatter(out_one, full)),
           "torch": lambda: (ops.all_gather_into_tensor(out_all, shard), ops.reduce_scatter_tensor(out_one, full.clone()))}
    times = interleaved_times(fns, repeats, warmup=1, sync=dist.barrier)
    sent = {}
    for name, fn in fns.items():
        with comm_ledger(record_torch=True) as ledger:
            fn()
        sent[name] = ledger.sent_bytes()
    return {"times": times, "sent": sent}


def bench_int8(quick: bool = False) -> list[dict]:
    """8-bit all-gather + reduce-scatter against PyTorch's fp32 ones: time and bytes, 2 ranks over gloo."""
    numel = 1 << 20
    per_rank = launch(_int8_times, 2, args=(numel, 3 if quick else 11), timeout=600)
    ours, theirs = (max(r["times"][k] for r in per_rank) for k in ("ours", "torch"))
    sent = per_rank[0]["sent"]
    return [{"benchmark": "int8-comm", "case": f"int8 all-gather + reduce-scatter, {numel} fp32 per rank, N=2",
             "ours_s": ours, "torch_s": theirs, "ratio": ours / theirs, "target": None,
             "bytes_ratio": round(sent["ours"] / sent["torch"], 4), "bytes_ratio_target": (0.2, 0.3)}]


CHECKS = {"precision-bf16": (verify_precision, (2, 4)),
          "precision-fp16": (verify_precision, (2, 4)),
          "int8-collectives": (verify_int8, (2, 4)),
          "zero3-offload": (verify_offload, (2, 4))}
BENCHMARKS = {"int8-comm": bench_int8}
