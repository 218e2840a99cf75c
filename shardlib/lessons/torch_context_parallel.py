"""PyTorch's own context parallelism beside shardlib's ring attention (lesson 11).

`torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`
shards the given tensors along the sequence and, inside the context, replaces the CUDA kernels of
F.scaled_dot_product_attention (flash, memory-efficient, cuDNN) by ring attention over the mesh
(https://docs.pytorch.org/docs/stable/distributed.tensor.html, "context_parallel"). On a CPU-only
machine SDPA calls `aten._scaled_dot_product_flash_attention_for_cpu`, which it does not handle:
`public_api_on_cpu` returns the error it raises. The ring loop underneath,
`_templated_ring_attention`, takes the attention kernel as an argument; `torch_ring_attention` calls
it with the CPU flash kernel. It is private, so it may change from one PyTorch release to the next:
this lesson pins what it does in PyTorch 2.14. Its options (module-level in PyTorch, restored here
after each call): load balancing for a zigzag ("round-robin") layout, and how K,V move: "allgather"
(the default: one all-gather of every block, then N steps of compute) or "alltoall" (one block per
step, a ring written with all-to-all).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["public_api_on_cpu", "torch_ring_attention"]


def public_api_on_cpu() -> str:
    """In a launched rank: run SDPA under the public context_parallel on CPU tensors; the error it raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (torch.randn(1, 2, 8 * dist.get_world_size(), 4) for _ in range(3))  # (B, nh, s, d)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except (NotImplementedError, RuntimeError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return "no error: the public API ran on CPU"


def _cpu_flash_attention(q, k, v, is_causal, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)  # (out, lse)


def torch_ring_attention(q, k, v, *, group, zigzag: bool, rotate: str = "alltoall") -> torch.Tensor:
    """PyTorch's ring loop on CPU tensors: q, k, v (B, nh, s/N, d) of a contiguous (zigzag=False) or
    zigzag (zigzag=True) layout -> causal attention output (B, nh, s/N, d)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    options = cp._cp_options
    saved = options.enable_load_balance, options.rotate_method
    options.enable_load_balance = zigzag
    cp.set_rotate_method(rotate)
    try:
        out, _lse, *_ = cp._templated_ring_attention(group, 2, _cpu_flash_attention, q, k, v, is_causal=True)
    finally:
        options.enable_load_balance, options.rotate_method = saved
    return out
