"""The KV cache: the keys and values of every earlier position, kept so that a decode step computes
only the new token (lessons 06 and 10).

Size, for L layers, n_kv key/value heads of head_dim each, c positions of context, b sequences and
B bytes per value (2 for bf16, 4 for fp32):

    KV bytes = 2 * L * n_kv * head_dim * c * b * B                 (2: one key and one value)

Grouped-query attention (Ainslie et al., arXiv 2305.13245) shares each kv head among n_head/n_kv query
heads, dividing the cache by n_head/n_kv (Llama 2 70B: 64 query heads, 8 kv heads, arXiv 2307.09288).

Per rank: tensor parallelism (t ranks) splits the cache by heads, n_kv/t heads each; when n_kv < t each
rank must still hold one whole kv head, replicated on t/n_kv ranks, so the cache per rank stops
shrinking at 1/n_kv of it (`kv_heads_per_rank`). Pipeline parallelism splits it by layers (L/p per
stage), data-parallel replicas by sequences. No communication: the cache never leaves its rank.

Two layouts of the same bytes:

    KVCache        one (b, n_kv, capacity, head_dim) tensor per layer for keys and one for values: a
                   batch of sequences that advance together (lesson 06's generation)
    PagedKVCache   a pool of blocks of `block_size` positions per layer, handed to sequences as they
                   grow, with a block table per sequence (vLLM's PagedAttention, Kwon et al., arXiv
                   2309.06180): a sequence reserves what it needs, rounded up to one block, not the
                   model's whole context

`kv_cache_bytes(cache)` measures the bytes from the cache's tensors; `kv_cache_formula_bytes` is the
formula above: the lesson holds one against the other.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

from shardlib.models import GPTConfig

__all__ = ["kv_heads_per_rank", "kv_cache_formula_bytes", "kv_cache_bytes", "cache_shape", "KVCache",
           "PagedKVCache"]


def kv_heads_per_rank(n_kv_head: int, t: int = 1) -> int:
    """kv heads each of t tensor-parallel ranks holds: n_kv/t, or 1 (replicated) when n_kv < t."""
    if n_kv_head % t and t % n_kv_head:
        raise ValueError(f"t={t} must divide n_kv_head={n_kv_head} or be a multiple of it")
    return max(n_kv_head // t, 1)


def kv_cache_formula_bytes(config: GPTConfig, context: int, batch: int, bytes_per_value: int = 4, t: int = 1,
                           layers: int | None = None) -> int:
    """2 * L * n_kv * head_dim * context * batch * bytes_per_value, on one of t tensor-parallel ranks
    (n_kv -> kv_heads_per_rank); `layers`: the layers a pipeline stage holds (default all)."""
    heads = kv_heads_per_rank(config.kv_heads, t)
    return 2 * (config.n_layer if layers is None else layers) * heads * (config.n_embd // config.n_head) \
        * context * batch * bytes_per_value


def kv_cache_bytes(cache) -> int:
    """Bytes of every key and value tensor the cache holds (allocated, used or not), measured."""
    return sum(t.numel() * t.element_size() for pair in cache.layers for t in pair)


def cache_shape(module: nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads on this rank, head_dim) of a GPT, a TensorParallelGPT or a pipeline stage,
    read from its key projections (out features = kv heads * head_dim)."""
    blocks = list(module.blocks.values() if isinstance(module.blocks, nn.ModuleDict) else module.blocks)
    config = module.config
    head_dim = config.n_embd // config.n_head
    return len(blocks), blocks[0].attn.k_proj.weight.shape[0] // head_dim, head_dim


class KVCache:
    """Keys and values of b sequences that advance together, up to `capacity` positions.

    layers[i] = (keys, values), each (b, kv heads, capacity, head_dim). `update` writes positions
    start..start+T-1 of layer i and returns that layer's keys and values up to them."""

    def __init__(self, module: nn.Module, batch: int, capacity: int, device=None, dtype=None):
        n_layer, heads, head_dim = cache_shape(module)
        weight = next(module.parameters())
        shape = (batch, heads, capacity, head_dim)  # (b, n_kv/t, c, hd)
        self.layers = [(torch.zeros(shape, device=device or weight.device, dtype=dtype or weight.dtype),
                        torch.zeros(shape, device=device or weight.device, dtype=dtype or weight.dtype))
                       for _ in range(n_layer)]
        self.capacity, self.length = capacity, 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (b, kv heads, T, hd) at positions start..start+T-1 -> keys, values (b, kv heads, start+T, hd)."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"position {end - 1} is past the cache's capacity of {self.capacity} positions")
        keys, values = self.layers[layer]
        keys[:, :, start:end], values[:, :, start:end] = k, v
        self.length = max(self.length, end)
        return keys[:, :, :end], values[:, :, :end]


class PagedKVCache:
    """A pool of `n_blocks` blocks of `block_size` positions per layer, lent to sequences.

    layers[i] = (keys, values), each (n_blocks, kv heads, block_size, head_dim). A sequence reserves
    blocks with `allocate(seq, n_positions)`; its positions live in its blocks, in order (the block
    table); `free(seq)` returns them to the pool."""

    def __init__(self, module: nn.Module, n_blocks: int, block_size: int = 16, device=None, dtype=None):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"n_blocks={n_blocks} and block_size={block_size} must be >= 1")
        n_layer, heads, head_dim = cache_shape(module)
        weight = next(module.parameters())
        shape = (n_blocks, heads, block_size, head_dim)  # (blocks, n_kv/t, block, hd)
        self.layers = [(torch.zeros(shape, device=device or weight.device, dtype=dtype or weight.dtype),
                        torch.zeros(shape, device=device or weight.device, dtype=dtype or weight.dtype))
                       for _ in range(n_layer)]
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free_blocks = list(range(n_blocks))
        self.tables: dict[int, list[int]] = {}  # sequence -> its blocks, in position order
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sequence -> (block, offset) per position

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, keys and values."""
        return kv_cache_bytes(self) // self.n_blocks

    def blocks_needed(self, n_positions: int) -> int:
        return math.ceil(n_positions / self.block_size)

    def can_allocate(self, n_positions: int) -> bool:
        return self.blocks_needed(n_positions) <= len(self.free_blocks)

    def allocate(self, seq: int, n_positions: int) -> None:
        """Reserve room for `n_positions` positions of sequence `seq` (its prompt and every token to come)."""
        need = self.blocks_needed(n_positions)
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already holds blocks")
        if need > len(self.free_blocks):
            raise ValueError(f"sequence {seq} needs {need} blocks, {len(self.free_blocks)} are free")
        self.tables[seq], self.free_blocks = self.free_blocks[:need], self.free_blocks[need:]
        device = self.layers[0][0].device
        positions = torch.arange(need * self.block_size, device=device)  # every position its blocks can hold
        table = torch.tensor(self.tables[seq], device=device)
        self._slots[seq] = table[positions // self.block_size], positions % self.block_size  # block, offset

    def free(self, seq: int) -> None:
        self.free_blocks += self.tables.pop(seq)
        del self._slots[seq]

    def update(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """k, v: (kv heads, T, hd) of sequence `seq` at positions start..start+T-1 -> its keys and values
        (kv heads, start+T, hd), gathered from its blocks."""
        end = start + k.shape[1]
        block, offset = self._slots[seq]
        if end > len(block):
            raise ValueError(f"sequence {seq}: position {end - 1} is past its {len(self.tables[seq])} blocks")
        keys, values = self.layers[layer]
        keys[block[start:end], :, offset[start:end]] = k.transpose(0, 1)  # (T, n_kv, hd) into their slots
        values[block[start:end], :, offset[start:end]] = v.transpose(0, 1)
        return (keys[block[:end], :, offset[:end]].transpose(0, 1),  # (n_kv, start + T, hd)
                values[block[:end], :, offset[:end]].transpose(0, 1))

    def update_decode(self, layer: int, seqs: list[int], k: torch.Tensor, v: torch.Tensor, starts: list[int]):
        """One new position for each of n sequences at once. k, v: (n, kv heads, hd), sequence seqs[i] at
        position starts[i] -> keys, values (n, kv heads, P, hd), each sequence's positions 0..starts[i]
        padded to the longest (P), and mask (n, P): True where a position holds a key."""
        lengths = torch.tensor(starts, device=k.device) + 1  # (n,)
        if any(self._slots[seq][0].shape[0] < n for seq, n in zip(seqs, lengths.tolist())):
            raise ValueError(f"a sequence of {seqs} is past its reserved blocks")
        block = pad_sequence([self._slots[seq][0][:n] for seq, n in zip(seqs, lengths.tolist())], batch_first=True)
        offset = pad_sequence([self._slots[seq][1][:n] for seq, n in zip(seqs, lengths.tolist())], batch_first=True)
        rows = torch.arange(len(seqs), device=k.device)
        keys, values = self.layers[layer]
        keys[block[rows, lengths - 1], :, offset[rows, lengths - 1]] = k  # (n, n_kv, hd) into their slots
        values[block[rows, lengths - 1], :, offset[rows, lengths - 1]] = v
        mask = torch.arange(block.shape[1], device=k.device) < lengths[:, None]  # (n, P)
        return keys[block, :, offset].transpose(1, 2), values[block, :, offset].transpose(1, 2), mask
