"""shardlib.inference.generate, kv_cache and serving: the KV cache against the full forward and its formula,
grouped-query attention against multi-head attention, sharded greedy generation against one device's."""

from __future__ import annotations

import pytest
import torch

from shardlib.inference.generate import EmulatedDevice, forward_step
from shardlib.inference.kv_cache import (
    KVCache,
    PagedKVCache,
    kv_cache_bytes,
    kv_cache_formula_bytes,
    kv_heads_per_rank,
)
from shardlib.inference.serving import course_prompts, decode_traffic, serve
from shardlib.launch import launch
from shardlib.models import GPTConfig, build_gpt
from shardlib.parallel.tensor_gpt import check_tp_config, parallelize_gpt

CONFIG = GPTConfig(seq_len=32, n_layer=4, n_head=4, n_embd=32)
GQA = GPTConfig(seq_len=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=32)
REQUESTS, PROMPT, NEW = 4, 8, 10
LAYOUTS = [("tp", 2, 1), ("tp", 4, 1), ("dp", 2, 1), ("dp", 4, 1), ("pp", 2, 1), ("pp", 2, 2), ("pp", 4, 1), ("pp", 4, 4)]


@pytest.fixture(scope="module")
def prompts():
    return course_prompts(REQUESTS, PROMPT)


@pytest.fixture(scope="module")
def single(prompts):
    return serve("single", 1, CONFIG, prompts, NEW, repeats=0)


@pytest.mark.parametrize("config", [CONFIG, GQA], ids=["mha", "gqa"])
def test_kv_cache_gives_the_full_forward_logits(config):
    # prefill 5 positions, then one at a time: each step's logits equal the model's on the whole prefix
    model = build_gpt(config, seed=1)
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model, 3, 9)
    with torch.no_grad():
        logits = forward_step(model, ids[:, :5], cache, 0)
        torch.testing.assert_close(logits[:, -1], model(ids[:, :5])[:, -1], rtol=1e-5, atol=1e-5)
        for t in range(5, 9):
            logits = forward_step(model, ids[:, t:t + 1], cache, t)
            torch.testing.assert_close(logits[:, -1], model(ids[:, :t + 1])[:, -1], rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_is_attention_with_shared_kv_heads():
    # the GQA model equals the multi-head model whose k and v heads are copies: head j of 4 uses kv head j // 2
    gqa = build_gpt(GQA, seed=3)
    mha = build_gpt(CONFIG, seed=4)
    state = gqa.state_dict()
    for name in state:
        if name.endswith(("k_proj.weight", "v_proj.weight", "v_proj.bias")):
            state[name] = state[name].view(2, 8, *state[name].shape[1:]).repeat_interleave(2, dim=0).flatten(0, 1)
    mha.load_state_dict(state)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids), rtol=0, atol=0)
    assert GQA.n_params == sum(p.numel() for p in gqa.parameters())
    assert CONFIG.n_params - GQA.n_params == 4 * (2 * 32 + 1) * 16  # L (2h + 1)(h - h_kv)


@pytest.mark.parametrize("heads,t,expected", [(8, 1, 8), (8, 2, 4), (8, 8, 1), (2, 4, 1), (1, 4, 1)])
def test_kv_heads_per_rank(heads, t, expected):
    assert kv_heads_per_rank(heads, t) == expected


def test_cache_bytes_are_the_formula():
    for config in (CONFIG, GQA):
        model = build_gpt(config)
        cache = KVCache(model, batch=3, capacity=20)
        hd = config.n_embd // config.n_head
        assert kv_cache_bytes(cache) == 2 * config.n_layer * config.kv_heads * hd * 20 * 3 * 4
        assert kv_cache_bytes(cache) == kv_cache_formula_bytes(config, context=20, batch=3)
        paged = PagedKVCache(model, n_blocks=5, block_size=4)
        assert kv_cache_bytes(paged) == kv_cache_formula_bytes(config, context=20, batch=1)
        assert paged.block_bytes * 5 == kv_cache_bytes(paged)
    assert kv_cache_formula_bytes(GQA, 10, 1) * 2 == kv_cache_formula_bytes(CONFIG, 10, 1)  # 2 kv heads of 4


def test_grouped_query_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match=r"n_kv_head=3 must divide n_head=4.*\[1, 2, 4\]"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="t must divide n_kv_head"):
        check_tp_config(GPTConfig(n_head=12, n_kv_head=3, n_embd=48), 2)


def _tp_logits(config, grad):
    model = parallelize_gpt(build_gpt(config, seed=0))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with torch.set_grad_enabled(grad):
        return model(ids).shape


@pytest.mark.slow
def test_replicated_kv_heads_serve_inference_and_refuse_training():
    assert launch(_tp_logits, 4, args=(GQA, False), device="cpu") == [torch.Size([1, 4, 64])] * 4
    with pytest.raises(Exception, match="serve inference only"):
        launch(_tp_logits, 4, args=(GQA, True), device="cpu")


def test_single_device_equals_gpt_generate(single):
    assert torch.equal(single["ids"], single["reference"])
    assert single["ids"].shape == (REQUESTS, PROMPT + NEW)


@pytest.mark.slow
@pytest.mark.parametrize("layout,n,m", LAYOUTS)
def test_sharded_generation_is_single_device_greedy(single, prompts, layout, n, m):
    result = serve(layout, n, CONFIG, prompts, NEW, m, repeats=0)
    assert torch.equal(result["ids"], single["reference"])  # GPT.generate on one device
    assert result["tokens_per_s"] > 0 and result["latency_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_generation_with_grouped_query_attention(prompts, t):
    # t = 2 splits the 2 kv heads, t = 4 replicates each on 2 ranks: the same tokens as one device
    reference = build_gpt(GQA, seed=0).generate(prompts, NEW)
    assert torch.equal(serve("tp", t, GQA, prompts, NEW, repeats=0)["ids"], reference)


@pytest.mark.slow
def test_tensor_parallel_traffic_per_token(prompts):
    # per decode step and rank: 2 all-reduces of b*h per layer (attention and MLP outputs), one for the
    # vocabulary-parallel embedding, and one all-gather of the b*V logits (S = the gathered tensor)
    t, b, h, V, L = 2, REQUESTS, CONFIG.n_embd, CONFIG.vocab_size, CONFIG.n_layer
    result = serve("tp", t, CONFIG, prompts, NEW, repeats=0)
    per_step = [("all_reduce", b * h * 4)] * (2 * L + 1) + [("all_gather", b * V * 4)]
    assert sorted(result["decode_records"]) == sorted(per_step * (NEW - 1))
    ring = (2 * L + 1) * 2 * (t - 1) / t * b * h * 4 + (t - 1) / t * b * V * 4  # ring bytes sent per rank
    assert result["decode_sent_bytes"] == pytest.approx([ring] * t)
    assert result["decode_sent_bytes"] == pytest.approx(decode_traffic("tp", t, CONFIG, b))


@pytest.mark.slow
def test_pipeline_and_replica_traffic_per_token(prompts):
    b, h = REQUESTS, CONFIG.n_embd
    pp = serve("pp", 4, CONFIG, prompts, NEW, 2, repeats=0)
    # per step: stages 0..2 send their (b/m, 1, h) activation for each of the m groups; the last stage
    # sends each group's (b/m, 1) new token ids (int64) back to stage 0
    assert pp["decode_sent_bytes"] == pytest.approx([b * h * 4] * 3 + [b * 8])
    assert pp["decode_sent_bytes"] == pytest.approx(decode_traffic("pp", 4, CONFIG, b))
    assert sorted(pp["decode_records"]) == sorted([("send", b // 2 * h * 4)] * 2 * (NEW - 1)
                                                  + [("recv", b // 2 * 8)] * 2 * (NEW - 1))
    dp = serve("dp", 2, CONFIG, prompts, NEW, repeats=0)
    assert dp["decode_sent_bytes"] == [0, 0] and dp["decode_records"] == []


def test_emulated_device_roofline():
    model = build_gpt(CONFIG, seed=0)
    psi = CONFIG.n_params
    device = EmulatedDevice(memory_bandwidth=1e9, flops=1e10, collective_latency=1.0)
    assert device.pass_seconds(model, 1) == pytest.approx(4 * psi / 1e9)  # memory-bound: the fp32 weights once
    assert device.pass_seconds(model, 1000) == pytest.approx(2 * psi * 1000 / 1e10)  # compute-bound; no collective


def _tp_pass_seconds():
    device = EmulatedDevice(memory_bandwidth=1e9, flops=1e10, collective_latency=1.0)
    model = parallelize_gpt(build_gpt(CONFIG, seed=0))
    return device.pass_seconds(model, 1), sum(p.numel() * 4 for p in model.parameters()) / 1e9


@pytest.mark.slow
def test_emulated_link_latency_counts_the_collectives_of_a_tensor_parallel_pass():
    # 2L + 1 all-reduces (attention, MLP per layer; the embedding) and the logits' all-gather: 2L + 2 = 10
    for seconds, read in launch(_tp_pass_seconds, 2, device="cpu"):
        assert seconds == pytest.approx(read + 10 * 1.0)


def test_bad_requests_fail_before_launch(prompts):
    with pytest.raises(ValueError, match="must fit seq_len"):
        serve("tp", 2, CONFIG, prompts, CONFIG.seq_len, repeats=0)
    with pytest.raises(ValueError, match="not divisible"):
        serve("tp", 3, CONFIG, prompts, NEW, repeats=0)
    with pytest.raises(ValueError, match="do not split over 3 replicas"):
        serve("dp", 3, CONFIG, prompts, NEW, repeats=0)
    with pytest.raises(ValueError, match="only the pp layout"):
        serve("tp", 2, CONFIG, prompts, NEW, 2, repeats=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        serve("ep", 2, CONFIG, prompts, NEW)
