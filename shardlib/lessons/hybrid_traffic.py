"""What each rank of a hybrid layout sends, predicted from the model's sizes and read from the ledger
(lesson 06 and `python -m shardlib verify --technique dp-tp ...`).

`expected_records(mesh, zero3, m)` lists, per mesh dimension, the calls one rank makes in one training
step of the small GPT (shardlib/parallel/hybrid.py states the formulas); `ledger_by_dimension(ledger,
mesh)` lays a measured ledger out the same way, so that the two compare with ==.
"""

from __future__ import annotations

import math

from shardlib.mesh import Mesh
from shardlib.models import GPTConfig, build_gpt, random_token_batches

__all__ = ["CHECK_GPT", "BATCH", "STEPS", "build_check_gpt", "global_batches", "unit_parameters", "expected_records",
           "ledger_by_dimension"]

CHECK_GPT = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)
BATCH, STEPS = 8, 5


def build_check_gpt(seed: int = 0):
    return build_gpt(CHECK_GPT, seed=seed)


def global_batches(steps: int = STEPS, batch_size: int = BATCH) -> list:
    return random_token_batches(CHECK_GPT, batch_size, steps)


# ---------------------------------------------------------------------------------
# the formulas: what one rank holds and sends, from the model's sizes


def unit_parameters(config: GPTConfig, t: int, first: bool, last: bool) -> tuple[int, int]:
    """(parameters of one block, of the rest of the stage) on one of t tensor-parallel ranks
    (shardlib/parallel/tensor_gpt.py): a block splits 12h^2 + 6h (weights; biases of q, v and fc)
    and replicates 6h (two LayerNorms, two row biases); the first stage adds the embeddings
    V h / t + s h, the last ln_f 2h and the head h V / t."""
    h, V, T = config.n_embd, config.vocab_size, config.seq_len
    block = (12 * h * h + 6 * h) // t + 6 * h
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
        # each (b, s, h) received from a neighbouring stage as t pieces, all-gathered (scatter/gather)
        received = [("all_gather", b * s * h)] * ((not first) + (not last)) if p > 1 else []
        out["tp"] = sorted((forward + [("all_reduce", b * s * h)] * (2 * L + last) + received) * m)
    if p > 1:  # per micro-batch, one (b, s, h) activation forward and its gradient back: 1/t from each tp rank
        neighbours = mesh.ranks("pp")  # global ranks of the stages, in stage order
        sends = (([] if last else [(neighbours[stage + 1], b * s * h // t)])
                 + ([] if first else [(neighbours[stage - 1], b * s * h // t)]))
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


def ledger_by_dimension(ledger, mesh: Mesh, element_size: int = 4) -> dict:
    """The ledger's records as expected_records lays them out (elements of `element_size` bytes: fp32 4)."""
    groups = {tuple(mesh.ranks(d)): d for d in mesh.dim_names}
    out = {}
    for r in ledger.records:
        if r.kind in ("recv", "barrier"):  # receives send nothing; barriers carry no data
            continue
        if r.kind == "send":
            out.setdefault("pp", []).append((r.peers[0], r.nbytes // element_size))
            continue
        dim = groups.get(tuple(r.peers), f"group {r.peers}")
        out.setdefault(dim, []).append((r.kind, r.nbytes // element_size))
    for dim, rows in out.items():
        if dim in ("dp", "replicate") and all(kind == "all_reduce" for kind, _ in rows):
            rows = [("all_reduce", sum(n for _, n in rows))]  # one call per gradient tensor: the total
        out[dim] = sorted(rows)
    return out
