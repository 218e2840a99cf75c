"""shardlib.simulate: one rank of a large job run by shardlib's own code on meta tensors and the fake backend.

What is held against what:
- one layer's saved tensors (anatomy) against Korthikanti et al.'s term-by-term count (arXiv 2205.05198,
  Sec. 4.1): the paper, not the planner, checks the simulator's accounting and its GPU kernels on meta;
- a rank's model states, activation peak and bytes sent per group against the planner (shardlib.plan),
  for a 1.7B GPT on 16 ranks (Megatron-LM's Table 1 shape, arXiv 2104.04473) and each technique on a
  small model: the two were written apart, from the code and from the formulas;
- wrong variants of the code (ZeRO-2 that keeps the full gradients; a sequence-parallel block that keeps
  the gathered input, parallel.sequence's keep_gathered_input) are flagged where the real code passes;
- the shape cache returns what the meta kernels return; swiglu's gradient is autograd's.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlib.parallel.experts import swiglu
from shardlib.parallel.zero import ZeroOptimizer
from shardlib.plan import Layout, ModelSpec
from shardlib.simulate import representative_ranks, simulate
from shardlib.simulate.anatomy import layer_anatomy
from shardlib.simulate.cli import main as simulate_main
from shardlib.simulate.compare import compare
from shardlib.simulate.meta import MetaShapeCache

# Megatron-LM's 1.7B GPT (arXiv 2104.04473, Table 1: 24 layers, hidden 2304, 24 heads, vocabulary 51,200,
# sequences of 2,048)
GPT_1_7B = ModelSpec(24, 2304, 24, 51200, 2048, tied_embeddings=True, name="gpt-1.7b")
# a small Llama-shaped model: gated MLP, RMSNorm, no biases, rotary positions, no dropout
SMALL = ModelSpec(4, 256, 8, 1024, 256, ffn_hidden=688, gated_mlp=True, bias=False, norm="rmsnorm",
                  learned_positions=False, dropout=False, name="small-llama")
SMALL_MOE = ModelSpec(2, 128, 4, 512, 128, ffn_hidden=256, gated_mlp=True, bias=False, norm="rmsnorm",
                      learned_positions=False, dropout=False, n_experts=4, top_k=2, name="small-moe")


def _off(sim) -> list[str]:
    return [f"{c.quantity}: simulated {c.simulated:,.0f}, planned {c.planned:,.0f} (ratio {c.ratio:.4f})"
            for c in compare(sim) if not c.within]


# ---------------------------------------------------------------------------------
# the accounting against the paper


def _remainder(s_local: int, b: int, heads: int, attention: str, s: int) -> int:
    """What the paper's terms leave out: the 2 LayerNorms' fp32 mean and reciprocal deviation (b s 4 bytes each),
    and FlashAttention's fp32 log-sum-exp (b a s 4) with its random-number offsets (24 bytes), or, written out,
    the s x s causal mask (1 byte each, one for every layer)."""
    norms = 2 * 2 * b * s_local * 4
    return norms + (heads * s * b * 4 + 24 if attention == "flash" else s * s)


def test_a_gpt_layer_keeps_what_korthikanti_counts():
    # one GPT-3-shaped layer split 8 ways: s b h (10 + 24/t + 5 a s / (h t)) bytes with attention written out
    # (softmax, dropout mask and output: 5 a s^2 b), s b h (10 + 24/t) with FlashAttention, which keeps no scores
    spec = ModelSpec(2, 2048, 16, 1024, 512, name="gpt")  # dropout, f = 4h, multi-head attention
    s, b, h, a, t = 512, 1, 2048, 16, 8
    sbh = s * b * h
    for attention, scores in (("unfused", 5 * a * s * s * b / t), ("flash", 0)):
        kept = sum(x.nbytes for x in layer_anatomy(spec, Layout(tp=t), attention=attention))
        expected = sbh * (10 + 24 / t) + scores + _remainder(s, b, a // t, attention, s)
        assert kept == expected, f"{attention}: {kept:,} bytes kept, the paper counts {expected:,.0f}"


def test_sequence_parallelism_keeps_the_shards_and_the_wrong_variant_the_gathered_inputs():
    # Sec. 4.2.2: with sequence parallelism every term is / t, 34 s b h / t without the scores; the variant that
    # keeps the gathered inputs of q/k/v and of the MLP keeps 2 (s b h - s b h / t) more of each
    spec = ModelSpec(2, 2048, 16, 1024, 512, name="gpt")
    s, b, h, a, t = 512, 1, 2048, 16, 8
    sbh, layout = s * b * h, Layout(tp=t, sequence_parallel=True)
    kept = sum(x.nbytes for x in layer_anatomy(spec, layout))
    expected = 34 * sbh // t + _remainder(s // t, b, a // t, "flash", s)
    assert kept == expected, f"{kept:,} bytes, the paper counts {expected:,}"
    wrong = sum(x.nbytes for x in layer_anatomy(spec, layout, keep_gathered_input=True))
    assert wrong - kept == 2 * 2 * (sbh - sbh // t), f"{wrong - kept:,} bytes more"


def test_a_layer_keeps_the_same_with_and_without_the_shape_cache():
    spec = ModelSpec(2, 256, 8, 512, 128, ffn_hidden=688, gated_mlp=True, bias=False, norm="rmsnorm", dropout=False)
    rows = [layer_anatomy(spec, Layout(tp=2, sequence_parallel=True))]
    original = MetaShapeCache.__torch_dispatch__
    MetaShapeCache.__torch_dispatch__ = lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))
    try:
        rows.append(layer_anatomy(spec, Layout(tp=2, sequence_parallel=True)))
    finally:
        MetaShapeCache.__torch_dispatch__ = original
    assert rows[0] == rows[1], "the shape cache changed what a layer keeps for backward"


def test_swiglu_gradient_is_autograds():
    gate, up = (torch.randn(3, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(swiglu, (gate, up))
    ours = torch.autograd.grad(swiglu(gate, up).sum(), (gate, up))
    theirs = torch.autograd.grad((F.silu(gate) * up).sum(), (gate, up))
    assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(ours, theirs))


# ---------------------------------------------------------------------------------
# ranks against the planner


def test_a_1_7b_gpt_on_16_ranks_matches_the_planner():
    layout = Layout(dp=4, tp=2, pp=2, zero=1, micro_batch=1, sequence_parallel=True)
    for name, rank in representative_ranks(layout).items():
        sim = simulate(GPT_1_7B, layout, rank=rank, global_batch=16)
        assert not _off(sim), f"{name} (rank {rank}): {_off(sim)}"
        assert sim.n_micro == 4 and sim.wall_s < 60, f"{sim.wall_s:.1f} s"
    assert not dist.is_initialized(), "the fake process group was left behind"


SMALL_LAYOUTS = {  # (model, layout, global batch, attention)
    "ZeRO-0, pipeline": (SMALL, Layout(dp=4, tp=2, pp=2, zero=0), 16, "flash"),
    "ZeRO-2": (SMALL, Layout(dp=4, tp=2, zero=2), 16, "flash"),
    "ZeRO-3": (SMALL, Layout(dp=4, tp=2, zero=3), 16, "flash"),
    "interleaved 1F1B": (SMALL, Layout(dp=2, tp=2, pp=2, virtual_stages=2, zero=1), 8, "flash"),
    "ring attention": (SMALL, Layout(dp=2, tp=2, cp=2, zero=1), 8, "flash"),
    "experts": (SMALL_MOE, Layout(dp=4, pp=2, ep=4, zero=1), 8, "flash"),
    "full recomputation": (ModelSpec(4, 256, 8, 1024, 256, name="gpt"), Layout(dp=2, tp=2, pp=2, zero=1,
                                                                                   recompute="full"), 8, "unfused"),
}


@pytest.mark.parametrize("name", list(SMALL_LAYOUTS))
def test_each_technique_matches_the_planner(name):
    spec, layout, batch, attention = SMALL_LAYOUTS[name]
    for which, rank in representative_ranks(layout).items():
        sim = simulate(spec, layout, rank=rank, global_batch=batch, attention=attention)
        assert not _off(sim), f"{name}, {which} (rank {rank}): {_off(sim)}"
        assert sum(sim.sent_by_group().values()) > 0


# ---------------------------------------------------------------------------------
# wrong code is caught


def test_a_block_that_keeps_the_gathered_input_is_flagged():
    spec, layout = ModelSpec(4, 512, 8, 1024, 512, name="gpt"), Layout(dp=2, tp=4, pp=2, zero=1, sequence_parallel=True)
    assert not _off(simulate(spec, layout, global_batch=4)), "the real sequence-parallel block"
    off = _off(simulate(spec, layout, global_batch=4, keep_gathered_input=True))
    assert [x.split(":")[0] for x in off] == ["activation peak", "sent tp all_gather"], off  # more kept, no gathers again


def test_zero2_that_keeps_the_full_gradients_is_flagged(monkeypatch):
    layout = Layout(dp=4, tp=2, zero=2)
    assert not _off(simulate(SMALL, layout, global_batch=8)), "the real ZeRO-2"

    def reduce_and_keep(self, b):  # reduce-scatter the bucket as ZeRO-2 does, but never free the full gradients
        kept = [p.grad for p in b.params]
        original(self, b)
        for p, grad in zip(b.params, kept):
            p.grad = grad

    original = ZeroOptimizer._reduce_and_free
    monkeypatch.setattr(ZeroOptimizer, "_reduce_and_free", reduce_and_keep)
    off = _off(simulate(SMALL, layout, global_batch=8))
    assert off and off[0].startswith("model states"), f"a ZeRO-2 keeping 2 Psi of gradients passed: {off}"


# ---------------------------------------------------------------------------------
# the command line


def test_simulate_command_line(tmp_path, capsys):
    config = tmp_path / "config.json"  # a small Llama in Hugging Face's format
    config.write_text(json.dumps(dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, vocab_size=1024,
                                      max_position_embeddings=256, intermediate_size=688, hidden_act="silu",
                                      rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=False)))
    code = simulate_main(["--model", str(config), "--gpus", "8", "--tp", "2", "--pp", "2", "--global-batch", "8",
                          "--rank", "7", "--json"])
    (result,) = json.loads(capsys.readouterr().out)
    assert code == 0 and result["rank"] == 7 and result["coords"]["pp"] == 1, result
    assert {r["quantity"] for r in result["against_planner"]} >= {"model states", "activation peak",
                                                                "sent tp all_reduce", "sent pp send"}
    with pytest.raises(SystemExit):
        simulate_main(["--model", str(config), "--gpus", "8", "--tp", "3"])
    assert "dp * cp * tp * pp must be the 8 GPUs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main(["--model", str(config), "--gpus", "8", "--tp", "2", "--rank", "8"])
    assert "rank 8 is outside a world of 8 ranks" in capsys.readouterr().err
