"""Quantized models sharded over CPU ranks: same outputs as one device, 1/N of the bytes per rank."""

import itertools

import pytest
import torch

from shardlib import launch
from shardlib.comm import comm_ledger
from shardlib.models import build_gpt
from shardlib.compress.quant import bytes_held, quantize_model
from shardlib.compress.quant_shard import fsdp_bytes_per_rank, shard_for_inference


def _run_sharded(model, idx):
    shard_for_inference(model)
    with torch.no_grad():
        first = model(idx)
        second = model(idx)  # gathered tensors were freed and are gathered again
    return first, second, bytes_held(model)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bits,scheme,group_size", [(8, "per_channel", None), (4, "group", 32)])
def test_sharded_quantized_gpt_matches_single_device(world_size, bits, scheme, group_size):
    model = quantize_model(build_gpt(seed=0, n_embd=64, n_layer=2), bits, scheme, group_size, embeddings=True)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(idx)
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    # formula: each tensor padded to a multiple of N, one piece of ceil(numel / N) elements per rank
    expected_bytes = sum(-(-t.numel() // world_size) * t.element_size() for t in tensors)
    for first, second, held in launch(_run_sharded, world_size, args=(model, idx)):
        assert torch.equal(first, reference) and torch.equal(second, reference)
        assert held == expected_bytes
    assert expected_bytes * world_size < bytes_held(model) + world_size * len(tensors) * 4


def _fsdp(model, idx):
    record = fsdp_bytes_per_rank(model, {"idx": idx}, units=list(model.blocks))
    return record["bytes"], record["local_numel"], record["full_numel"], record["output"]


def test_fully_shard_holds_one_nth_of_the_parameters():
    model = build_gpt(seed=0, n_embd=64, n_layer=2)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(idx)
    full = bytes_held(model)
    for held, local_numel, full_numel, output in launch(_fsdp, 4, args=(model, idx)):
        assert full_numel == sum(p.numel() for p in model.parameters())
        assert abs(local_numel - full_numel / 4) <= 64 * 4  # dim-0 sharding: a few rows of imbalance
        assert held < full / 4 * 1.05
        assert torch.allclose(output, reference, atol=1e-5)


def _gathers_in_one_forward(model, idx):
    shard_for_inference(model)
    with torch.no_grad(), comm_ledger() as ledger:
        model(idx)
    return [(r.kind, r.nbytes) for r in ledger.records]


@pytest.mark.parametrize("bits", [None, 8])
def test_every_gather_of_a_forward_is_in_the_ledger(bits):
    """One all-gather per tensor of every leaf module, each of N * ceil(numel / N) elements (the
    padded flat tensor), recorded by the ledger: nothing shardlib sends goes unrecorded."""
    model = build_gpt(seed=0, n_embd=64, n_layer=2)
    if bits is not None:
        model = quantize_model(model, bits, "per_channel", None, embeddings=True)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    n = 3
    tensors = [t for t in itertools.chain(model.parameters(), model.buffers()) if t.numel() > 0]
    expected = sorted(("all_gather", n * -(-t.numel() // n) * t.element_size()) for t in tensors)
    for records in launch(_gathers_in_one_forward, n, args=(model, idx)):
        assert sorted(records) == expected, f"{len(records)} records, {len(expected)} tensors expected"
