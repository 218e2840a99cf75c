"""shardlib.memory against figures printed in the papers and docs, and against hand counts of real tensors.

Every expected value below is written out by hand (arithmetic shown), never computed by the
code under test.
"""

import pytest
import torch
import torch.nn as nn

from shardlib import memory
from shardlib.models import build_mlp, mlp_batch

GB = 1e9

# ---------------------------------------------------------------------------------
# formulas vs published figures


def test_zero_paper_figure_1():
    # ZeRO, arXiv 1910.02054, Figure 1: Psi = 7.5B, N_d = 64, K = 12, mixed precision Adam.
    # Printed (Figure 1; Sections 5.1-5.3): baseline 120GB, P_os 31.4GB, P_os+g 16.6GB, P_os+g+p 1.9GB.
    psi, n = 7.5e9, 64
    totals = [memory.zero_model_state_bytes(psi, n, stage)["total"] for stage in range(4)]
    assert [round(t / GB, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    # exact: 16*7.5 = 120; 4*7.5 + 12*7.5/64 = 30 + 1.40625; 2*7.5 + 14*7.5/64 = 15 + 1.640625; 16*7.5/64
    assert totals == pytest.approx([120e9, 31.40625e9, 16.640625e9, 1.875e9], rel=1e-12)


def test_zero_stage_breakdown_matches_paper_terms():
    # stage 2 keeps 2 Psi of fp16 params whole and shards grads (2) and optimizer (12)
    psi, n = 1000, 10
    s2 = memory.zero_model_state_bytes(psi, n, 2)
    assert (s2["params"], s2["grads"], s2["optimizer"]) == (2000, 200, 1200)
    s1 = memory.zero_model_state_bytes(psi, n, 1)
    assert (s1["params"], s1["grads"], s1["optimizer"]) == (2000, 2000, 1200)


def test_zero_paper_section_3_1_gpt2():
    # Section 3.1: GPT-2 1.5B needs 3GB for its fp16 weights, and at least 24GB (16 Psi) to train with Adam
    assert memory.inference_bytes(1.5e9, "fp16") == 3e9
    assert memory.training_bytes(1.5e9, "mixed_adam")["total"] == 24e9


def test_zero_paper_section_5_4_largest_models_on_64_v100s():
    # Section 5.4: with N_d = 64 (32GB V100s), ZeRO trains up to 7.5B, 14B and 128B parameters
    # with P_os, P_os+g, P_os+g+p: 4*7.5 + 12*7.5/64 = 31.4; 2*14 + 14*14/64 = 31.06; 16*128/64 = 32
    fits = [memory.zero_model_state_bytes(psi, 64, stage)["total"] <= 32e9
            for stage, psi in ((1, 7.5e9), (2, 14e9), (3, 128e9))]
    assert fits == [True, True, True]
    # ... and one step larger no longer fits
    assert memory.zero_model_state_bytes(8e9, 64, 1)["total"] > 32e9
    # Section 5.1/5.2: for large N_d the reduction tends to 4x (P_os) and 8x (P_os+g)
    big = 10**9
    assert 16 / memory.zero_model_state_bytes(1, big, 1)["total"] == pytest.approx(4, rel=1e-6)
    assert 16 / memory.zero_model_state_bytes(1, big, 2)["total"] == pytest.approx(8, rel=1e-6)


def test_zero_trillion_parameters_on_1024_gpus():
    # ZeRO paper, Section 1: a trillion-parameter model (16 TB of model states with mixed-precision Adam)
    # fits in about 16 GB per GPU on 1024 GPUs with all three stages: 16e12 / 1024 = 15.625e9.
    assert memory.zero_model_state_bytes(1e12, 1024, 3)["total"] == pytest.approx(15.625e9)
    assert memory.training_bytes(1e12)["total"] == pytest.approx(16e12)


def test_megatron_distributed_optimizer_table():
    # Megatron Core docs, distributed optimizer: bytes/param non-distributed vs distributed (d ranks):
    #   bf16 params, fp32 grads: 18 and 6 + 12/d;   fp32 params, fp32 grads: 16 and 8 + 8/d
    d, psi = 8, 1.0
    assert memory.training_bytes(psi, "mixed_adam_fp32_grads")["total"] == 18
    assert memory.zero_model_state_bytes(psi, d, 1, "mixed_adam_fp32_grads")["total"] == 6 + 12 / 8
    assert memory.training_bytes(psi, "fp32_adam")["total"] == 16
    assert memory.zero_model_state_bytes(psi, d, 1, "fp32_adam")["total"] == 8 + 8 / 8


def test_recipe_totals_match_their_sources():
    r = memory.TRAINING_RECIPES
    assert r["mixed_adam"].total == 2 + 2 + 12  # ZeRO Section 3.1
    assert r["fp32_adam"].total == 4 + 4 + 8
    # Hugging Face "Model training anatomy": 6 (fp32 + half weights) + 4 (fp32 grads) + 8 (Adam m, v)
    hf = r["mixed_adam_fp32_grads"]
    assert (hf.params + 4, hf.grads, hf.optimizer - 4) == (6, 4, 8)
    # DeepSpeedExamples bf16_master_weight README: 2 + 2 (master) + 2 + 2 + 2 = 10N; baseline 18N
    assert r["bf16_master_adam"].total == 10
    for name, rec in r.items():
        assert rec.source and rec.copies, name


def test_inference_bytes_per_dtype():
    psi = 70e9
    assert memory.inference_bytes(psi, "fp32") == 280e9
    assert memory.inference_bytes(psi, torch.bfloat16) == 140e9
    assert memory.inference_bytes(psi, "int8") == 70e9
    assert memory.inference_bytes(psi, "int4") == 35e9


def test_ring_communication_volume():
    # DDP and ZeRO-1/2: 2(N-1)/N Psi; ZeRO-3: 3(N-1)/N Psi, i.e. 1.5x (ZeRO paper, Section 7)
    assert memory.zero_comm_elements(1000, 4, 0) == 1500  # 2 * 3/4 * 1000
    assert memory.zero_comm_elements(1000, 4, 2) == 1500
    assert memory.zero_comm_elements(1000, 4, 3) == 2250  # 3 * 3/4 * 1000
    assert memory.zero_comm_elements(1000, 1, 0) == 0


def test_padding():
    assert memory.padded_numel(10, 4) == 12
    assert memory.padded_numel(12, 4) == 12
    # 10 params over 4 ranks, padded: shards of 3 elements, 16 bytes each under mixed Adam
    assert memory.zero_model_state_bytes(10, 4, 3, padded=True)["total"] == 3 * 16
    assert memory.zero_model_state_bytes(10, 4, 3)["total"] == 10 / 4 * 16


def test_activation_formula_gpt3_layer():
    # Korthikanti et al. arXiv 2205.05198, one GPT-3 175B layer: s=2048, b=1, h=12288, a=96.
    # s*b*h = 25,165,824; 34 sbh = 855,638,016; 5 a s^2 b = 5*96*4,194,304 = 2,013,265,920
    assert memory.activation_bytes_per_layer(2048, 1, 12288, 96) == 855_638_016 + 2_013_265_920
    assert memory.activation_bytes_per_layer(2048, 1, 12288, 96, "selective") == 855_638_016
    assert memory.activation_bytes_per_layer(2048, 1, 12288, 96, "full") == 2 * 25_165_824


@pytest.mark.parametrize("call", [
    lambda: memory.training_bytes(10, "adam_in_fp7"),
    lambda: memory.zero_model_state_bytes(10, 4, 4),
    lambda: memory.zero_model_state_bytes(10, 0, 1),
    lambda: memory.zero_comm_elements(10, 2, -1),
    lambda: memory.inference_bytes(10, "fp5"),
    lambda: memory.activation_bytes_per_layer(8, 1, 8, 2, recompute="some"),
])
def test_bad_input_says_what_to_change(call):
    with pytest.raises(ValueError, match="use one of|must be|use a torch dtype"):
        call()


# ---------------------------------------------------------------------------------
# measurement of real tensors


def _adamw_step(model, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return opt


def test_model_state_bytes_after_adamw_step_equals_hand_count():
    model = build_mlp(seed=0, d_in=32, hidden=64, n_blocks=2, n_out=8)
    opt = _adamw_step(model, *mlp_batch(16))
    hand_params = sum(p.numel() * p.element_size() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    # MLP(32, 64, 2 blocks, 8 out): 2*(2048 + 64 + 2048 + 32) + 32*8 + 8 = 8648 params, fp32
    assert hand_params == 8648 * 4
    got = memory.model_state_bytes(model, opt)
    assert got["params"] == hand_params
    assert got["grads"] == hand_params
    # AdamW: exp_avg and exp_avg_sq like the parameter, plus a 4-byte fp32 `step` per tensor
    assert got["optimizer"] == 2 * hand_params + 4 * n_tensors
    assert got["optimizer_scalars"] == 4 * n_tensors
    assert got["total"] == 4 * hand_params + 4 * n_tensors
    assert memory.model_state_bytes(model)["optimizer"] == 0


def test_model_state_bytes_bf16_model_is_pure_bf16_recipe():
    model = build_mlp(seed=0).to(torch.bfloat16)
    x, y = mlp_batch(4)
    opt = _adamw_step(model, x.bfloat16(), y.bfloat16())
    psi = sum(p.numel() for p in model.parameters())
    got = memory.model_state_bytes(model, opt)
    rec = memory.TRAINING_RECIPES["pure_bf16_adam"]
    assert (got["params"], got["grads"], got["optimizer"] - got["optimizer_scalars"]) == (
        rec.params * psi, rec.grads * psi, rec.optimizer * psi)


def test_shared_weights_count_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as in GPT-2
    model = nn.ModuleDict(dict(emb=emb, head=head))
    assert memory.model_state_bytes(model)["params"] == 10 * 4 * 4
    # two views of one storage also count once
    flat = torch.zeros(12)
    assert memory.unique_storage_bytes([flat[:6], flat[6:]]) == 48


def test_saved_activation_bytes_linear_saves_its_input():
    lin = nn.Linear(8, 4)
    x = torch.randn(5, 8)
    # the weight gradient needs x: 5*8 fp32 = 160 bytes; the weight itself is a parameter, excluded
    assert memory.saved_activation_bytes(lin, x) == 160
    with torch.no_grad():
        assert memory.saved_activation_bytes(lin, x) == 0


def test_saved_activation_bytes_dedupes_and_skips_parameters():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    # Linear1 saves x (5*8*4 = 160); ReLU saves its output, which Linear2 saves too: once, 5*16*4 = 320
    assert memory.saved_activation_bytes(mlp, x) == 160 + 320
    # a plain function: w is a Parameter, so only x (and nothing else) is counted
    w = nn.Parameter(torch.randn(8, 3))
    assert memory.saved_activation_bytes(lambda t: (t @ w).sum(), x) == 160
    records = memory.saved_activations(mlp, x)
    assert [r["shape"] for r in records] == [(5, 8), (5, 16)]


def test_peak_cuda_bytes_without_cuda_says_so():
    if torch.cuda.is_available():
        t = memory.peak_cuda_bytes(lambda: torch.empty(1024, device="cuda"))
        assert t >= 4096
    else:
        with pytest.raises(RuntimeError, match="CUDA"):
            memory.peak_cuda_bytes(lambda: None)


def _dtensor_state(rows):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Linear(3, rows, bias=False)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    opt = torch.optim.AdamW(model.parameters())
    model.weight.grad = distribute_tensor(torch.ones(rows, 3), mesh, [Shard(0)])
    opt.step()
    return memory.model_state_bytes(model, opt)


def test_model_state_bytes_counts_local_shards_of_dtensors():
    from shardlib import launch

    results = launch(_dtensor_state, 2, args=(10,))
    for got in results:  # 10 rows x 3 fp32 split over 2 ranks: 5*3*4 = 60 bytes each
        assert got["params"] == 60
        assert got["grads"] == 60
        assert got["optimizer"] - got["optimizer_scalars"] == 120
