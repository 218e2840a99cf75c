"""Running shardlib's code on `meta` tensors: the GPU's kernels where they keep other tensors than
the CPU's for backward, and shape results remembered.

A meta tensor has a shape, a dtype and strides, and no data: every operation computes the shape of
its result and allocates nothing, so a 70B-parameter layer runs on a laptop. What autograd keeps
for backward depends on the kernel, and on meta PyTorch runs the CPU's composite versions of a few
operations that a GPU runs as one fused kernel; `gpu_kernels_on_meta` gives meta tensors the GPU's
(and leaves every other tensor alone):

- Attention. On a GPU, F.scaled_dot_product_attention in bf16 picks the FlashAttention kernel
  (Dao et al., arXiv 2205.14135), which keeps q, k, v, the output and the (b, a, s) log-sum-exp for
  backward and recomputes the s x s scores there. On meta it takes the math path, which keeps the
  scores in fp32. attention="flash" sends the call to the FlashAttention operator itself
  (torch.ops.aten._scaled_dot_product_flash_attention, which has a meta kernel and a derivative),
  so the tensors autograd saves are the GPU's. attention="unfused" runs attention as GPUs did before
  it (Megatron-LM in 2021, arXiv 2104.04473): q k^T, the causal softmax, dropout, times v, keeping
  the 16-bit softmax, the dropout mask and its output (5 a s^2 b bytes, arXiv 2205.05198).
- Dropout. On a GPU F.dropout is the fused native_dropout kernel, which keeps a 1-byte mask;
  elsewhere it multiplies by a mask in the input's dtype and keeps that. On meta it runs as the GPU's.
- RMSNorm. On a GPU F.rms_norm is one fused kernel that keeps its input and the (b, s, 1) fp32
  reciprocal root mean square (as LayerNorm's kernel keeps input, mean and reciprocal deviation);
  elsewhere it is composed of fp32 operations that keep fp32 copies of the input. `_FusedRMSNorm`
  stands for the kernel on meta: it keeps what the kernel keeps and returns results of its shapes.

Speed. Many meta kernels are Python decompositions (LayerNorm's backward: ~3 ms each). The result
of an operation on meta tensors depends only on the inputs' shapes, strides and dtypes and on its
other arguments, so `MetaShapeCache` computes it once per distinct call and afterwards returns new
empty tensors of the remembered shapes (PyTorch's FakeTensor keeps such a cache for the same
reason). Views and in-place operations, whose results share storage with their inputs, and
anything with a side effect (collectives) always run.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["meta_execution", "MetaShapeCache", "gpu_kernels_on_meta", "ATTENTION"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
ATTENTION = ("flash", "unfused")  # the planner's names for what a layer keeps ("flash-triton" keeps what "flash" keeps)


@contextmanager
def gpu_kernels_on_meta(attention: str = "flash"):
    """Inside: on meta tensors F.scaled_dot_product_attention runs as the FlashAttention kernel (or
    written out), F.rms_norm as the fused RMSNorm kernel, F.dropout as native_dropout; on other tensors
    they are untouched. The functions of torch.nn.functional are replaced for the duration (a mode would
    not reach the forwards that recomputation runs inside backward), and put back after."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    originals = {name: getattr(F, name) for name in ("scaled_dot_product_attention", "rms_norm", "dropout")}

    def attention_on_meta(q, k, v, *args, **kwargs):
        if not q.is_meta:
            return originals["scaled_dot_product_attention"](q, k, v, *args, **kwargs)
        return (_flash_attention if attention == "flash" else _unfused_attention)(q, k, v, *args, **kwargs)

    def rms_norm_on_meta(x, *args, **kwargs):
        return _rms_norm(x, *args, **kwargs) if x.is_meta else originals["rms_norm"](x, *args, **kwargs)

    def dropout_on_meta(x, *args, **kwargs):
        return _dropout(x, *args, **kwargs) if x.is_meta else originals["dropout"](x, *args, **kwargs)

    replacements = {"scaled_dot_product_attention": attention_on_meta, "rms_norm": rms_norm_on_meta,
                    "dropout": dropout_on_meta}
    for name, fn in replacements.items():
        setattr(F, name, functools.wraps(originals[name])(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(F, name, fn)


def _dropout(x, p=0.5, training=True, inplace=False):
    return torch.native_dropout(x, p, True)[0] if training and p > 0 else x  # keeps a bool mask


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        raise ValueError("attention on meta tensors here is causal or unmasked: no attn_mask")
    # grouped-query attention (k, v with fewer heads): the kernel reads each kv head for its query heads and keeps
    # k, v as they are, no repeated copies
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


def _unfused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        raise ValueError("attention on meta tensors here is causal or unmasked: no attn_mask")
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # (B, nh, s, d)
    scores = (q @ k.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)  # (B, nh, s, s)
    if is_causal:
        scores = scores.masked_fill(_causal_mask(q.shape[-2], q.device), float("-inf"))
    probs = _dropout(torch.softmax(scores, dim=-1), dropout_p)  # keeps the softmax, the mask, their product
    return probs @ v  # (B, nh, s, d)


@functools.lru_cache(maxsize=8)
def _causal_mask(s: int, device) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)  # (s, s): one for every layer


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
            if spec is None:  # one tensor
                return torch.empty_strided(metas[0], metas[1], dtype=metas[2], device="meta")
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
        metas = [(o.shape, o.stride(), o.dtype) for o in outs]
        self.results[key] = (None, metas[0]) if isinstance(out, torch.Tensor) else (spec, metas)
        self.misses += 1
        return out


def _call_key(func, args, kwargs):
    """What the result of func(*args, **kwargs) depends on, hashable; None when not all on meta."""
    key = [func]
    for value in args:
        if not _add_to_key(key, value):
            return None
    for item in kwargs.items():  # (name, value)
        if not _add_to_key(key, item):
            return None
    return tuple(key)


def _add_to_key(key: list, value) -> bool:
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            return False
        key.append((value.shape, value.stride(), value.dtype, value.storage_offset()))
    elif isinstance(value, (list, tuple)):
        key.append(("[", len(value)))
        for v in value:
            if not _add_to_key(key, v):
                return False
    elif isinstance(value, _PLAIN):
        key.append(value)
    else:
        return False  # a generator, a process group...: run it
    return True


@contextmanager
def meta_execution(attention: str = "flash"):
    """Inside: attention and RMSNorm on meta tensors run as the GPU's kernels, meta shape results are remembered."""
    cache = MetaShapeCache()
    with gpu_kernels_on_meta(attention), cache:
        yield cache
