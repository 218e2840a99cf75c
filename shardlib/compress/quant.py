"""Weight quantization from scratch: int8 per-tensor and per-channel, int4 in groups.

Symmetric absmax quantization (Wu et al., arXiv 2004.09602) of a weight W (out, in)
to b bits, one scale s per group of weights:

    qmax  = 2^(b-1) - 1                 127 for int8, 7 for int4
    s     = max |W_group| / qmax
    q     = round(W / s)                 an integer in [-qmax, qmax]
    W_hat = q * s                        |W - W_hat| <= s / 2 for every element

The scheme decides what a group is:

    per_tensor   one scale for the whole matrix: one outlier stretches s for every weight
    per_channel  one scale per output row (`in` weights): an outlier only hurts its own row
    group        one scale per `group_size` consecutive inputs of a row; int4 needs this
                 (GPTQ, arXiv 2210.17323, and AWQ, arXiv 2306.00978, use g = 128)

LLM.int8() (arXiv 2208.07339) shows that transformers carry a few large-magnitude
outliers; the finer the groups, the fewer weights share an outlier's coarse scale.

Bytes per weight, scales included (`bytes_held` measures the real tensors; these are
the formulas it should agree with):

    fp32 32 bits, bf16 16 bits
    int8 per_tensor     8 + 32 / (out * in) bits
    int8 per_channel    8 + 32 / in          (one fp32 scale per row)
    int4 groups of g    4 + 32 / g           (fp32 scales; 4 + 16 / g with fp16 scales)

Int4 values are stored as q + 8 in [0, 15], two per uint8 byte (low nibble = even column).

Both together. Sharding for inference (ZeRO-3 / FSDP without gradients, arXiv 1910.02054;
`shardlib.compress.quant_shard.shard_for_inference`) keeps 1/N of every flattened, padded tensor
on each of N ranks and all-gathers a module's tensors just before it runs:

    bytes per rank at rest    Psi * bytes_per_weight / N   (+ < N padding elements per tensor)
    per forward, per rank     all-gather receives (N-1)/N * Psi * bytes_per_weight
    transient                 the full tensors of the one module that is running

so quantized weights shrink both the bytes held and the bytes sent, by the same factor.

Cost of `QuantLinear`: it dequantizes on the fly. Each forward rebuilds the full weight
in the compute dtype (out * in * 4 extra bytes for a moment, O(out * in) work) and runs
an ordinary fp32 matmul. That saves memory at rest, not time: fast int8/int4 inference
needs kernels that dequantize in registers or multiply in integers. `QuantEmbedding`
stores an embedding table (V, C) the same way (a "row" is a token) and dequantizes only
the rows it looks up.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlib.timing import interleaved_times

SUPPORTED_BITS = (8, 4)
SCHEMES = ("per_tensor", "per_channel", "group")

# ---------------------------------------------------------------------------------
# quantize / dequantize a 2-D weight


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def check_quant_args(bits: int, scheme: str, group_size: int | None, in_features: int | None = None,
                     name: str = "weight", dim_name: str = "in_features") -> None:
    """Raise a ValueError saying what to change, before any work is done.

    in_features: the length of the rows that groups and int4 pairs cut (`dim_name` names it).
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported: use 8 (int8) or 4 (int4, packed two per byte)")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES}")
    if scheme == "group" and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"scheme='group' needs a positive integer group_size, got {group_size!r}")
    if in_features is None:
        return
    if scheme == "group" and in_features % group_size:
        raise ValueError(f"group_size={group_size} does not divide {dim_name}={in_features} of {name}: "
                         f"choose a divisor of {in_features} (e.g. {math.gcd(in_features, group_size)}) or skip it")
    if bits == 4 and in_features % 2:
        raise ValueError(f"int4 packs two values per byte: {dim_name}={in_features} of {name} must be even")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., C) int8 values in [-8, 7], C even -> (..., C/2) uint8; low nibble = even column."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dimension, got {tuple(q.shape)}")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise ValueError("pack_int4 takes values in [-8, 7]")
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # (..., C) in [0, 15]
    return u[..., 0::2] | (u[..., 1::2] << 4)  # (..., C/2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(..., C/2) uint8 -> (..., C) int8 in [-8, 7]; the inverse of pack_int4."""
    low, high = packed & 0x0F, packed >> 4  # (..., C/2) each
    u = torch.stack([low, high], dim=-1).flatten(-2)  # (..., C)
    return u.to(torch.int8) - 8


def quantize(w: torch.Tensor, bits: int = 8, scheme: str = "per_channel", group_size: int | None = 128,
             scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a (out, in) weight. Returns (qweight, scale).

    qweight: int8 (out, in) for 8 bits, packed uint8 (out, in/2) for 4 bits.
    scale:   (1, 1) per_tensor, (out, 1) per_channel, (out, in / group_size) group.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight (out, in), got shape {tuple(w.shape)}")
    out, inp = w.shape
    check_quant_args(bits, scheme, group_size, inp)
    rows, groups = {"per_tensor": (1, 1), "per_channel": (out, 1), "group": (out, inp // (group_size or 1))}[scheme]
    wg = w.detach().float().reshape(rows, groups, -1)  # (rows, groups, weights per group)
    absmax = wg.abs().amax(dim=-1)  # (rows, groups)
    scale = torch.where(absmax > 0, absmax / qmax(bits), torch.ones_like(absmax)).to(scale_dtype)
    q = torch.round(wg / scale.float()[..., None]).clamp(-qmax(bits), qmax(bits))
    q = q.to(torch.int8).reshape(out, inp)  # (out, in)
    return (pack_int4(q) if bits == 4 else q), scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, bits: int = 8,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(qweight, scale) from `quantize` -> the (out, in) weight W_hat = q * s in `dtype`.

    Works in place on one fresh fp32 tensor: this runs on every forward of a QuantLinear.
    """
    if bits == 4:  # unpack straight into floats: w[..., 2i] = low nibble - 8, w[..., 2i+1] = high nibble - 8
        w = torch.empty(*qweight.shape, 2, dtype=torch.float32, device=qweight.device)  # (..., in/2, 2)
        w[..., 0] = qweight & 0x0F
        w[..., 1] = qweight >> 4
        w = w.flatten(-2).sub_(8)  # (..., in)
    else:
        w = qweight.to(torch.float32)  # (..., in)
    w.view(*w.shape[:-1], scale.shape[-1], -1).mul_(scale.float()[..., None])  # (..., groups, weights per group)
    return w.to(dtype)


# ---------------------------------------------------------------------------------
# modules that hold quantized weights


class QuantLinear(nn.Module):
    """A Linear whose weight lives as int8 / packed int4 buffers plus scales.

    forward dequantizes the whole weight and calls F.linear (see the module docstring
    for what that costs). Inference only: nothing here has a gradient.
    """

    def __init__(self, qweight, scale, bias, in_features, bits, scheme, group_size):
        super().__init__()
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self.bits, self.scheme, self.group_size = bits, scheme, group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_float(cls, linear: nn.Module, bits: int = 8, scheme: str = "per_channel", group_size: int | None = 128,
                   scale_dtype: torch.dtype = torch.float32, name: str = "module") -> "QuantLinear":
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name} is {type(linear).__name__}, not nn.Linear: QuantLinear replaces nn.Linear only")
        check_quant_args(bits, scheme, group_size, linear.in_features, name)
        qweight, scale = quantize(linear.weight, bits, scheme, group_size, scale_dtype)
        return cls(qweight, scale, linear.bias, linear.in_features, bits, scheme, group_size)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.qweight, self.scale, self.bits, dtype)  # (out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.scheme == "group" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} {self.scheme}{group}"


class QuantEmbedding(nn.Module):
    """An Embedding table (V, C) stored like QuantLinear; only the looked-up rows are dequantized."""

    def __init__(self, qweight, scale, embedding_dim, bits, scheme, group_size):
        super().__init__()
        self.embedding_dim, self.bits, self.scheme, self.group_size = embedding_dim, bits, scheme, group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)

    @classmethod
    def from_float(cls, emb: nn.Module, bits=8, scheme="per_channel", group_size=128, scale_dtype=torch.float32,
                   name: str = "module") -> "QuantEmbedding":
        if not isinstance(emb, nn.Embedding):
            raise TypeError(f"{name} is {type(emb).__name__}, not nn.Embedding")
        check_quant_args(bits, scheme, group_size, emb.embedding_dim, name, "embedding_dim")
        qweight, scale = quantize(emb.weight, bits, scheme, group_size, scale_dtype)
        return cls(qweight, scale, emb.embedding_dim, bits, scheme, group_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (...) -> (..., C)
        rows = F.embedding(idx, self.qweight)  # (..., C) int8 or (..., C/2) uint8
        scale = self.scale[0].expand(*idx.shape, -1) if self.scale.shape[0] == 1 else F.embedding(idx, self.scale)
        return dequantize(rows, scale, self.bits)  # scale: (..., groups)


def quantize_model(model: nn.Module, bits: int = 8, scheme: str | None = None, group_size: int | None = 128,
                   skip=(), targets=None, embeddings: bool = False, scale_dtype: torch.dtype = torch.float32,
                   inplace: bool = False) -> nn.Module:
    """Replace every nn.Linear (and nn.Embedding if `embeddings`) by its quantized twin.

    scheme defaults to per_channel for 8 bits and group for 4 bits. `skip` names modules
    (and everything under them) to leave in full precision; `targets`, if given, names
    the only modules to quantize. Returns a copy unless inplace=True.
    """
    scheme = scheme or ("per_channel" if bits == 8 else "group")
    check_quant_args(bits, scheme, group_size)
    modules = dict(model.named_modules())
    for name in itertools.chain(skip, targets or ()):
        if name not in modules:
            raise KeyError(f"no module named {name!r} in the model; names look like {list(modules)[1:4]}")
    kinds = (nn.Linear, nn.Embedding) if embeddings else (nn.Linear,)
    for name in targets or ():
        if not isinstance(modules[name], kinds):
            raise TypeError(f"target {name!r} is {type(modules[name]).__name__}: quantize_model replaces "
                            f"{' and '.join(k.__name__ for k in kinds)} modules only"
                            + ("" if embeddings else " (nn.Embedding too with embeddings=True)"))
    skipped = lambda n: any(n == s or n.startswith(s + ".") for s in skip)  # noqa: E731
    chosen = [n for n, m in modules.items()
              if isinstance(m, kinds) and not skipped(n) and (targets is None or n in targets)]
    if not chosen:
        raise ValueError("found no module to quantize: the model has no nn.Linear outside `skip`")
    for name in chosen:  # check every layer before changing any
        m = modules[name]
        if isinstance(m, nn.Linear):
            check_quant_args(bits, scheme, group_size, m.in_features, name)
        else:
            check_quant_args(bits, scheme, group_size, m.embedding_dim, name, "embedding_dim")
    model = model if inplace else copy.deepcopy(model)
    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent, module = model.get_submodule(parent_name), model.get_submodule(name)
        quantized_cls = QuantLinear if isinstance(module, nn.Linear) else QuantEmbedding
        setattr(parent, attr, quantized_cls.from_float(module, bits, scheme, group_size, scale_dtype, name))
    return model


# ---------------------------------------------------------------------------------
# measuring: errors and bytes


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||approx - reference|| / ||reference|| (Frobenius): weight or output error."""
    return ((approx.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30)).item()


def weight_error(w: torch.Tensor, bits: int = 8, scheme: str = "per_channel", group_size: int | None = 128) -> dict:
    """Reconstruction error of one weight under one scheme."""
    w_hat = dequantize(*quantize(w, bits, scheme, group_size), bits)
    err = (w_hat - w.float()).abs()
    return {"rel_error": relative_error(w, w_hat), "max_abs_error": err.max().item(),
            "mean_abs_error": err.mean().item()}


def bytes_held(module: nn.Module) -> int:
    """Bytes of every parameter and buffer storage the module holds, each storage counted once.

    Measured from the tensors (packed weights, scales, biases, norms, embeddings, shards;
    for FSDP's DTensors the local shard), not computed from bit widths.
    """
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in itertools.chain(module.parameters(), module.buffers()):
        t = t.to_local() if isinstance(t, DTensor) else t
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def best_seconds(models: dict, batch: dict, repeats: int) -> dict:
    """Best wall time of one forward of each model on `batch` (keyword arguments), the models taking
    turns (shardlib.timing.interleaved_times: fair under a changing load)."""
    with torch.no_grad():
        return interleaved_times({name: functools.partial(model, **batch) for name, model in models.items()},
                                 repeats, statistic=min)