"""ZeRO-1/2/3 (shardlib.parallel.zero, shardlib.parallel.fsdp) against a single device, the ZeRO paper's formulas,
and the launcher's error handling. Small models, few steps: one launch per world size does most.

References are independent of the code under test: `train_reference` trains an ordinary model
with an ordinary torch optimizer on the concatenated batch; memory and communication come from
shardlib.memory's formulas (ZeRO paper, arXiv 1910.02054) and Psi from the models' formulas.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shardlib import RankError, launch, memory
from shardlib.checks.harness import (CHECK_MLP, DTYPE, LR, RECIPE, TOLERANCE, build_check_model, check_batches,
                                     check_model_params, cpu_state, reference_run, train_steps)
from shardlib.checks.zero import STAGE2_BUCKET_CAP_MB
from shardlib.models import build_mlp
from shardlib.parallel.fsdp import fully_shard
from shardlib.parallel.zero import ZeroOptimizer
from shardlib.parallel.zero_stages import apply_zero, n_flat_buffers, zero_full_state_dict, zero_state_bytes
from shardlib.reference import compare_state, model_loss, rank_slice

STEPS = 5
STAGES = (1, 2, 3)
WORLD_SIZES = (1, 2, 3, 4)
OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=LR)), "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9))}


def _train(kind: str, stage: int, optimizer: str, steps: int, param_dtype=None, micro_batches: int = 1,
           prepare=None, dtype=DTYPE) -> dict:
    """On a rank: train `kind` with ZeRO `stage`; return what the tests hold against references."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_check_model(kind).to(dtype)
    if prepare is not None:
        prepare(model)
    optimizer_class, defaults = OPTIMIZERS[optimizer]
    bucket_cap_mb = STAGE2_BUCKET_CAP_MB[kind] if stage == 2 else None  # stage 2: several buckets
    opt = apply_zero(model, stage, optimizer_class, param_dtype=param_dtype, bucket_cap_mb=bucket_cap_mb, **defaults)

    def forward_backward(batch):
        x, y = rank_slice(batch, rank, n)
        step_loss = 0.0
        for micro in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = model_loss(model, micro) / micro_batches
            loss.backward()
            step_loss += loss.item()
        return step_loss

    losses, ledgers = train_steps(opt, check_batches(kind, steps), forward_backward, dtype=dtype)
    element_size = torch.empty((), dtype=param_dtype or dtype).element_size()  # what travels
    return dict(state=cpu_state(zero_full_state_dict(model, opt)), losses=losses, held=zero_state_bytes(model, opt),
                sent=[ledger.sent_bytes() / element_size for ledger in ledgers], buffers=n_flat_buffers(model, opt),
                calls=ledgers[-1].summary())


def _adamw_all_stages() -> dict:
    return {(kind, stage): _train(kind, stage, "adamw", STEPS) for kind in ("mlp", "gpt") for stage in STAGES}


@pytest.fixture(scope="module")
def adamw_runs() -> dict:
    """{N: [per rank {(kind, stage): result}]}: MLP and GPT, stages 1-3, 5 AdamW steps, N = 1..4."""
    return {n: launch(_adamw_all_stages, n, timeout=240) for n in WORLD_SIZES}


def reference(kind: str, steps: int, optimizer: str, prepare=None, dtype=DTYPE):
    """(state dict, losses) of one device on the whole batch (harness.reference_run: one rank)."""
    def build_prepared():
        model = build_check_model(kind).to(dtype)
        if prepare is not None:
            prepare(model)
        return model

    optimizer_class, defaults = OPTIMIZERS[optimizer]
    result = reference_run(build_prepared, check_batches(kind, steps),
                           optimizer=lambda params: optimizer_class(params, **defaults))
    return result["state"], result["losses"]


@pytest.fixture(scope="module")
def references() -> dict:
    return {kind: reference(kind, STEPS, "adamw") for kind in ("mlp", "gpt")}


# ---------------------------------------------------------------------------------
# results: parameters and losses equal to one device's


@pytest.mark.slow
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ("mlp", "gpt"))
def test_adamw_matches_single_device(adamw_runs, references, n, stage, kind):
    reference, ref_losses = references[kind]
    per_rank = [r[(kind, stage)] for r in adamw_runs[n]]
    for rank, result in enumerate(per_rank):
        max_abs, max_rel = compare_state(result["state"], reference)
        assert max_rel <= TOLERANCE, (f"rank {rank}: parameters differ from one device: max abs {max_abs:.2e}, "
                                      f"max rel {max_rel:.2e} > {TOLERANCE}")
    losses = [sum(r["losses"][i] for r in per_rank) / n for i in range(STEPS)]  # mean over equal slices
    assert losses == pytest.approx(ref_losses, rel=TOLERANCE)


def _sgd_all_stages() -> dict:
    return {stage: _train("mlp", stage, "sgd", 4, micro_batches=2) for stage in STAGES}


def test_sgd_with_gradient_accumulation_matches_single_device():
    # SGD, unlike Adam, sees a wrong gradient scale (e.g. a sum instead of a mean over ranks)
    per_rank = launch(_sgd_all_stages, 3, timeout=120)
    ref_state, ref_losses = reference("mlp", 4, "sgd")
    for stage in STAGES:
        for result in (r[stage] for r in per_rank):
            _, max_rel = compare_state(result["state"], ref_state)
            assert max_rel <= TOLERANCE, f"stage {stage}: {max_rel:.1e} from one device"
        losses = [sum(r[stage]["losses"][i] for r in per_rank) / 3 for i in range(4)]
        assert losses == pytest.approx(ref_losses, rel=TOLERANCE)


# ---------------------------------------------------------------------------------
# communication and memory against the ZeRO paper's formulas


@pytest.mark.slow
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_ledger_matches_formula(adamw_runs, n, stage):
    for kind in ("mlp", "gpt"):
        passes = 3 if stage == 3 else 2  # 2(N-1)/N Psi: reduce-scatter + all-gather; ZeRO-3 gathers twice
        expected = passes * (n - 1) / n * check_model_params(kind)
        for r in adamw_runs[n]:
            result = r[(kind, stage)]
            padding = passes * (n - 1) * result["buffers"]  # each flat buffer pads by fewer than N elements
            for sent in result["sent"]:
                assert expected - 1e-6 <= sent <= expected + padding, (kind, sent, expected)
            if n > 1:
                calls = result["calls"]
                assert calls["reduce_scatter"]["calls"] == result["buffers"]
                assert calls["all_gather"]["calls"] == (2 if stage == 3 else 1) * result["buffers"]


@pytest.mark.slow
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_memory_per_rank_matches_formula(adamw_runs, n, stage):
    for kind in ("mlp", "gpt"):
        formula = memory.zero_model_state_bytes(check_model_params(kind), n, stage, recipe=RECIPE)  # float64 AdamW
        for r in adamw_runs[n]:
            held, pad = r[(kind, stage)]["held"], (n - 1) * r[(kind, stage)]["buffers"]
            for part in ("params", "grads", "optimizer"):
                slack = 0.05 * formula[part] + getattr(RECIPE, part) * pad
                assert abs(held[part] - formula[part]) <= slack, (kind, part, held[part], formula[part])


@pytest.mark.slow
def test_zero_memory_falls_with_stage_as_the_paper_says(adamw_runs):
    held = {stage: adamw_runs[4][0][("gpt", stage)]["held"] for stage in STAGES}
    psi = check_model_params("gpt")
    # float64 Adam (params 8, grads 8, m and v 16 bytes), N = 4: ZeRO-1 16 Psi + 16 Psi/4 = 20 Psi,
    # ZeRO-2 8 Psi + 24 Psi/4 = 14 Psi, ZeRO-3 32 Psi/4 = 8 Psi (fp32: half of each)
    for stage, bytes_per_param in ((1, 20), (2, 14), (3, 8)):
        assert held[stage]["total"] == pytest.approx(bytes_per_param * psi, rel=0.01)


# ---------------------------------------------------------------------------------
# mixed precision


def _bf16_all_stages() -> dict:
    out = {}
    for stage in STAGES:
        out[stage] = _train("mlp", stage, "sgd", 4, param_dtype=torch.bfloat16, dtype=torch.float32)
        model = build_check_model("gpt").float()
        apply_zero(model, stage, torch.optim.SGD, lr=0.05, param_dtype=torch.bfloat16)
        out[stage]["gpt_dtypes"] = {p.dtype for p in model.parameters()}
    return out


def test_bf16_mixed_precision_stays_close_to_fp32():
    per_rank = launch(_bf16_all_stages, 2, timeout=120)
    ref_state, ref_losses = reference("mlp", 4, "sgd", dtype=torch.float32)
    psi = check_model_params("mlp")
    for stage in STAGES:
        result = per_rank[0][stage]
        assert all(t.dtype == torch.float32 for t in result["state"].values())  # exported from the fp32 masters
        _, max_rel = compare_state(result["state"], ref_state)
        assert 0 < max_rel <= 2e-2, f"stage {stage}: bf16 run {max_rel:.1e} from fp32 (bf16 has 8 bits of mantissa)"
        losses = [sum(r[stage]["losses"][i] for r in per_rank) / 2 for i in range(4)]
        assert losses == pytest.approx(ref_losses, rel=2e-2)
        # communication in bf16 elements, same count; memory: the paper's mixed-precision Adam is
        # for Adam, but params and grads are bf16 here, as in its 2 + 2 bytes
        assert result["sent"][0] == pytest.approx(memory.zero_comm_elements(psi, 2, stage), abs=3 * result["buffers"])
        formula = memory.zero_model_state_bytes(psi, 2, stage, recipe="mixed_adam")
        if stage < 3:
            assert result["held"]["params"] == pytest.approx(formula["params"], rel=0.01)
            assert result["held"]["grads"] == pytest.approx(formula["grads"], rel=0.01)
        else:  # fp32 shards, as FSDP2 keeps them: 4 + 4 bytes per parameter, sharded
            assert result["held"]["params"] + result["held"]["grads"] == pytest.approx(8 * psi / 2, rel=0.01)
    assert per_rank[0][1]["gpt_dtypes"] == {torch.bfloat16}  # ZeRO-1/2: the model computes in bf16
    assert per_rank[0][3]["gpt_dtypes"] == {torch.float32}  # ZeRO-3: the shards stay fp32


# ---------------------------------------------------------------------------------
# state dict export, tied and frozen parameters


def _tie_embeddings(model):
    model.lm_head.weight = model.tok_emb.weight


def _freeze_first_block(model):
    model.blocks[0].requires_grad_(False)


def _export_cases() -> dict:
    return {(name, stage): _train(kind, stage, "adamw", 3, prepare=prepare)["state"]
            for name, kind, prepare in (("tied", "gpt", _tie_embeddings), ("frozen", "mlp", _freeze_first_block))
            for stage in STAGES}


def test_full_state_dict_with_tied_and_frozen_parameters():
    per_rank = launch(_export_cases, 2, timeout=180)
    for name, kind, prepare in (("tied", "gpt", _tie_embeddings), ("frozen", "mlp", _freeze_first_block)):
        ref_state = reference(kind, 3, "adamw", prepare)[0]
        for stage in STAGES:
            for r in per_rank:
                state = r[(name, stage)]
                assert list(state) == list(ref_state)  # same names, same order
                assert all(state[k].shape == ref_state[k].shape for k in ref_state)
                assert compare_state(state, ref_state)[1] <= TOLERANCE, (name, stage)
                if name == "tied":
                    assert torch.equal(state["lm_head.weight"], state["tok_emb.weight"])
                else:
                    initial = build_check_model("mlp").state_dict()["blocks.0.0.weight"]
                    assert torch.equal(state["blocks.0.0.weight"], initial)  # frozen: never moved


# ---------------------------------------------------------------------------------
# bad input


def test_bad_inputs_are_refused_before_any_communication():
    mixed = build_mlp(0, **CHECK_MLP)
    mixed.head.double()
    with pytest.raises(TypeError, match="one dtype"):
        ZeroOptimizer(mixed, torch.optim.AdamW, stage=1)
    with pytest.raises(TypeError, match="one dtype"):
        fully_shard(mixed)
    frozen = build_mlp(0, **CHECK_MLP).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        ZeroOptimizer(frozen, torch.optim.AdamW)
    with pytest.raises(ValueError, match="fully_shard"):
        ZeroOptimizer(build_mlp(0, **CHECK_MLP), torch.optim.AdamW, stage=3)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ZeroOptimizer(build_mlp(0, **CHECK_MLP), torch.optim.AdamW, stage=2, bucket_cap_mb=0)
    with pytest.raises(TypeError, match="floating-point"):
        fully_shard(build_mlp(0, **CHECK_MLP), param_dtype=torch.int8)


def _tie_across_units() -> str:
    model = build_mlp(0, **CHECK_MLP)
    model.blocks[1][0].bias = model.blocks[0][0].bias  # the same Parameter in two units
    fully_shard(model.blocks[0])
    try:
        fully_shard(model.blocks[1])
    except ValueError as error:
        message = str(error)
    else:
        message = "no error"
    try:
        fully_shard(model.blocks[0])
    except ValueError as error:
        return message + " | " + str(error)
    return message + " | no error"


def test_tied_parameters_across_units_are_refused():
    message = launch(_tie_across_units, 2, timeout=60)[0]
    assert "'0.bias' is tied to a parameter that the unit Sequential (as 0.bias) already shards" in message
    assert "already sharded" in message


def _crash_mid_step(stage: int) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_check_model("mlp")
    optimizer = apply_zero(model, stage, torch.optim.AdamW, lr=LR, bucket_cap_mb=STAGE2_BUCKET_CAP_MB["mlp"])
    loss = model_loss(model, rank_slice(check_batches("mlp", 1)[0], rank, n))
    if rank == 1:
        raise RuntimeError("rank 1 lost its data loader")
    loss.backward()  # rank 0 waits in a collective that rank 1 never joins: in backward (stages 2, 3) ...
    optimizer.step()  # ... or here (stage 1)


@pytest.mark.parametrize("stage", STAGES)
def test_a_crashed_rank_ends_the_job_with_a_clear_error(stage):
    started = time.monotonic()
    with pytest.raises(RankError) as error:
        launch(_crash_mid_step, 2, args=(stage,), timeout=60)
    assert error.value.rank == 1
    assert "rank 1 lost its data loader" in str(error.value)
    assert time.monotonic() - started < 30  # the launcher ends the waiting rank, not the collective timeout
