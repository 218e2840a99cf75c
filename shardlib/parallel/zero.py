"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients, over N data-parallel ranks.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv 1910.02054. Stage 3 (the parameters sharded too, i.e. FSDP) is in shardlib.parallel.fsdp.

Every rank holds the whole model and runs forward and backward on its own B/N examples,
as in data parallelism. The trainable parameters are laid out in flat buffers ("buckets"),
each zero-padded to N*c elements, c = ceil(numel/N). Rank r owns elements [r*c, (r+1)*c)
of every bucket: it alone keeps the optimizer state of that shard and steps it. The torch
optimizer is an ordinary one, built over "pieces": 1-D views of the shard, one per
parameter it overlaps. Any optimizer whose update is elementwise (SGD, Adam, AdamW,
RMSprop, Adagrad...) steps a piece exactly as it would the matching elements of the whole
parameter; optimizers that look at a whole tensor at once (LAMB, Adafactor) do not.

Per-rank model-state bytes (ZeRO paper, Figure 1; shardlib.memory.zero_model_state_bytes),
mixed-precision Adam: bf16 params (2) + bf16 grads (2) + fp32 master, m, v (K = 12):

    stage      params    grads      optimizer    total
    DDP        2 Psi     2 Psi      12 Psi       16 Psi
    ZeRO-1     2 Psi     2 Psi      12 Psi/N     4 Psi + 12 Psi/N
    ZeRO-2     2 Psi     2 Psi/N    12 Psi/N     2 Psi + 14 Psi/N

fp32 Adam (param_dtype=None): params 4, grads 4, m and v 8 bytes per parameter; the fp32
params are their own master copy. Padding adds at most N-1 elements per bucket.

Communication per rank and step, elements sent (ring collectives, see shardlib.comm):

    reduce-scatter of the gradients      (N-1)/N * Psi
    all-gather of the updated params     (N-1)/N * Psi
    total                                2(N-1)/N * Psi     the same as DDP's all-reduce (Section 7)

Stage 1 keeps full gradients through backward and reduce-scatters them in step(). Stage 2
reduce-scatters each bucket from a backward hook the moment its gradients are complete
and frees them: only the buckets backward is filling are ever whole, and between steps a
rank holds its (c,) shards. (With k micro-batches per step stage 2 reduce-scatters k times.)

Inputs: parameters with requires_grad=False are left alone (replicated, never stepped);
tied parameters are one Parameter and get one slot; trainable parameters of mixed dtypes
are refused (cast the module first; use param_dtype for bf16 compute).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function
from torch.utils._pytree import tree_map

from shardlib.comm import ops

__all__ = ["ZeroOptimizer", "FlatLayout", "trainable_parameters"]


# ---------------------------------------------------------------------------------
# which parameters, and where they live in a flat buffer


def trainable_parameters(named_parameters, where: str = "ZeRO") -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs with requires_grad, each parameter once; refuses mixed dtypes."""
    named, seen = [], set()
    for name, p in named_parameters:
        if p.requires_grad and id(p) not in seen:  # a tied parameter: once, under its first name
            seen.add(id(p))
            named.append((name, p))
    if not named:
        raise ValueError(f"{where}: no parameter has requires_grad=True: nothing to train")
    dtypes = {}
    for name, p in named:
        dtypes.setdefault(p.dtype, []).append(name)
    if len(dtypes) > 1:
        listing = "; ".join(f"{dtype}: {names[:3]}{' ...' if len(names) > 3 else ''}"
                            for dtype, names in dtypes.items())
        raise TypeError(f"{where} lays trainable parameters out in one flat buffer, so they need one dtype, "
                        f"but found {listing}. Cast the module first, e.g. module.float(), and pass "
                        f"param_dtype=torch.bfloat16 for bf16 compute with fp32 master weights.")
    if not next(iter(dtypes)).is_floating_point:
        raise TypeError(f"{where}: trainable parameters must be floating point, got {next(iter(dtypes))}")
    return named


class FlatLayout:
    """Tensors of `shapes` laid end to end in one buffer of N*c elements, c = ceil(numel/N).

    Rank r owns the shard [r*c, (r+1)*c). The last shards hold the zero padding.
    """

    def __init__(self, shapes: list[torch.Size], world_size: int, rank: int):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)  # Psi of this buffer
        self.shard_numel = math.ceil(self.numel / world_size)  # c
        self.padded_numel = self.shard_numel * world_size  # N*c
        self.shard_start = rank * self.shard_numel
        self.split_sizes = self.numels + [self.padded_numel - self.numel]  # the last piece: padding

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        """Copy `tensors` (shaped like the layout) into a new zero-padded flat buffer: (N*c,)."""
        first = tensors[0]
        flat = torch.zeros(self.padded_numel, dtype=dtype or first.dtype, device=first.device)
        for t, offset, n in zip(tensors, self.offsets, self.numels):
            flat[offset:offset + n] = t.reshape(-1)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The tensors as views of `flat`: (N*c,) -> [shape_0, shape_1, ...] (one split, one backward node)."""
        return [piece.view(shape) for piece, shape in zip(torch.split(flat, self.split_sizes), self.shapes)]

    def shard_ranges(self) -> list[tuple[int, int]]:
        """For each tensor, the part of it inside this rank's shard, as [lo, hi) offsets into the shard."""
        start, end = self.shard_start, self.shard_start + self.shard_numel
        ranges = []
        for offset, n in zip(self.offsets, self.numels):
            lo, hi = max(offset, start), min(offset + n, end)
            ranges.append((lo - start, hi - start) if hi > lo else (0, 0))
        return ranges

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a flat buffer, as a view: (N*c,) -> (c,)."""
        return flat[self.shard_start:self.shard_start + self.shard_numel]


def cast_floats(tree, dtype: torch.dtype):
    """Cast every floating-point tensor in a nest of tuples/lists/dicts to `dtype`."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


# ---------------------------------------------------------------------------------
# ZeRO-1 and ZeRO-2


class _Bucket:
    """One flat buffer of parameters: full params on every rank, master shard and optimizer pieces on this one."""

    def __init__(self, params: list[nn.Parameter], world_size: int, rank: int, param_dtype):
        self.params = params
        self.layout = layout = FlatLayout([p.shape for p in params], world_size, rank)
        full = layout.flatten([p.detach() for p in params])  # (N*c,) in the parameters' own dtype
        if param_dtype is None or param_dtype == full.dtype:
            self.flat_param, self.master = full, layout.shard(full)  # fp32: the params are the master
        else:
            self.master = layout.shard(full).clone()  # (c,) fp32 master of this rank's shard
            self.flat_param = full.to(param_dtype)  # (N*c,) what forward and backward compute with
        for p, view in zip(params, layout.views(self.flat_param)):
            p.data = view  # the module computes on the flat buffer from now on
        ranges = layout.shard_ranges()
        self.pieces = [nn.Parameter(self.master[lo:hi]) for lo, hi in ranges if hi > lo]  # (hi-lo,) views
        self.piece_ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
        self.flat_grad = None  # stage 1: (N*c,) full gradients, the params' .grad are views of it
        self.grad_shard = None  # (c,) this rank's chunk of the averaged gradient
        self.ready = 0  # stage 2: parameters whose gradient backward has finished


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any elementwise torch optimizer.

        model = build_gpt(...)                   # the same initial weights on every rank
        optimizer = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)
        loss = model_loss(model, my_slice_of_the_batch); loss.backward()
        optimizer.step(); optimizer.zero_grad()
        state = optimizer.full_state_dict()       # the whole model, fp32, on every rank

    stage 1: optimizer state sharded; stage 2: gradients too. param_dtype=torch.bfloat16
    computes forward/backward in bf16 on bf16 params and grads while each rank keeps fp32
    master weights of its shard (floating inputs are cast to bf16, outputs back to fp32).
    bucket_cap_mb: MiB (2**20 bytes, in the parameters' dtype) per flat buffer, as PyTorch DDP's
    argument of that name (default: one buffer for the whole model).
    As in PyTorch's ZeroRedundancyOptimizer, the ranks must start from the same weights.
    Zero gradients with this object's zero_grad(): model.zero_grad() does not reach the shards.
    For an LR scheduler, pass `.optimizer` (the torch optimizer over this rank's pieces).
    """

    def __init__(self, module: nn.Module, optimizer_class=torch.optim.AdamW, *, stage: int = 1, group=None,
                 param_dtype: torch.dtype | None = None, bucket_cap_mb: float | None = None, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer runs stage 1 or 2, got stage={stage!r}; "
                             "for stage 3 shard the parameters with shardlib.parallel.fsdp.fully_shard")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        named = trainable_parameters(module.named_parameters(), f"ZeRO-{stage}")
        self.module, self.stage, self.group = module, stage, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.names = {}  # id(param) -> every name it has (tied parameters have several)
        for name, p in module.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(name)
        self.buckets = [_Bucket(params, self.world_size, self.rank, param_dtype)
                        for params in _group_into_buckets([p for _, p in named], bucket_cap_mb)]
        self.mixed = self.buckets[0].master.dtype != self.buckets[0].flat_param.dtype
        self.optimizer = optimizer_class([piece for b in self.buckets for piece in b.pieces], **defaults)
        if self.mixed:
            module.register_forward_pre_hook(lambda m, args: cast_floats(args, param_dtype))
            module.register_forward_hook(lambda m, args, out: cast_floats(out, self.buckets[0].master.dtype))
        if stage == 1:
            for b in self.buckets:
                b.flat_grad = torch.zeros_like(b.flat_param)
                for p, view in zip(b.params, b.layout.views(b.flat_grad)):
                    p.grad = view  # autograd accumulates into the flat buffer in place
        else:
            for b in self.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(lambda p, b=b: self._on_grad_ready(b))

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    # -- gradients -------------------------------------------------------------------

    def _reduce_full_gradients(self, b: _Bucket) -> None:
        """Stage 1, in step(): reduce-scatter the bucket's full gradients in place."""
        for p, view in zip(b.params, b.layout.views(b.flat_grad)):
            if p.grad is None:  # unused in backward, or zero_grad(set_to_none=True) by the user
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        b.grad_shard = b.layout.shard(b.flat_grad)  # (c,) a view: no new memory
        with record_function(f"reduce-scatter bucket {self.buckets.index(b)}"):
            ops.reduce_scatter_tensor(b.grad_shard, b.flat_grad, group=self.group)  # (N*c,) -> (c,) summed over ranks
        b.grad_shard.div_(self.world_size)

    def _on_grad_ready(self, b: _Bucket) -> None:
        b.ready += 1
        if b.ready == len(b.params):
            self._reduce_and_free(b)

    def _reduce_and_free(self, b: _Bucket) -> None:
        """Stage 2, from backward: reduce-scatter the bucket's gradients, keep the shard, free the rest."""
        flat = b.layout.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params])  # (N*c,)
        for p in b.params:
            p.grad = None  # full gradients gone: only the (c,) shard below stays
        shard = torch.empty(b.layout.shard_numel, dtype=flat.dtype, device=flat.device)  # (c,)
        with record_function(f"reduce-scatter bucket {self.buckets.index(b)}"):
            ops.reduce_scatter_tensor(shard, flat, group=self.group)  # (N*c,) -> (c,) summed over ranks
        shard.div_(self.world_size)
        b.grad_shard = shard if b.grad_shard is None else b.grad_shard.add_(shard)  # accumulation
        b.ready = 0

    # -- the step ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure: run forward and backward before step()")
        for b in self.buckets:
            if self.stage == 1:
                self._reduce_full_gradients(b)
            elif b.ready:  # some parameters of the bucket got no gradient in backward
                self._reduce_and_free(b)
            grad = b.grad_shard
            if grad is not None and grad.dtype != b.master.dtype:
                grad = grad.to(b.master.dtype)  # (c,) fp32 copy for the fp32 master step
            for piece, (lo, hi) in zip(b.pieces, b.piece_ranges):
                piece.grad = None if grad is None else grad[lo:hi]
        with record_function("optimizer step of this rank's shard"):
            self.optimizer.step()  # each rank steps its shard only: (c,) per bucket
        for k, b in enumerate(self.buckets):
            if self.mixed:
                b.layout.shard(b.flat_param).copy_(b.master)  # fp32 master -> bf16 shard
                for piece in b.pieces:
                    piece.grad = None  # drop the transient fp32 gradient copy
            with record_function(f"all-gather bucket {k}"):
                ops.all_gather_into_tensor(b.flat_param, b.layout.shard(b.flat_param), group=self.group)  # (c,) -> (N*c,)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Stage 1 zeroes its flat gradient buffers (the 2 or 4 Psi bytes it keeps); stage 2 frees the shards."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for b in self.buckets:
            if self.stage == 1:
                b.flat_grad.zero_()
                for p, view in zip(b.params, b.layout.views(b.flat_grad)):
                    p.grad = view
            else:
                b.grad_shard, b.ready = None, 0
                for p in b.params:
                    p.grad = None

    # -- what the rank holds -----------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank, trainable parameters at master precision."""
        state = {name: t.clone() for name, t in self.module.state_dict().items()}
        for b in self.buckets:
            if self.mixed:
                full = torch.empty(b.layout.padded_numel, dtype=b.master.dtype, device=b.master.device)
                ops.all_gather_into_tensor(full, b.master, group=self.group)  # (c,) fp32 masters -> (N*c,)
            else:
                full = b.flat_param
            for p, view in zip(b.params, b.layout.views(full)):
                for name in self.names[id(p)]:
                    state[name] = view.clone()
        return state

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind, for shardlib.memory.unique_storage_bytes.

        params: the full (bf16 or fp32) flat buffers; grads: stage 1 the full flat gradients,
        stage 2 the shards; optimizer: the optimizer's state and, in mixed precision, the fp32 master shards.
        """
        grads = [b.flat_grad if self.stage == 1 else b.grad_shard for b in self.buckets]
        grads += [piece.grad for b in self.buckets for piece in b.pieces if piece.grad is not None]
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        masters = [b.master for b in self.buckets] if self.mixed else []
        return dict(params=[b.flat_param for b in self.buckets], grads=[g for g in grads if g is not None],
                    optimizer=state + masters)


def _group_into_buckets(params: list[nn.Parameter], bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """Consecutive parameters in buckets of at most bucket_cap_mb MiB (a bigger parameter: alone)."""
    if bucket_cap_mb is None:
        return [params]
    cap_bytes = bucket_cap_mb * 2**20
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    return buckets + [current]
