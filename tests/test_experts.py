"""Mixture of experts and expert parallelism (shardlib/parallel/experts.py) against a token-by-token
loop written here from the papers' definitions, and the expert-parallel layer against one device."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardlib
from shardlib.comm import comm_ledger
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.experts import (MoE, ExpertParallelMoE, expert_capacity, expert_parallel_sent_bytes,
                                       load_balancing_loss, moe_parameters_per_rank, parallelize_gpt_experts, route,
                                       sync_expert_parallel_grads)


def loop_routing(logits: torch.Tensor, top_k: int, capacity_factor: float):
    """GShard's Algorithm 1 by hand: per sequence, first choices then second choices, each in token
    order, take the next place of their expert while it has one. Returns (experts, slots, kept)."""
    B, s, E = logits.shape
    capacity = min(s, math.ceil(capacity_factor * s * top_k / E))
    experts = logits.softmax(-1).topk(top_k, dim=-1).indices
    slots = torch.zeros(B, s, top_k, dtype=torch.long)
    kept = torch.zeros(B, s, top_k, dtype=torch.bool)
    for b in range(B):
        taken = [0] * E
        for choice in range(top_k):
            for t in range(s):
                e = experts[b, t, choice].item()
                slots[b, t, choice] = taken[e]
                kept[b, t, choice] = taken[e] < capacity
                taken[e] += 1
    return experts, slots, kept


def loop_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token: the gated sum of its kept experts' MLPs, one token and one expert at a time."""
    probs = moe.router(x).softmax(-1)
    experts, _, kept = loop_routing(moe.router(x), moe.top_k, moe.capacity_factor)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            chosen = probs[b, t, experts[b, t]]
            gates = chosen if moe.top_k == 1 else chosen / chosen.sum()
            for j, e in enumerate(experts[b, t].tolist()):
                if kept[b, t, j]:
                    hidden = F.gelu(x[b, t] @ moe.w1[e] + moe.b1[e])
                    out[b, t] += gates[j] * (hidden @ moe.w2[e] + moe.b2[e])
    return out


@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, 1.0), (2, 0.5), (1, 4.0)])
def test_routing_follows_gshards_order_and_drops_past_capacity(top_k, capacity_factor):
    logits = torch.randn(3, 20, 4, generator=torch.Generator().manual_seed(top_k))
    routing = route(logits, top_k, capacity_factor)
    experts, slots, kept = loop_routing(logits, top_k, capacity_factor)
    assert torch.equal(routing.experts, experts) and torch.equal(routing.kept, kept)
    assert torch.equal(routing.slots[kept], slots[kept])
    if capacity_factor < 1:
        assert not kept.all(), "a capacity factor below 1 must drop tokens"


@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.25), (2, 0.75)])
def test_the_layer_is_the_token_by_token_mixture(top_k, capacity_factor):
    torch.manual_seed(0)
    moe = MoE(8, 4, top_k, capacity_factor, ffn_hidden=16).double()
    torch.nn.init.normal_(moe.b1)
    torch.nn.init.normal_(moe.b2)  # nonzero biases: an empty place must not leak into a token
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    assert torch.allclose(moe(x), loop_moe(moe, x), atol=1e-12)


def test_capacity_and_the_load_balancing_loss_by_their_formulas():
    assert expert_capacity(64, 4, 2, 1.0) == 32 and expert_capacity(64, 8, 1, 1.25) == 10
    assert expert_capacity(10, 2, 2, 4.0) == 10  # never more places than tokens
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(64, 4, 1, 0.0)
    uniform = route(torch.zeros(1, 8, 4), 1, 1.0)  # equal probabilities: P_e = 1/4
    assert torch.allclose(load_balancing_loss(uniform), torch.tensor(1.0))  # 4 * sum_e f_e / 4
    collapsed = route(torch.tensor([10.0, 0, 0, 0]).expand(1, 8, 4), 1, 1.0)
    p = torch.tensor([10.0, 0, 0, 0]).softmax(0)[0]
    assert torch.allclose(load_balancing_loss(collapsed), 4 * p)  # f = (1, 0, 0, 0)


def test_the_moe_gpt_counts_its_parameters_and_adds_the_balancing_loss():
    config = GPTConfig(n_experts=4, top_k=2)
    model = build_gpt(config, seed=0)
    assert sum(p.numel() for p in model.parameters()) == config.n_params
    h = config.n_embd
    dense = GPTConfig().n_params
    assert config.n_params - dense == config.n_layer * (3 * (8 * h * h + 5 * h) + 4 * h)
    x, y = random_token_batches(config, 2, 1)[0]
    logits, loss = model(x, y)
    cross_entropy = F.cross_entropy(logits.view(-1, 256), y.reshape(-1))
    aux = sum(block.mlp.aux_loss for block in model.blocks)
    assert torch.allclose(loss, cross_entropy + config.aux_loss_coef * aux)
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0, "the router learns through the gates"
    with pytest.raises(ValueError, match="top_k"):
        GPTConfig(n_experts=2, top_k=3)


def test_formulas_by_hand():
    forward, backward = expert_parallel_sent_bytes(2, 64, 32, 4, 2, 1.0, 4, element_size=2)
    buffer = 4 * 2 * 32 * 32 * 2  # E * b * c * h * e, c = 64 * 2 / 4 = 32
    assert forward == backward == 2 * buffer * 3 // 4
    per_rank = moe_parameters_per_rank(32, 8, 4)
    assert per_rank == {"router": 256, "experts": 2 * (2 * 32 * 128 + 128 + 32), "per_expert": 2 * 32 * 128 + 160}


# ---------------------------------------------------------------------------------
# on ranks


def _expert_parallel_vs_one_device(top_k, capacity_factor):
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    moe = MoE(8, 4, top_k, capacity_factor, ffn_hidden=16).double()
    x = torch.randn(2 * n, 16, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2 * n, 16, 8, dtype=torch.float64)
    layer = ExpertParallelMoE.from_moe(moe, group=dist.group.WORLD)
    reference = moe(x)
    (reference * weights).sum().backward()
    mine = slice(2 * rank, 2 * rank + 2)  # this rank's 2 sequences
    kept = moe.routing.kept[mine]
    x_mine = x.detach()[mine].clone().requires_grad_()
    with comm_ledger() as forward:
        out = layer(x_mine)
    with comm_ledger() as backward:
        (out * weights[mine]).sum().backward()
    experts = slice(rank * 4 // n, (rank + 1) * 4 // n)
    diffs = [(out - reference[mine]).abs().max().item(), (x_mine.grad - x.grad[mine]).abs().max().item(),
             (layer.w1.grad - moe.w1.grad[experts]).abs().max().item(),
             (layer.b2.grad - moe.b2.grad[experts]).abs().max().item()]
    # the router: each rank's gradient covers its tokens; summed over ranks, the whole batch's
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    diffs.append((router_grad - moe.router.weight.grad).abs().max().item())
    return max(diffs), torch.equal(layer.routing.kept, kept), forward.summary(), backward.summary()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, 0.75)])
def test_expert_parallel_layer_equals_one_device_and_sends_what_the_formula_says(world_size, top_k, capacity_factor):
    results = shardlib.launch(_expert_parallel_vs_one_device, world_size, args=(top_k, capacity_factor), device="cpu")
    expected = expert_parallel_sent_bytes(2, 16, 8, 4, top_k, capacity_factor, world_size, element_size=8)
    for rank, (diff, same_drops, forward, backward) in enumerate(results):
        assert diff < 1e-12, f"rank {rank}: output or gradients differ from one device by {diff}"
        assert same_drops, f"rank {rank}: dropped other tokens than one device"
        assert (forward["all_to_all"]["calls"], backward["all_to_all"]["calls"]) == (2, 2)
        assert (forward["all_to_all"]["sent_bytes"], backward["all_to_all"]["sent_bytes"]) == expected


def _gpt_grads_ep_dp():
    from shardlib.mesh import Mesh
    from shardlib.parallel.experts import gather_experts
    from shardlib.reference import model_loss, rank_slice

    config = GPTConfig(n_experts=4, top_k=2, capacity_factor=1.0)
    batch = random_token_batches(config, 8, 1)[0]
    reference = build_gpt(config, seed=0).double()
    model_loss(reference, batch).backward()
    mesh = Mesh((2, 2), ("dp", "ep"))
    model = parallelize_gpt_experts(build_gpt(config, seed=0).double(), group=mesh.group("ep"))
    model_loss(model, rank_slice(batch, dist.get_rank(), 4)).backward()
    sync_expert_parallel_grads(model, group=dist.group.WORLD, data_group=mesh.group("dp"))
    grads = gather_experts({name: p.grad for name, p in model.named_parameters()}, group=mesh.group("ep"))
    return max((grads[name] - p.grad).abs().max().item() for name, p in reference.named_parameters())


@pytest.mark.slow
def test_expert_and_data_parallel_gradients_equal_one_device():
    assert max(shardlib.launch(_gpt_grads_ep_dp, 4, device="cpu")) < 1e-12


def _split_three_ways():
    moe = MoE(8, 4)
    try:
        ExpertParallelMoE.from_moe(moe, group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_experts_that_do_not_split_are_refused_with_the_sizes_that_work():
    assert all("use a size in [1, 2, 4]" in message for message in shardlib.launch(_split_three_ways, 3, device="cpu"))
