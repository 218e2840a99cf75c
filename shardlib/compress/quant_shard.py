"""Sharding and quantization together: ZeRO-3 style sharded inference of any model.

`shard_for_inference(model)` is the inference half of ZeRO-3 / FSDP (arXiv 1910.02054):
every tensor of every leaf module (weights, biases, norms, embeddings, and the int8 /
packed int4 weights and scales of `shardlib.compress.quant`) is flattened, padded to a multiple
of N and cut into N equal pieces; rank r keeps piece r. Just before a leaf module runs,
a forward pre-hook all-gathers its tensors; right after, a hook frees them again.

    bytes per rank at rest    sum over tensors of ceil(numel / N) * element_size  ~ bytes / N
    per forward, per rank     all-gather receives (N-1)/N of every tensor once
    transient                 the full tensors of the leaf module that is running

The sharding does not care what the bytes mean, so quantizing first divides both the
memory and the all-gather traffic by the quantization factor. Outputs are the same as
the unsharded model's: gathering reassembles the very same tensors.

`fsdp_bytes_per_rank` measures the same thing with PyTorch's own `fully_shard` (FSDP2),
which shards floating-point parameters along dim 0 (docs:
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlib.comm import ops
from shardlib.compress.quant import bytes_held
from shardlib.launch import current_device


def _own_tensors(module: nn.Module) -> list[str]:
    named = itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
    return [name for name, t in named if t is not None and t.numel() > 0]


def _set(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    if name in module._parameters:
        module._parameters[name].data = tensor
    else:
        module._buffers[name] = tensor


def _gather(module: nn.Module, args, group=None) -> None:
    world = dist.get_world_size(group)
    for name, (shape, numel) in module._shard_meta.items():
        local = module._buffers[name + "_shard"]  # (chunk,)
        full = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)  # (N * chunk,)
        ops.all_gather_into_tensor(full, local, group=group)
        _set(module, name, full[:numel].view(shape))


def _free(module: nn.Module, args, output) -> None:
    for name in module._shard_meta:
        _set(module, name, torch.empty(0, dtype=module._buffers[name + "_shard"].dtype))


def shard_for_inference(model: nn.Module, *, group=None) -> nn.Module:
    """Keep 1/N of every leaf module's tensors on this rank, gathered per module when it runs. In place."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for module in model.modules():
        names = [] if next(module.children(), None) is not None else _own_tensors(module)
        if not names:
            continue
        module._shard_meta = {}
        for name in names:
            full = getattr(module, name).detach()
            chunk = -(-full.numel() // world)  # ceil(numel / N)
            flat = torch.cat([full.reshape(-1), full.new_zeros(chunk * world - full.numel())])  # (N * chunk,)
            module.register_buffer(name + "_shard", flat[rank * chunk:(rank + 1) * chunk].clone())  # (chunk,)
            module._shard_meta[name] = (full.shape, full.numel())
            _set(module, name, torch.empty(0, dtype=full.dtype))
        module.register_forward_pre_hook(partial(_gather, group=group))
        module.register_forward_hook(_free)
    return model


def fsdp_bytes_per_rank(model: nn.Module, example_input, units=None, *, group=None) -> dict:
    """Shard `model` with PyTorch's fully_shard (each of `units`, then the root); measure one rank.

    Returns the bytes this rank holds after a forward, the numel of its local shards against the full
    numel, and the output of a forward on `example_input` (a dict of keyword arguments).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    full_numel = sum(p.numel() for p in model.parameters())
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device_type=current_device().type)
    for unit in units or ():
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)  # the root too: no backward follows
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    with torch.no_grad():
        output = model(**example_input)
    return {"bytes": bytes_held(model), "local_numel": local_numel, "full_numel": full_numel, "output": output}
