"""Running shardlib's code on `meta` tensors: attention as a GPU runs it, and shape results remembered.

A meta tensor has a shape, a dtype and strides, and no data: every operation computes the shape of
its result and allocates nothing, so a 70B-parameter layer runs on a laptop. Two things make that
run faithful and fast:

- Attention. On a GPU, F.scaled_dot_product_attention in bf16 picks the FlashAttention kernel
  (Dao et al., arXiv 2205.14135), which keeps q, k, v, the output and the (b, a, s) log-sum-exp for
  backward and recomputes the s x s scores there. On meta it takes the math path, which keeps the
  scores in fp32. `flash_attention_on_meta` sends the call to the FlashAttention operator itself
  (torch.ops.aten._scaled_dot_product_flash_attention, which has a meta kernel and a derivative),
  so the tensors autograd saves are the GPU's.
- RMSNorm. On a GPU F.rms_norm is one fused kernel that keeps its input and the (b, s, 1) fp32
  reciprocal root mean square (as LayerNorm's kernel keeps input, mean and reciprocal deviation);
  elsewhere it is composed of fp32 operations that keep fp32 copies of the input. `_FusedRMSNorm`
  stands for the kernel on meta: it keeps what the kernel keeps and returns results of its shapes.
- Speed. Many meta kernels are Python decompositions (LayerNorm's backward: ~3 ms each). The result
  of an operation on meta tensors depends only on the inputs' shapes, strides and dtypes and on its
  other arguments, so `MetaShapeCache` computes it once per distinct call and afterwards returns new
  empty tensors of the remembered shapes (PyTorch's FakeTensor keeps such a cache for the same
  reason). Views and in-place operations, whose results share storage with their inputs, and
  anything with a side effect (collectives) always run.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["meta_execution", "MetaShapeCache", "GPUKernelsOnMeta"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


class GPUKernelsOnMeta(TorchFunctionMode):
    """On meta tensors: F.scaled_dot_product_attention as the FlashAttention kernel, F.rms_norm as the
    fused RMSNorm kernel; everything else as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].is_meta:
            return _flash_attention(*args, **kwargs)
        if func is F.rms_norm and args and args[0].is_meta:
            return _rms_norm(*args, **kwargs)
        return func(*args, **kwargs)


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves n_head / n_kv query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # (B, nh, s, d)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


class _FusedRMSNorm(torch.autograd.Function):
    """The fused kernel's bookkeeping: keeps x and rstd (b, s, 1) fp32; gradients of x's and weight's shapes."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)  # (b, s, 1)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)  # (b, s, h)

    @staticmethod
    def backward(ctx, grad):
        x, _, weight = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight)


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    return _FusedRMSNorm.apply(x, weight)


class MetaShapeCache(TorchDispatchMode):
    """Below autograd: an operation on meta tensors seen before returns new tensors of the remembered
    shapes without running its (often Python) meta kernel. `hits` / `misses` count the two cases."""

    def __init__(self):
        super().__init__()
        self.results: dict = {}
        self.always_run: set = set()  # views, in-place and mutating operations, non-meta results
        self.hits = self.misses = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.always_run:
            return func(*args, **kwargs)
        key = _call_key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        remembered = self.results.get(key)
        if remembered is not None:
            self.hits += 1
            spec, metas = remembered
            return tree_unflatten([torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                                   for shape, stride, dtype in metas], spec)
        schema = func._schema
        if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
            self.always_run.add(func)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        outs, spec = tree_flatten(out)
        if not all(isinstance(o, torch.Tensor) and o.is_meta and o.storage_offset() == 0 for o in outs):
            self.always_run.add(func)  # a None, a number or a non-meta tensor among the results
            return out
        self.results[key] = (spec, [(tuple(o.shape), o.stride(), o.dtype) for o in outs])
        self.misses += 1
        return out


def _call_key(func, args, kwargs):
    """What the result of func(*args, **kwargs) depends on, hashable; None when not all on meta."""
    key = [func]
    for value in (*args, *kwargs.items()):  # a kwargs item is a (name, value) pair
        if not _add_to_key(key, value):
            return None
    return tuple(key)


def _add_to_key(key: list, value) -> bool:
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            return False
        key.append((tuple(value.shape), value.stride(), value.dtype, value.storage_offset()))
    elif isinstance(value, (list, tuple)):
        key.append(("[", len(value)))
        return all(_add_to_key(key, v) for v in value)
    elif isinstance(value, _PLAIN):
        key.append(value)
    else:
        return False  # a generator, a process group...: run it
    return True


@contextmanager
def meta_execution():
    """Inside: attention and RMSNorm on meta tensors run as the GPU's kernels, meta shape results are remembered."""
    cache = MetaShapeCache()
    with GPUKernelsOnMeta(), cache:
        yield cache
