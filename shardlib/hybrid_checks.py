"""Hybrid layouts held against one device, the communication formulas, and PyTorch's HSDP.

`python -m shardlib verify --technique dp-tp|zero3-tp|dp-pp|pp-tp|dp-pp-tp|hsdp`: the small GPT
on a mesh (shardlib/hybrid.py), 5 AdamW steps in fp32 against one device on the same global
batches, as the component checks do (shardlib/data_parallel_checks.py): parameters and losses
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
from shardlib.hybrid import HybridGPT
from shardlib.launch import launch
from shardlib.mesh import Mesh
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.reference import compare_state, freeze_inert_key_biases, model_loss, rank_slice, train_reference

CHECK_GPT = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)
BATCH, STEPS, LR = 8, 5, 3e-4
# technique -> (mesh shape, dimension names, zero3, micro-batches)
LAYOUTS = {
    "dp-tp": ((2, 2), ("dp", "tp"), False, 1),
    "zero3-tp": ((2, 2), ("dp", "tp"), True, 1),
    "dp-pp": ((2, 2), ("pp", "dp"), False, 2),
    "pp-tp": ((2, 2), ("pp", "tp"), False, 2),
    "dp-pp-tp": ((2, 2, 2), ("pp", "dp", "tp"), False, 2),
    "hsdp": ((2, 2), ("replicate", "shard"), False, 1),
}


def build_check_gpt(seed: int = 0):
    return freeze_inert_key_biases(build_gpt(CHECK_GPT, seed=seed))


def global_batches(steps: int = STEPS, batch_size: int = BATCH) -> list:
    return random_token_batches(CHECK_GPT, batch_size, steps)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


# ---------------------------------------------------------------------------------
# the formulas: what one rank holds and sends, from the model's sizes


def unit_parameters(config: GPTConfig, t: int, first: bool, last: bool) -> tuple[int, int]:
    """(trainable parameters of one block, of the rest of the stage) on one of t tensor-parallel
    ranks (tp_gpt.py): a block splits 12h^2 + 7h (weights, column biases) and replicates 6h (two
    LayerNorms, two row biases), less its frozen key bias h/t; the first stage adds the embeddings
    V h / t + s h, the last ln_f 2h and the head h V / t."""
    h, V, T = config.n_embd, config.vocab_size, config.seq_len
    block = (12 * h * h + 7 * h) // t + 6 * h - h // t
    rest = (V * h // t + T * h if first else 0) + (2 * h + h * V // t if last else 0)
    return block, rest


def expected_records(mesh: Mesh, zero3: bool, m: int, batch: int = BATCH, config: GPTConfig = CHECK_GPT) -> dict:
    """{dimension: sorted [(kind, elements or (peer, elements))]} one rank logs in one training step."""
    t, p = mesh.size("tp"), mesh.size("pp")
    stage, L = mesh.rank("pp"), config.n_layer // p  # the check's layers split evenly
    first, last = stage == 0, stage == p - 1
    dp_size = math.prod(mesh.size(d) for d in ("dp", "replicate", "shard"))
    b, s, h = batch // dp_size // m, config.seq_len, config.n_embd  # one micro-batch
    out = {}
    if t > 1:  # per micro-batch: embedding g, 2 g per block, 3 loss sums forward; 2 f per block, head f backward
        forward = [("all_reduce", b * s * h)] * (first + 2 * L) + [("all_reduce", b * s)] * (3 * last)
        out["tp"] = sorted((forward + [("all_reduce", b * s * h)] * (2 * L + last)) * m)
    if p > 1:  # per micro-batch, one (b, s, h) activation forward and its gradient back
        neighbours = mesh.ranks("pp")  # global ranks of the stages, in stage order
        sends = ([] if last else [(neighbours[stage + 1], b * s * h)]) + ([] if first else [(neighbours[stage - 1], b * s * h)])
        out["pp"] = sorted(sends * m)
    block, rest = unit_parameters(config, t, first, last)
    units = [block] * L + [rest]
    shard_dim = "shard" if "shard" in mesh.dim_names else ("dp" if zero3 else None)
    if shard_dim:  # ZeRO-3 / FSDP: per unit, all-gather forward and backward, reduce-scatter the gradient
        n = mesh.size(shard_dim)
        out[shard_dim] = sorted([(kind, math.ceil(u / n) * n) for u in units
                                 for kind in ("all_gather", "all_gather", "reduce_scatter")] * m)
    replicate_dim = "replicate" if "replicate" in mesh.dim_names else (None if zero3 else "dp")
    if replicate_dim in mesh.dim_names:  # every (shard of a) gradient all-reduced once: total elements
        if shard_dim:
            n, r = mesh.size(shard_dim), mesh.rank(shard_dim)
            total = sum(max(0, min(math.ceil(u / n), u - r * math.ceil(u / n))) for u in units)
        else:
            total = sum(units)
        out[replicate_dim] = [("all_reduce", total)]
    return out


def ledger_by_dimension(ledger, mesh: Mesh) -> dict:
    """The ledger's records as expected_records lays them out (fp32: 4 bytes per element)."""
    groups = {tuple(mesh.ranks(d)): d for d in mesh.dim_names}
    out = {}
    for r in ledger.records:
        if r.kind in ("recv", "barrier"):  # receives send nothing; barriers carry no data
            continue
        if r.kind == "send":
            out.setdefault("pp", []).append((r.peers[0], r.nbytes // 4))
            continue
        dim = groups.get(tuple(r.peers), f"group {r.peers}")
        out.setdefault(dim, []).append((r.kind, r.nbytes // 4))
    for dim, rows in out.items():
        if dim in ("dp", "replicate") and all(kind == "all_reduce" for kind, _ in rows):
            rows = [("all_reduce", sum(n for _, n in rows))]  # one call per gradient tensor: the total
        out[dim] = sorted(rows)
    return out


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
