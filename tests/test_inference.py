"""shardlib.inference.generate and shardlib.inference.serving: sharded greedy generation equals one device's, and its traffic the formulas."""

from __future__ import annotations

import pytest
import torch

from shardlib.inference.generate import EmulatedDevice, forward_step
from shardlib.models import GPTConfig, build_gpt
from shardlib.inference.serving import course_prompts, decode_traffic, serve

CONFIG = GPTConfig(seq_len=32, n_layer=4, n_head=4, n_embd=32)
REQUESTS, PROMPT, NEW = 4, 8, 10
LAYOUTS = [("tp", 2, 1), ("tp", 4, 1), ("dp", 2, 1), ("dp", 4, 1), ("pp", 2, 1), ("pp", 2, 2), ("pp", 4, 1), ("pp", 4, 4)]


@pytest.fixture(scope="module")
def prompts():
    return course_prompts(REQUESTS, PROMPT)


@pytest.fixture(scope="module")
def single(prompts):
    return serve("single", 1, CONFIG, prompts, NEW, repeats=0)


def test_kv_cache_gives_the_full_forward_logits():
    # prefill 5 positions, then one at a time: each step's logits equal the model's on the whole prefix
    model = build_gpt(CONFIG, seed=1)
    ids = torch.randint(0, CONFIG.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    caches = [[] for _ in model.blocks]
    with torch.no_grad():
        logits = forward_step(model, ids[:, :5], caches, 0)
        torch.testing.assert_close(logits[:, -1], model(ids[:, :5])[:, -1], rtol=1e-5, atol=1e-5)
        for t in range(5, 9):
            logits = forward_step(model, ids[:, t:t + 1], caches, t)
            torch.testing.assert_close(logits[:, -1], model(ids[:, :t + 1])[:, -1], rtol=1e-5, atol=1e-5)


def test_single_device_equals_gpt_generate(single):
    assert torch.equal(single["ids"], single["reference"])
    assert single["ids"].shape == (REQUESTS, PROMPT + NEW)


@pytest.mark.parametrize("layout,n,m", LAYOUTS)
def test_sharded_generation_is_single_device_greedy(single, prompts, layout, n, m):
    result = serve(layout, n, CONFIG, prompts, NEW, m, repeats=0)
    assert torch.equal(result["ids"], single["reference"])  # GPT.generate on one device
    assert result["tokens_per_s"] > 0 and result["latency_s"] > 0


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
    device = EmulatedDevice(memory_bandwidth=1e9, flops=1e10)
    assert device.pass_seconds(model, 1) == pytest.approx(4 * psi / 1e9)  # memory-bound: the fp32 weights once
    assert device.pass_seconds(model, 1000) == pytest.approx(2 * psi * 1000 / 1e10)  # compute-bound


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
