"""The memory of one rank through a training step, from the tensors its code creates.

Four kinds of bytes, each counted from tensors that exist (distinct storages, views once):

    params, grads, optimizer   the data-parallel wrappers' tensors and every parameter and .grad the
                               modules hold (shardlib/simulate/optim.py)
    buffers                    parameters gathered for compute (ZeRO-3 units while whole)
    activations                what autograd saves for backward: a saved-tensor hook (PyTorch's
                               torch.autograd.graph.saved_tensors_hooks) adds a tensor's storage when
                               it is first saved and a small holder object, which autograd drops when
                               it frees the saved tensor (after that node's backward), takes it off
                               again. Parameters (and views of them) are not activations.

Activations are exact at every saved tensor; the peak and where it happened (micro-batch, layer,
forward or backward) come from there. The other kinds are read at every layer's forward end and
backward start and end (buffers) or at each micro-batch's start and backward end (grads, which only
a first backward or a ZeRO-2 bucket changes in between); `samples` keeps those points for a plot,
each with the most activations held since the point before (a layer recomputed inside backward).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from shardlib.memory import unique_storage_bytes

__all__ = ["MemoryTimeline", "Sample", "Where"]


@dataclass(frozen=True)
class Where:
    """A point of the step: op "F" / "B" (forward, backward) of micro-batch `microbatch` of chunk `chunk`,
    inside layer `layer` (None: outside the layers: embedding, output layer, loss), or "step"."""

    op: str
    microbatch: int
    chunk: int
    layer: int | None

    def __str__(self) -> str:
        if self.op in ("start", "step"):
            return "the optimizer step" if self.op == "step" else "the start"
        what = {"F": "forward", "B": "backward"}[self.op]
        place = f"layer {self.layer}" if self.layer is not None else ("the output layer and loss" if self.op == "F"
                                                                       else "the output layer")
        chunk = f", chunk {self.chunk}" if self.chunk else ""
        return f"{what} of micro-batch {self.microbatch}{chunk}, {place}"


@dataclass(frozen=True)
class Sample:
    where: Where
    event: str  # "forward end", "backward start", "backward end", "micro-batch", "step"
    activations: int  # saved bytes at this point
    grads: int
    buffers: int
    high: int  # the most saved bytes since the previous sample (a layer recomputed in backward rises and falls)


class _Held:
    """What autograd keeps instead of a saved tensor; its end is the saved tensor's end."""

    __slots__ = ("timeline", "key", "tensor")

    def __init__(self, timeline, key, tensor):
        self.timeline, self.key, self.tensor = timeline, key, tensor

    def __del__(self):
        self.timeline._release(self.key)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # one number per storage (meta storages have no address)


class MemoryTimeline:
    """Bytes of `data_parallel`'s rank through a step of `chunks`. Use `recording()` around the step."""

    def __init__(self, chunks, data_parallel):
        self.chunks, self.dp = chunks, data_parallel
        held = data_parallel.tensors()
        self.params, self.optimizer = unique_storage_bytes(held["params"]), unique_storage_bytes(held["optimizer"])
        self.grads, self.buffers = unique_storage_bytes(held["grads"]), unique_storage_bytes(held["buffers"])
        compute = [p for c in chunks for p in c.parameters()] + held["params"] + held["buffers"]
        self.excluded = {_key(t) for t in compute}  # parameters and what they are views of
        self.saved, self.refs = 0, {}  # live saved bytes; storage -> [holders, bytes]
        self.where = Where("start", -1, 0, None)
        self.samples: list[Sample] = []
        self.activation_peak, self.activation_peak_where = 0, self.where
        self.peak, self.peak_where = 0, self.where
        self.buffer_peak = self.buffers
        self._high = 0  # saved bytes at their highest since the last sample
        self._forwards = [0] * len(chunks)
        self._handles = []

    # -- saved tensors ----------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        if not t.is_meta:
            return t
        key = _key(t)
        if key in self.excluded:
            return t
        entry = self.refs.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self.refs[key] = [1, nbytes]
            self.saved += nbytes
            self._check_peaks()
        else:
            entry[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.saved -= entry[1]
            del self.refs[key]

    def _check_peaks(self) -> None:
        self._high = max(self._high, self.saved)
        if self.saved > self.activation_peak:
            self.activation_peak, self.activation_peak_where = self.saved, self.where
        total = self.params + self.optimizer + self.grads + self.buffers + self.saved
        if total > self.peak:
            self.peak, self.peak_where = total, self.where

    # -- where the step is --------------------------------------------------------------------

    def _sample(self, event: str, where: Where, grads: bool = False) -> None:
        self.where = where
        if grads:
            self.grads = unique_storage_bytes(self.dp.tensors()["grads"])
        if self.dp.fsdp_units:
            self.buffers = sum(u.flat.untyped_storage().nbytes() for u in self.dp.fsdp_units)
            self.buffer_peak = max(self.buffer_peak, self.buffers)
        self._check_peaks()
        self.samples.append(Sample(where, event, self.saved, self.grads, self.buffers, self._high))
        self._high = self.saved

    def _chunk_forward(self, c: int, module, args) -> None:
        self._sample("micro-batch", Where("F", self._forwards[c], c, None), grads=True)
        self._forwards[c] += 1

    def _layer_forward_start(self, c: int, layer: int, first: bool, module, args) -> None:
        i = self._forwards[c] - 1
        self.where = Where("F", i, c, layer)
        x = args[0]
        if x.requires_grad:  # its gradient is the end of this layer's backward (of the chunk's, for the first)
            x.register_hook(lambda grad: self._sample("backward end", Where("B", i, c, layer), grads=first))

    def _layer_forward_end(self, c: int, layer: int, module, args, output) -> None:
        i = self._forwards[c] - 1
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(lambda grad: self._sample("backward start", Where("B", i, c, layer)))
            self._sample("forward end", Where("F", i, c, layer))
        self.where = Where("F", i, c, None)

    def mark(self, event: str) -> None:
        """A point outside forward and backward: "backward done" (gradients at rest) or "step"."""
        self._sample(event, Where("step", -1, 0, None), grads=True)
        held = self.dp.tensors()
        self.params, self.optimizer = unique_storage_bytes(held["params"]), unique_storage_bytes(held["optimizer"])

    @contextmanager
    def recording(self):
        for c, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(partial(self._chunk_forward, c)))
            first = min(int(name) for name in chunk.blocks)
            for name, block in chunk.blocks.items():
                start = partial(self._layer_forward_start, c, int(name), int(name) == first)
                self._handles.append(block.register_forward_pre_hook(start))
                self._handles.append(block.register_forward_hook(partial(self._layer_forward_end, c, int(name))))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
