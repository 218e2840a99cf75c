"""Magnitude pruning, unstructured and 2:4, and what it really saves in bytes.

Magnitude pruning zeroes the weights of smallest |w| (Han et al., arXiv 1506.02626).
Two patterns:

    unstructured  the fraction `sparsity` of smallest-magnitude weights of each Linear
    2:4           in every group of 4 consecutive inputs of a row, keep the 2 largest
                  (NVIDIA Ampere sparse tensor cores; Mishra et al., arXiv 2104.08378;
                  https://developer.nvidia.com/blog/accelerating-inference-with-sparsity-using-ampere-and-tensorrt)

Zeros stored densely cost exactly as many bytes as the weights they replaced: pruning
saves memory only when the sparse layout is stored, and then the indices cost bytes too.

    dense, any sparsity        32 bits per weight (fp32)
    CSR at sparsity z          (1-z) * (32 + 64) bits + 64 * (out+1) / (out*in)
                               with int64 indices, 50% sparse CSR is 1.5x LARGER than dense
    2:4 compressed             values (out, in/2) + a 2-bit index per kept value
                               = 32/2 + 2/2 = 17 bits per weight for fp32 values (9 for fp16)

`Sparse24Linear` holds the compressed 2:4 form and decompresses it on the fly for its
matmul (memory saved at rest, no speed-up: the speed-up needs sparse tensor cores).
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

PATTERNS = ("unstructured", "2:4")


def magnitude_mask(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Boolean mask (same shape as w) keeping all but the round(sparsity * numel) smallest |w|."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    n_drop = round(sparsity * w.numel())
    mask = torch.ones(w.numel(), dtype=torch.bool, device=w.device)
    if n_drop:
        mask[w.detach().abs().reshape(-1).argsort()[:n_drop]] = False  # ties broken by sort order
    return mask.view_as(w)


def _check_2_4(w: torch.Tensor, multiple: int = 4) -> None:
    if w.dim() != 2 or w.shape[1] % multiple:
        raise ValueError(f"2:4 sparsity needs a 2-D weight whose in_features is a multiple of {multiple}, "
                         f"got shape {tuple(w.shape)}")


def kept_indices_2_4(w: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (out, in/4, 2) sorted positions (0..3) of the 2 largest |w| in each group of 4."""
    _check_2_4(w)
    groups = w.detach().abs().reshape(w.shape[0], -1, 4)  # (out, in/4, 4)
    return groups.topk(2, dim=-1).indices.sort(dim=-1).values  # (out, in/4, 2)


def mask_2_4(w: torch.Tensor) -> torch.Tensor:
    """Boolean mask with exactly 2 True in every group of 4 consecutive inputs."""
    keep = kept_indices_2_4(w)  # (out, in/4, 2)
    mask = torch.zeros(w.shape[0], w.shape[1] // 4, 4, dtype=torch.bool, device=w.device)
    return mask.scatter_(-1, keep, True).reshape(w.shape)  # (out, in)


def prune_model(model: nn.Module, sparsity: float = 0.5, pattern: str = "unstructured", skip=(),
                inplace: bool = False) -> nn.Module:
    """Zero weights of every nn.Linear (outside `skip`) by magnitude; dense storage is kept."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r} is not one of {PATTERNS}")
    if pattern == "2:4" and sparsity != 0.5:
        raise ValueError("the 2:4 pattern is 50% sparse by definition: leave sparsity=0.5")
    modules = dict(model.named_modules())
    for name in skip:
        if name not in modules:
            raise KeyError(f"no module named {name!r} in the model")
    model = model if inplace else copy.deepcopy(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not any(name == s or name.startswith(s + ".") for s in skip):
            w = module.weight
            mask = mask_2_4(w) if pattern == "2:4" else magnitude_mask(w, sparsity)
            with torch.no_grad():
                w.mul_(mask)
    return model


# ---------------------------------------------------------------------------------
# sparse storage, measured


def csr_bytes(w: torch.Tensor) -> int:
    """Bytes of w stored as PyTorch's CSR tensor (values + int64 column indices + row pointers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        csr = w.detach().to_sparse_csr()
    return sum(t.numel() * t.element_size() for t in (csr.values(), csr.col_indices(), csr.crow_indices()))


def compress_2_4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) -> values (out, in/2) of the kept weights, and their 2-bit positions packed 4 per byte (out, in/8)."""
    _check_2_4(w, multiple=8)
    keep = kept_indices_2_4(w)  # (out, in/4, 2)
    values = w.detach().reshape(w.shape[0], -1, 4).gather(-1, keep).reshape(w.shape[0], -1)  # (out, in/2)
    idx = keep.reshape(w.shape[0], -1).to(torch.uint8)  # (out, in/2) in [0, 3]
    packed = idx[:, 0::4] | (idx[:, 1::4] << 2) | (idx[:, 2::4] << 4) | (idx[:, 3::4] << 6)  # (out, in/8)
    return values.clone(), packed


def decompress_2_4(values: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The inverse of compress_2_4: a dense (out, in) weight with zeros where pruned."""
    out = values.shape[0]
    idx = torch.stack([(packed >> s) & 0b11 for s in (0, 2, 4, 6)], dim=-1).reshape(out, -1, 2)  # (out, in/4, 2)
    dense = values.new_zeros(out, idx.shape[1], 4)  # (out, in/4, 4)
    dense.scatter_(-1, idx.long(), values.reshape(out, -1, 2))
    return dense.reshape(out, -1)  # (out, in)


class Sparse24Linear(nn.Module):
    """A Linear stored in compressed 2:4 form; forward decompresses and calls F.linear."""

    def __init__(self, values: torch.Tensor, packed_idx: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = values.shape[0], 2 * values.shape[1]
        self.register_buffer("values", values)
        self.register_buffer("packed_idx", packed_idx)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_float(cls, linear: nn.Module, name: str = "module") -> "Sparse24Linear":
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name} is {type(linear).__name__}, not nn.Linear")
        return cls(*compress_2_4(linear.weight), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return F.linear(x, decompress_2_4(self.values, self.packed_idx).to(x.dtype), self.bias)


def compress_model_2_4(model: nn.Module, skip=(), inplace: bool = False) -> nn.Module:
    """Replace every nn.Linear (outside `skip`) by a Sparse24Linear: 2:4 pruning stored compressed."""
    targets = [n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(n == s or n.startswith(s + ".") for s in skip)]
    for name in targets:
        _check_2_4(model.get_submodule(name).weight, multiple=8)
    model = model if inplace else copy.deepcopy(model)
    for name in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, Sparse24Linear.from_float(model.get_submodule(name), name))
    return model
