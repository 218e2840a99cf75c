"""Hybrid layouts held against one device, the communication formulas, and PyTorch's HSDP.

`python -m shardlib verify --technique dp-tp|zero3-tp|dp-pp|pp-tp|dp-pp-tp|hsdp`: the small GPT
on a mesh (shardlib/parallel/hybrid.py), 5 AdamW steps in fp32 against one device on the same global
batches, with the harness's policy (shardlib/checks/harness.py: parameters and losses within 1e-5
relative, lr 3e-4). Every rank's ledger of the first step, sorted by the mesh dimension of the
group each call ran on, equals the formulas of shardlib/lessons/hybrid_traffic.py, which count from
the model's sizes alone. hsdp also trains PyTorch's fully_shard on a 2-D DeviceMesh (replicate x
shard) on the same batches and compares parameters, and both implementations' bytes per rank with
16 Psi / s bytes in fp32 (32 Psi / s in the check's float64).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from shardlib import memory
from shardlib.checks.harness import (DTYPE, ELEMENT_SIZE, RECIPE, TOLERANCE, adamw, compare_run, cpu_state,
                                     launch_on, reference_run, train_steps, verdict)
from shardlib.launch import current_device
from shardlib.lessons.hybrid_traffic import (
    CHECK_GPT,
    build_check_gpt,
    expected_records,
    global_batches,
    ledger_by_dimension,
)
from shardlib.mesh import Mesh
from shardlib.parallel.hybrid import HybridGPT
from shardlib.reference import compare_state, model_loss, rank_slice

def build_check_gpt_in_dtype():
    return build_check_gpt().to(DTYPE)


# technique -> (mesh shape, dimension names, zero3, micro-batches)
LAYOUTS = {
    "dp-tp": ((2, 2), ("dp", "tp"), False, 1),
    "zero3-tp": ((2, 2), ("dp", "tp"), True, 1),
    "dp-pp": ((2, 2), ("pp", "dp"), False, 2),
    "pp-tp": ((2, 2), ("pp", "tp"), False, 2),
    "dp-pp-tp": ((2, 2, 2), ("pp", "dp", "tp"), False, 2),
    "hsdp": ((2, 2), ("replicate", "shard"), False, 1),
}


def world_size_error(technique: str, world_size: int) -> str | None:
    """Why the check cannot run on `world_size` ranks (None: it can)."""
    shape, names, _, _ = LAYOUTS[technique]
    if world_size != math.prod(shape):
        return (f"{technique} runs on world size {math.prod(shape)} only (mesh "
                f"{' x '.join(f'{n}={s}' for n, s in zip(names, shape))}), not {world_size}")
    return None


# ---------------------------------------------------------------------------------
# verify


def _train_on_rank(shape, names, zero3: bool, m: int) -> dict:
    mesh = Mesh(shape, names)
    hybrid = HybridGPT(build_check_gpt_in_dtype().to(current_device()), mesh, zero3=zero3)
    optimizer = adamw(hybrid.module.parameters())
    losses, ledgers = train_steps(optimizer, global_batches(), lambda batch: hybrid.forward_backward(batch, m))
    held = memory.model_state_bytes(hybrid.module, optimizer)
    return dict(coords=mesh.coordinates(), state=cpu_state(hybrid.full_state_dict()), losses=losses, held=held,
                ledger=ledger_by_dimension(ledgers[0], mesh, ELEMENT_SIZE), expected=expected_records(mesh, zero3, m))


def verify_hybrid(world_size: int, technique: str = "dp-tp", device: str = "cpu") -> dict:
    """One layout of LAYOUTS against one device; the ledger against expected_records."""
    if technique not in LAYOUTS:
        raise ValueError(f"technique must be one of {sorted(LAYOUTS)}, got {technique!r}")
    if world_size_error(technique, world_size):  # before any process starts
        raise ValueError(world_size_error(technique, world_size))
    shape, names, zero3, m = LAYOUTS[technique]
    per_rank = launch_on(_train_on_rank, world_size, args=(shape, names, zero3, m), device=device, timeout=300)
    reference = reference_run(build_check_gpt_in_dtype, global_batches(), device=device)
    replicas: dict[tuple, dict] = {}  # every coordinate but pp -> the union of its stages' tensors
    for r in per_rank:
        key = tuple(sorted((d, i) for d, i in r["coords"].items() if d != "pp"))
        replicas.setdefault(key, {}).update(r["state"])
    last_stage = [r for r in per_rank if r["coords"].get("pp", 0) == dict(zip(names, shape)).get("pp", 1) - 1
                  and r["coords"].get("tp", 0) == 0]  # one rank per replica that holds the loss
    losses = [sum(r["losses"][i] for r in last_stage) / len(last_stage) for i in range(len(reference["losses"]))]
    comparisons = [compare_run(state, losses, reference["state"], reference["losses"]) for state in replicas.values()]
    ledger_ok = all(r["ledger"] == r["expected"] for r in per_rank)
    notes = [f"{len(replicas)} gathered copies of the model; loss rel {comparisons[0]['loss_rel_diff']:.1e}; ledger "
             + ("= formula" if ledger_ok else "DIFFERS")]
    problems = [] if ledger_ok else [f"LEDGER: rank 0 {per_rank[0]['ledger']} vs formula {per_rank[0]['expected']}"]
    if technique == "hsdp":
        torch_ok, detail = _hsdp_against_torch(world_size, shape, reference["state"], per_rank, device)
        (notes if torch_ok else problems).append(detail)
    return verdict(comparisons, notes, problems)


# ---------------------------------------------------------------------------------
# HSDP beside PyTorch's fully_shard on a 2-D DeviceMesh


def _torch_hsdp_on_rank(shape) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh(current_device().type, tuple(shape), mesh_dim_names=("replicate", "shard"))
    model = build_check_gpt_in_dtype().to(current_device())
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    optimizer = adamw(model.parameters())
    data_rank, data_size = dist.get_rank(), dist.get_world_size()  # replicate-major, as ours

    def forward_backward(batch):
        loss = model_loss(model, rank_slice(batch, data_rank, data_size))
        loss.backward()
        return loss

    train_steps(optimizer, global_batches(), forward_backward)
    held = memory.model_state_bytes(model, optimizer)
    state = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in model.state_dict().items()}
    return dict(state=cpu_state(state), held=held)


def _hsdp_against_torch(world_size: int, shape, reference: dict, ours: list, device: str) -> tuple[bool, str]:
    theirs = launch_on(_torch_hsdp_on_rank, world_size, args=(shape,), device=device, timeout=300)
    _, torch_rel = compare_state(theirs[0]["state"], reference)
    _, between = compare_state(ours[0]["state"], theirs[0]["state"])
    s = shape[1]
    formula = RECIPE.total * CHECK_GPT.n_params / s  # float64 AdamW: 8 + 8 + 16 bytes per parameter, over s
    ours_b = [r["held"]["total"] - r["held"]["optimizer_scalars"] for r in ours]
    theirs_b = [r["held"]["total"] - r["held"]["optimizer_scalars"] for r in theirs]
    bytes_ok = all(abs(b - formula) <= 0.1 * formula for b in ours_b + theirs_b)
    return bytes_ok and torch_rel <= TOLERANCE, (
        f"torch HSDP vs one device rel {torch_rel:.1e}, ours vs torch rel {between:.1e}; bytes per rank "
        f"(no step counters) ours {ours_b} torch {theirs_b} vs {RECIPE.total:.0f} Psi/s = {formula:.0f}"
        + ("" if bytes_ok else " (MORE THAN 10% OFF)"))


CHECKS = {name: (verify_hybrid, (8,) if name == "dp-pp-tp" else (4,)) for name in LAYOUTS}
