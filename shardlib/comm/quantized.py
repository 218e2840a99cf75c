"""8-bit communication: all-gather and reduce-scatter of int8 blocks with one fp32 scale each.

ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", arXiv 2306.10209) cuts ZeRO-3's traffic by quantizing what it sends: the weights of the
forward all-gather to int8 in blocks, each with its own scale (qwZ, Section 3.1), and the gradients
of the reduce-scatter (qgZ, Section 3.3), which it sends with all-to-alls so that each value is
quantized once, not once per ring step. Here, one level of each, in int8:

    quantize      a tensor cut into blocks of `block_size` elements; per block the scale
                  absmax/127 (fp32) and round(x / scale) as int8
    all-gather    each rank quantizes its shard (c,); int8 shards and scales are all-gathered;
                  every rank dequantizes all N of them                      -> (N*c,)
    reduce-scatter each rank quantizes its N chunks of (N*c,); an all-to-all sends chunk j to rank
                  j; rank j dequantizes the N chunks it received and sums them in fp32 -> (c,)

Bytes one rank sends per call, against fp32 (4 bytes) or bf16 (2) (`quantized_sent_bytes`):

    all-gather      (N-1)/N * N*c' * (1 + 4/block_size)      c' = c rounded up to whole blocks
    reduce-scatter  (N-1)/N * N*c' * (1 + 4/block_size)      (all-to-all: N-1 of N chunks leave)

so about 1/4 of fp32's bytes and 1/2 of bf16's with blocks of 256. Error: rounding to the nearest
step moves each element by at most scale/2 = absmax(block)/254 (`max_quantization_error`); the
all-gather returns every element within that bound of its value, and the reduce-scatter's sum
within the sum of the N contributions' bounds. (ZeRO++'s qgZ uses int4 and two levels, intra- and
inter-node; its qwZ keeps int8.)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardlib.comm import ops

__all__ = ["quantize_blockwise", "dequantize_blockwise", "quantized_all_gather", "quantized_reduce_scatter",
           "quantized_sent_bytes", "max_quantization_error"]


def _check_block(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive number of elements, got {block_size!r}")


def quantize_blockwise(x: torch.Tensor, block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) -> (int8 values (n',), fp32 scales (n'/block_size,)), n' = n rounded up to whole blocks."""
    _check_block(block_size)
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"quantize_blockwise takes a 1-D floating tensor, got shape {tuple(x.shape)} of {x.dtype}")
    padded = math.ceil(x.numel() / block_size) * block_size
    blocks = torch.zeros(padded, dtype=torch.float32, device=x.device)
    blocks[:x.numel()] = x
    blocks = blocks.view(-1, block_size)  # (n'/block, block)
    scales = blocks.abs().amax(dim=1) / 127.0  # (n'/block,)
    q = torch.round(blocks / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))  # (n'/block, block)
    return q.to(torch.int8).view(-1), scales


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, block_size: int = 256,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(int8 (n',), scales (n'/block,)) -> values (n',) in `dtype`."""
    return (q.view(-1, block_size).float() * scales.unsqueeze(1)).view(-1).to(dtype)  # (n',)


def max_quantization_error(x: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """Per element, the largest |x - dequantize(quantize(x))| rounding allows: absmax(its block) / 254."""
    padded = math.ceil(x.numel() / block_size) * block_size
    blocks = torch.zeros(padded, dtype=torch.float32, device=x.device)
    blocks[:x.numel()] = x.detach().flatten()
    bound = blocks.view(-1, block_size).abs().amax(dim=1, keepdim=True) / 254.0  # (n'/block, 1)
    return bound.expand(-1, block_size).reshape(-1)[:x.numel()]  # (n,)


def quantized_all_gather(output: torch.Tensor, shard: torch.Tensor, *, group=None, block_size: int = 256) -> None:
    """output (N*c,) <- every rank's shard (c,), sent as int8 blocks with fp32 scales (ZeRO++ qwZ)."""
    n, c = dist.get_world_size(group), shard.numel()
    if output.numel() != n * c:
        raise ValueError(f"output has {output.numel()} elements; an all-gather of shards of {c} over {n} ranks needs {n * c}")
    q, scales = quantize_blockwise(shard.detach().flatten(), block_size)  # (c',) int8, (c'/block,) fp32
    all_q = torch.empty(n * q.numel(), dtype=torch.int8, device=q.device)  # (N*c',)
    all_scales = torch.empty(n * scales.numel(), dtype=scales.dtype, device=q.device)  # (N*c'/block,)
    ops.all_gather_into_tensor(all_q, q, group=group)  # (c',) -> (N*c',)
    ops.all_gather_into_tensor(all_scales, scales, group=group)  # (c'/block,) -> (N*c'/block,)
    values = dequantize_blockwise(all_q, all_scales, block_size, output.dtype).view(n, -1)  # (N, c')
    output.view(n, c).copy_(values[:, :c])  # drop each shard's padding: (N, c)


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group=None, block_size: int = 256) -> None:
    """output (c,) <- chunk r of the sum over ranks of input (N*c,), sent as int8 blocks (ZeRO++ qgZ, one level)."""
    n = dist.get_world_size(group)
    if input.numel() % n or output.numel() != input.numel() // n:
        raise ValueError(f"input of {input.numel()} elements must be N*c with N = {n} and output of c = "
                         f"{input.numel() // n} elements; got output of {output.numel()}")
    c = output.numel()
    padded = math.ceil(c / block_size) * block_size
    chunks = torch.zeros(n, padded, dtype=torch.float32, device=input.device)  # (N, c')
    chunks[:, :c] = input.detach().view(n, c)
    q, scales = quantize_blockwise(chunks.view(-1), block_size)  # (N*c',) int8, (N*c'/block,) fp32
    received_q, received_scales = torch.empty_like(q), torch.empty_like(scales)
    ops.all_to_all_single(received_q, q, group=group)  # chunk j to rank j: (N*c',) -> (N*c',)
    ops.all_to_all_single(received_scales, scales, group=group)  # (N*c'/block,) -> (N*c'/block,)
    values = dequantize_blockwise(received_q, received_scales, block_size).view(n, padded)  # (N, c')
    output.copy_(values.sum(dim=0)[:c])  # fp32 sum of the N contributions: (c,)


def quantized_sent_bytes(numel: int, world_size: int, block_size: int = 256) -> float:
    """Bytes one rank sends in a quantized all-gather (numel = N*c, the gathered tensor) or
    reduce-scatter (numel = N*c, the input): (N-1)/N * N*c' * (1 + 4/block_size), c' = c in whole blocks."""
    _check_block(block_size)
    n = world_size
    chunk = math.ceil(math.ceil(numel / n) / block_size) * block_size  # c'
    return (n - 1) / n * n * chunk * (1 + 4 / block_size)
