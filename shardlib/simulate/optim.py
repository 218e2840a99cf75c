"""Data parallelism and the optimizer of one rank, with mixed-precision AdamW: ZeRO 0, 1, 2 or 3.

The parameters of a rank's chunks are of two kinds: dense ones, replicated on the d c ranks of the
dense data-parallel group, and experts, replicated on the d c / e ranks holding the same experts.
Each kind gets the course's technique on its own group (shardlib/simulate/world.py):

    zero 0   bf16 parameters stepped through fp32 masters (parallel.precision.MixedPrecisionOptimizer);
             gradients averaged after the pipeline's step by parallel.ddp.all_reduce_gradients, as
             parallel.hybrid.HybridGPT composes data with pipeline parallelism
    zero 1-2 parallel.zero.ZeroOptimizer(param_dtype=bf16): bf16 flat buffers, fp32 master shard, AdamW
             on the shard; stage 2 reduce-scatters each bucket from backward (bucket_cap_mb)
    zero 3   parallel.fsdp.fully_shard(param_dtype=bf16) on every layer, then on the chunk; AdamW on
             the fp32 shards

The wrappers are given a holder module that owns the same Parameter objects (never called), so
ZeroOptimizer's casts of a model's inputs and outputs, meant for a whole model, stay off a
pipeline stage, whose output is the next stage's bf16 input. Adam's state is created before the
step (`prime`): the simulated step is one in the middle of training.

`tensors()` lists what the rank holds, by kind (params, grads, optimizer, buffers), from the
wrappers' own fields: bytes are counted from tensors that exist, never from formulas.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlib.parallel.ddp import all_reduce_gradients
from shardlib.parallel.experts import ExpertParallelMoE
from shardlib.parallel.fsdp import fully_shard
from shardlib.parallel.precision import MixedPrecisionOptimizer
from shardlib.parallel.tensor_gpt import sync_sequence_parallel_grads
from shardlib.parallel.zero import ZeroOptimizer

__all__ = ["DataParallel", "ZERO2_BUCKET_MB"]

ZERO2_BUCKET_MB = 512.0  # MiB of gradients per ZeRO-2 reduce-scatter (DeepSpeed: reduce_bucket_size 5e8 values)


def _holder(params: list[nn.Parameter]) -> nn.Module:
    holder = nn.Module()
    for i, p in enumerate(params):
        holder.register_parameter(f"p{i}", p)
    return holder


def _is_expert_module(module: nn.Module) -> bool:
    return isinstance(module, ExpertParallelMoE)


def _expert_params(chunks) -> list[nn.Parameter]:
    return [p for chunk in chunks for m in chunk.modules() if _is_expert_module(m)
            for name, p in m.named_parameters() if name != "router.weight"]


class DataParallel:
    """ZeRO `zero` over this rank's chunks: backward hooks and step of the course's techniques."""

    def __init__(self, chunks: list[nn.Module], zero: int, groups, *, lr: float = 1e-4):
        self.chunks, self.zero, self.groups = chunks, zero, groups
        kinds, seen = [], set()  # (parameters, their data-parallel group), chunk by chunk
        for chunk in chunks:
            expert = [p for p in _expert_params([chunk]) if id(p) not in seen]
            expert_ids = {id(p) for p in expert}
            dense = [p for p in chunk.parameters() if id(p) not in seen and id(p) not in expert_ids]
            seen.update(id(p) for p in dense + expert)
            kinds += [(dense, groups.dense_dp)] + ([(expert, groups.expert_dp)] if expert else [])
        self.fsdp_units, self.wrappers = [], []
        if zero == 3:
            for chunk in chunks:
                for m in [m for m in chunk.modules() if _is_expert_module(m)]:
                    fully_shard(m.router, group=groups.dense_dp, param_dtype=torch.bfloat16)  # replicated on all dp
                    fully_shard(m, group=groups.expert_dp, param_dtype=torch.bfloat16)
                for block in chunk.blocks.values():  # a recomputed layer: shard the layer inside, which runs twice
                    fully_shard(getattr(block, "layer", block), group=groups.dense_dp, param_dtype=torch.bfloat16)
                fully_shard(chunk, group=groups.dense_dp, param_dtype=torch.bfloat16)
            self.fsdp_units = [m._fsdp_unit for chunk in chunks for m in chunk.modules()
                               if getattr(m, "_fsdp_unit", None) is not None]
            self.optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=lr)
            self.torch_optimizers = [self.optimizer]
        elif zero in (1, 2):
            self.wrappers = [(ZeroOptimizer(_holder(ps), torch.optim.AdamW, stage=zero, group=g,
                                            param_dtype=torch.bfloat16, lr=lr,
                                            bucket_cap_mb=ZERO2_BUCKET_MB if zero == 2 else None), g)
                             for ps, g in kinds]
            self.torch_optimizers = [w.optimizer for w, _ in self.wrappers]
        elif zero == 0:
            self.wrappers = [(MixedPrecisionOptimizer(_holder(ps), torch.optim.AdamW, dtype=torch.bfloat16, lr=lr), g)
                             for ps, g in kinds]
            self.torch_optimizers = [w.optimizer for w, _ in self.wrappers]
        else:
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")

    @torch.no_grad()
    def prime(self) -> None:
        """Create Adam's state (m, v) as the steps before this one would have."""
        for optimizer in self.torch_optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            for p in params:
                p.grad = None

    def finish_gradients(self) -> None:
        """After the pipeline's backward: sequence-parallel sums over tp, then (zero 0) the dp average."""
        if self.zero in (0, 1):  # ZeRO-2 and -3 have freed or sharded the gradients by now
            for chunk in self.chunks:
                sync_sequence_parallel_grads(chunk, group=self.groups.tp)
        if self.zero == 0:
            for wrapper, group in self.wrappers:
                all_reduce_gradients(wrapper.model, group=group)

    def step(self) -> None:
        if self.zero == 3:
            self.optimizer.step()
        else:
            for wrapper, _ in self.wrappers:
                wrapper.step()

    def zero_grad(self) -> None:
        for optimizer in (self.torch_optimizers if self.zero == 3 else [w for w, _ in self.wrappers]):
            optimizer.zero_grad()

    # -- what the rank holds --------------------------------------------------------------

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """params, grads, optimizer (Adam's m and v, fp32 masters) and buffers (gathered ZeRO-3 units): what
        the wrappers hold, and every parameter and .grad the modules hold besides (storages count once)."""
        states = [t for o in self.torch_optimizers for s in o.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor) and t.is_meta]  # Adam's step counters live on the host
        held = [p for c in self.chunks for p in c.parameters() if p.is_leaf]  # in a ZeRO-3 forward: views, skipped
        grads = [p.grad for p in held if p.grad is not None]
        if self.zero == 3:
            pieces = [p for u in self.fsdp_units for p in u.pieces]
            return dict(params=held + pieces, grads=grads + [p.grad for p in pieces if p.grad is not None],
                        optimizer=states, buffers=[u.flat for u in self.fsdp_units])
        if self.zero == 0:
            masters = [m for w, _ in self.wrappers for m in w.masters]
            return dict(params=held, grads=grads, optimizer=states + masters, buffers=[])
        own = [w.model_state_tensors() for w, _ in self.wrappers]
        return dict(params=held + [t for h in own for t in h["params"]],
                    grads=grads + [t for h in own for t in h["grads"]],
                    optimizer=[t for h in own for t in h["optimizer"] if t.is_meta], buffers=[])
