"""Hybrid layouts held against one device, the communication formulas, and PyTorch's HSDP.

`python -m shardlib verify --technique dp-tp|zero3-tp|dp-pp|pp-tp|dp-pp-tp|hsdp`: the small GPT
on a mesh (shardlib/parallel/hybrid.py), 5 AdamW steps in fp32 against one device on the same global
batches, as the component checks do (shardlib/checks/ddp.py): parameters and losses
within 1e-5 relative, the key biases frozen (softmax ignores a shift common to every key, so their
exact gradient is zero and the computed one is rounding noise that Adam scales up to full steps),
lr 3e-4 (Adam divides each gradient by its own size, so a sum in another order moves a near-zero
element by up to lr). Every rank's ledger of the first step, sorted by the mesh dimension of the
group each call ran on, equals the formulas below, which count from the model's sizes alone.
hsdp also trains PyTorch's fully_shard on a 2-D DeviceMesh (replicate x shard) on the same
batches and compares parameters, and both implementations' bytes per rank with 16 Psi / s.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardlib import memory
from shardlib.comm import comm_ledger
from shardlib.launch import launch
from shardlib.lessons.hybrid_traffic import (
    CHECK_GPT,
    STEPS,
    build_check_gpt,
    expected_records,
    global_batches,
    ledger_by_dimension,
)
from shardlib.mesh import Mesh
from shardlib.parallel.hybrid import HybridGPT
from shardlib.reference import compare_state, model_loss, rank_slice, train_reference

LR = 3e-4
# technique -> (mesh shape, dimension names, zero3, micro-batches)
LAYOUTS = {
    "dp-tp": ((2, 2), ("dp", "tp"), False, 1),
    "zero3-tp": ((2, 2), ("dp", "tp"), True, 1),
    "dp-pp": ((2, 2), ("pp", "dp"), False, 2),
    "pp-tp": ((2, 2), ("pp", "tp"), False, 2),
    "dp-pp-tp": ((2, 2, 2), ("pp", "dp", "tp"), False, 2),
    "hsdp": ((2, 2), ("replicate", "shard"), False, 1),
}




def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


# ---------------------------------------------------------------------------------
# verify


def _train_on_rank(shape, names, zero3: bool, m: int) -> dict:
    mesh = Mesh(shape, names)
    hybrid = HybridGPT(build_check_gpt(), mesh, zero3=zero3)
    optimizer = _adamw(hybrid.module.parameters())
    losses, ledger_rows = [], None
    for step, batch in enumerate(global_batches()):
        optimizer.zero_grad(set_to_none=True)
        with comm_ledger() as ledger:
            losses.append(hybrid.forward_backward(batch, n_microbatches=m))
        optimizer.step()
        if step == 0:
            ledger_rows = ledger_by_dimension(ledger, mesh)
    held = memory.model_state_bytes(hybrid.module, optimizer)
    return dict(coords=mesh.coordinates(), state=hybrid.full_state_dict(), losses=losses, ledger=ledger_rows,
                expected=expected_records(mesh, zero3, m), held=held)


def _reference_on_rank() -> tuple[dict, list[float]]:
    model, losses = train_reference(build_check_gpt, global_batches(), _adamw)
    return model.state_dict(), losses


def verify_hybrid(world_size: int, technique: str = "dp-tp") -> dict:
    """One layout of LAYOUTS against one device; the ledger against expected_records."""
    if technique not in LAYOUTS:
        raise ValueError(f"technique must be one of {sorted(LAYOUTS)}, got {technique!r}")
    shape, names, zero3, m = LAYOUTS[technique]
    if world_size != math.prod(shape):
        raise ValueError(f"{technique} runs on {math.prod(shape)} ranks ({' x '.join(f'{n}={s}' for n, s in zip(names, shape))}); "
                         f"got world_size={world_size}")
    per_rank = launch(_train_on_rank, world_size, args=(shape, names, zero3, m), timeout=300)
    reference, ref_losses = launch(_reference_on_rank, 1, timeout=120)[0]
    max_abs = max_rel = 0.0
    replicas: dict[tuple, dict] = {}  # every coordinate but pp -> the union of its stages' tensors
    for r in per_rank:
        key = tuple(sorted((d, i) for d, i in r["coords"].items() if d != "pp"))
        replicas.setdefault(key, {}).update(r["state"])
    for state in replicas.values():
        a, rel = compare_state(state, reference)
        max_abs, max_rel = max(max_abs, a), max(max_rel, rel)
    last_stage = [r for r in per_rank if r["coords"].get("pp", 0) == dict(zip(names, shape)).get("pp", 1) - 1
                  and r["coords"].get("tp", 0) == 0]  # one rank per replica that holds the loss
    losses = [sum(r["losses"][i] for r in last_stage) / len(last_stage) for i in range(STEPS)]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    ledger_ok = all(r["ledger"] == r["expected"] for r in per_rank)
    notes = [f"{len(replicas)} gathered copies of the model; loss rel {loss_rel:.1e}; ledger "
             + ("= formula" if ledger_ok else f"DIFFERS: rank 0 {per_rank[0]['ledger']} vs {per_rank[0]['expected']}")]
    passed = max_rel <= 1e-5 and loss_rel <= 1e-5 and ledger_ok
    if technique == "hsdp":
        torch_ok, detail = _hsdp_against_torch(world_size, shape, reference, per_rank)
        passed &= torch_ok
        notes.append(detail)
    return {"passed": bool(passed), "max_abs_diff": max_abs, "max_rel_diff": max(max_rel, loss_rel),
            "detail": "; ".join(notes)}


# ---------------------------------------------------------------------------------
# HSDP beside PyTorch's fully_shard on a 2-D DeviceMesh


def _torch_hsdp_on_rank(shape) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))
    model = build_check_gpt()
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    optimizer = _adamw(model.parameters())
    data_rank, data_size = dist.get_rank(), dist.get_world_size()  # replicate-major, as ours
    for batch in global_batches():
        optimizer.zero_grad(set_to_none=True)
        model_loss(model, rank_slice(batch, data_rank, data_size)).backward()
        optimizer.step()
    held = memory.model_state_bytes(model, optimizer)
    state = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
             for name, t in model.state_dict().items()}
    return dict(state=state, held=held)


def _hsdp_against_torch(world_size: int, shape, reference: dict, ours: list) -> tuple[bool, str]:
    theirs = launch(_torch_hsdp_on_rank, world_size, args=(shape,), timeout=300)
    _, torch_rel = compare_state(theirs[0]["state"], reference)
    _, between = compare_state(ours[0]["state"], theirs[0]["state"])
    s = shape[1]
    formula = 16 * CHECK_GPT.n_params / s  # fp32 AdamW: 4 + 4 + 8 bytes per parameter, over s ranks
    ours_b = [r["held"]["total"] - r["held"]["optimizer_scalars"] for r in ours]
    theirs_b = [r["held"]["total"] - r["held"]["optimizer_scalars"] for r in theirs]
    bytes_ok = all(abs(b - formula) <= 0.1 * formula for b in ours_b + theirs_b)
    return bytes_ok and torch_rel <= 1e-5, (
        f"torch HSDP vs one device rel {torch_rel:.1e}, ours vs torch rel {between:.1e}; bytes per rank "
        f"(no step counters) ours {ours_b} torch {theirs_b} vs 16 Psi/s = {formula:.0f}"
        + ("" if bytes_ok else " (MORE THAN 10% OFF)"))


CHECKS = {name: (verify_hybrid, (8,) if name == "dp-pp-tp" else (4,)) for name in LAYOUTS}
