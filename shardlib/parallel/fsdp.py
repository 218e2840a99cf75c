"""ZeRO-3 / FSDP: parameters, gradients and optimizer state all sharded over N ranks.

ZeRO stage 3 (Rajbhandari et al., arXiv 1910.02054) as PyTorch FSDP implements it
(Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
arXiv 2304.11277). `fully_shard` is named after PyTorch's FSDP2 API: call it on each
unit (say each transformer block), then on the root for the parameters left over.

Each unit's trainable parameters are flattened into one buffer padded to N*c elements,
c = ceil(numel/N); at rest rank r keeps only its (c,) fp32 shard. The module's
parameters become 1-D pieces of that shard, under their original names, so any
elementwise torch optimizer (SGD, Adam, AdamW...) built over `model.parameters()` steps
exactly this rank's elements. Around each unit:

    before forward    all-gather the shards -> full flat (N*c,); the module computes on views of it
    after forward     free the full parameters (reshard_after_forward=True)
    before backward   all-gather them again (hook on the unit's outputs)
    after backward    reduce-scatter the full gradient (N*c,) -> (c,), divide by N, free

Per-rank model-state bytes at rest (ZeRO paper, Figure 1): 16 Psi/N with mixed-precision Adam,
plus at most N-1 padding elements per unit. Here, as in FSDP2, the shard is kept in fp32
and bf16 exists only while gathered, so the 16 bytes split as fp32 params 4 + fp32 grads
4 + m, v 8 (the paper's 2 + 2 + 12 counts an fp16 shard plus an fp32 master; same total).
On top, the full parameters of the unit computing (and of the next, if prefetched) live for a moment.

Communication per rank and step, elements sent (ring collectives):

    all-gather for forward     (N-1)/N * Psi
    all-gather for backward    (N-1)/N * Psi
    reduce-scatter of grads    (N-1)/N * Psi
    total                      3(N-1)/N * Psi     1.5x DDP (ZeRO paper, Section 7)

(FSDP2 keeps the root unit gathered between forward and backward, which saves the root's
second all-gather; here every unit reshards, so the count is exactly 3 passes.)

Prefetch (prefetch=True, the default; FSDP paper, Section 3.3, backward and forward prefetching):
the all-gather of the unit that comes next is started asynchronously as soon as the current unit's
parameters are in place, so it travels while the current unit computes. "Next" is the order the units ran in the previous
forward (for forward prefetch) and the order their backwards started in the previous backward
(for backward prefetch), as the root's fully_shard records them: from the second step on. The
collectives and their bytes are the same; only when they start changes. Memory: the next unit's
full parameters are gathered one unit early, so two units (and the root) are whole at a time.

Inputs: frozen parameters (requires_grad=False) stay whole on every rank, untouched;
tied parameters must live in one unit (refused with a clear error otherwise); trainable
parameters of mixed dtypes are refused. Every rank must run the same units in the same
order, once per forward.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from shardlib.comm import ops
from shardlib.parallel.zero import FlatLayout, cast_floats, trainable_parameters

__all__ = ["fully_shard", "full_state_dict", "FSDPUnit"]


class _UnitOrder:
    """The order units ran in, this step and the previous one; shared by the units under one root."""

    def __init__(self):
        self.forward, self.backward = [], []  # this step's, being recorded
        self.last_forward, self.last_backward = [], []  # the previous step's: what prefetch follows

    def start_step(self, module, args) -> None:  # the root's forward pre-hook, before any unit's
        if self.forward:
            self.last_forward, self.last_backward = self.forward, self.backward
        self.forward, self.backward = [], []

    @staticmethod
    def next_after(unit, order: list, last: list):
        """The unit that followed `unit`'s position in the previous step, if any."""
        k = len(order) - 1  # `unit` was just appended to `order`
        return last[k + 1] if k + 1 < len(last) and last[k] is unit else None


class FSDPUnit:
    """The sharded state of one unit and the hooks that gather and free it."""

    def __init__(self, module: nn.Module, group, param_dtype, output_dtype, reshard_after_forward: bool,
                 prefetch: bool = True):
        self.group, self.reshard_after_forward = group, reshard_after_forward
        self.prefetch, self.order, self.pending = prefetch, None, None  # order: set by the root's fully_shard
        self.name = type(module).__name__
        self.gather_log = None  # a list to record each all-gather: (unit, issued, done) perf_counter seconds
        self.param_dtype, self.output_dtype = param_dtype, output_dtype
        owners = _owners_outside_units(module)  # [(qualified name, owner module, attribute, param)]
        named = trainable_parameters([(qn, p) for qn, _, _, p in owners], "fully_shard")
        params = [p for _, p in named]  # distinct trainable parameters, in order
        self.owners = [[(qn, m, a) for qn, m, a, q in owners if q is p] for p in params]  # tied: several
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = layout = FlatLayout([p.shape for p in params], world_size, rank)
        with torch.no_grad():
            self.shard = layout.shard(layout.flatten([p.detach() for p in params])).clone()  # (c,) at rest
        for qualified, p in named:  # free the originals, and mark them: no other unit may take them
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p._fsdp_sharded_in = f"{type(module).__name__} (as {qualified})"
        ranges = layout.shard_ranges()
        self.pieces = [nn.Parameter(self.shard[lo:hi]) for lo, hi in ranges]  # (hi-lo,) views, maybe empty
        self.piece_ranges = ranges
        for piece, owners_of_p in zip(self.pieces, self.owners):
            for _, owner, attr in owners_of_p:
                owner._parameters[attr] = piece  # the module now holds its shard, under the old name
        compute_dtype = param_dtype or self.shard.dtype
        self.flat = torch.empty(layout.padded_numel, dtype=compute_dtype, device=self.shard.device,
                                requires_grad=True)  # (N*c,) the gathered parameters, a leaf for autograd
        self.flat.untyped_storage().resize_(0)  # ... with no memory at rest
        self.flat.register_post_accumulate_grad_hook(self._post_backward)
        self.gathered = False
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)

    # -- gather and free -----------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Gather the full parameters; async_op=True only starts the all-gather (a prefetch)."""
        if self.gathered or self.pending is not None:
            if not async_op:
                self._wait()
            return
        self.flat.untyped_storage().resize_(self.layout.padded_numel * self.flat.element_size())
        shard = self.shard.to(self.flat.dtype)  # (c,) bf16 copy in mixed precision, else itself
        issued = time.perf_counter()
        with record_function(f"all-gather {self.name}{' (prefetch)' if async_op else ''}"):
            # .data: refilling the storage must not look like an in-place change to the saved views
            work = ops.all_gather_into_tensor(self.flat.data, shard, group=self.group, async_op=True)  # (c,) -> (N*c,)
        if self.gather_log is not None:
            entry = {"unit": self.name, "issued": issued, "done": None, "prefetch": async_op}
            self.gather_log.append(entry)
            work.get_future().then(lambda _: entry.update(done=time.perf_counter()))
        self.pending = (work, shard)  # the shard copy must live until the gather is done
        if not async_op:
            self._wait()

    def _wait(self) -> None:
        if self.pending is not None:
            with record_function(f"wait for all-gather {self.name}"):
                self.pending[0].wait()
            self.pending = None
        self.gathered = True

    def reshard(self) -> None:
        if self.pending is not None:
            self._wait()  # a prefetch still writing into the storage must finish before it is freed
        self.flat.untyped_storage().resize_(0)  # views saved for backward keep the storage object, not its bytes
        self.gathered = False

    def _prefetch(self, order: list, last: list) -> None:
        order.append(self)
        following = _UnitOrder.next_after(self, order, last)
        if self.prefetch and following is not None:
            following.unshard(async_op=True)

    def _use(self, tensors) -> None:
        for t, owners_of_p in zip(tensors, self.owners):
            for _, owner, attr in owners_of_p:
                owner._parameters[attr] = t

    # -- hooks ----------------------------------------------------------------------------

    def _pre_forward(self, module, args):
        self.unshard()
        if self.order is not None:
            self._prefetch(self.order.forward, self.order.last_forward)  # the next unit's all-gather starts now
        self._use(self.layout.views(self.flat))  # full-shape views of (N*c,), tracked by autograd
        return cast_floats(args, self.param_dtype) if self.param_dtype is not None else args

    def _post_forward(self, module, args, output):
        self._use(self.pieces)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard()
        if self.output_dtype is not None:
            output = cast_floats(output, self.output_dtype)
        needing_grad = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if needing_grad:  # fires when backward reaches this unit's outputs, before the unit's own backward
            torch.autograd.graph.register_multi_grad_hook(needing_grad, self._pre_backward, mode="any")
        return output

    def _pre_backward(self, grad) -> None:
        self.unshard()
        if self.order is not None:
            self._prefetch(self.order.backward, self.order.last_backward)  # the unit whose backward comes next

    @torch.no_grad()
    def _post_backward(self, flat: torch.Tensor) -> None:
        full_grad = flat.grad  # (N*c,) this rank's gradient of the whole unit
        grad = torch.empty(self.layout.shard_numel, dtype=full_grad.dtype, device=full_grad.device)  # (c,)
        with record_function(f"reduce-scatter {self.name}"):
            ops.reduce_scatter_tensor(grad, full_grad, group=self.group)  # (N*c,) -> (c,) summed over ranks
        flat.grad = None
        self.reshard()
        grad = grad.to(self.shard.dtype).div_(dist.get_world_size(self.group))
        for piece, (lo, hi) in zip(self.pieces, self.piece_ranges):
            piece.grad = grad[lo:hi] if piece.grad is None else piece.grad.add_(grad[lo:hi])

    @torch.no_grad()
    def full_parameters(self) -> list[torch.Tensor]:
        """The unit's parameters, whole, at the shard's precision (a collective: every rank calls it)."""
        full = torch.empty(self.layout.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        ops.all_gather_into_tensor(full, self.shard, group=self.group)  # (c,) -> (N*c,)
        return [v.clone() for v in self.layout.views(full)]


def _owners_outside_units(module: nn.Module, prefix: str = ""):
    """(qualified name, owner, attribute, param) for every parameter slot not inside an already sharded unit."""
    found = [(prefix + attr, module, attr, p) for attr, p in module._parameters.items() if p is not None]
    for name, child in module._modules.items():
        if child is not None and not hasattr(child, "_fsdp_unit"):
            found += _owners_outside_units(child, f"{prefix}{name}.")
    return found


def _units(module: nn.Module):
    """(qualified name prefix, unit) of every sharded unit in the module's tree, module included."""
    return [(f"{name}." if name else "", m._fsdp_unit) for name, m in module.named_modules()
            if getattr(m, "_fsdp_unit", None) is not None]


def fully_shard(module: nn.Module, *, group=None, param_dtype: torch.dtype | None = None,
                output_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                prefetch: bool = True) -> nn.Module:
    """Shard `module`'s parameters (those not already in a sharded sub-unit) over the group's ranks.

    Call it bottom-up: `for block in model.blocks: fully_shard(block)`, then `fully_shard(model)`.
    The ranks must start from the same weights. param_dtype: compute dtype (e.g. torch.bfloat16;
    floating inputs of the unit are cast to it; shards and optimizer stay fp32); output_dtype: cast
    floating outputs to it (e.g. torch.float32 on the root). prefetch: start the next unit's
    all-gather while this one computes (see the module docstring); the units under `module` follow
    the order this call records. Returns the module, changed in place.
    """
    if hasattr(module, "_fsdp_unit"):
        raise ValueError(f"{type(module).__name__} is already sharded: call fully_shard once per module")
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise TypeError(f"param_dtype must be a floating-point dtype such as torch.bfloat16, got {param_dtype}")
    for qualified, _, _, p in _owners_outside_units(module):
        if getattr(p, "_fsdp_sharded_in", None) is not None:
            raise ValueError(f"parameter {qualified!r} is tied to a parameter that the unit "
                             f"{p._fsdp_sharded_in} already shards: each unit frees its parameters on its own, "
                             "so tied parameters must live in one unit. Shard one module that holds both "
                             "(or only the root), or untie them.")
    if not any(p.requires_grad for _, _, _, p in _owners_outside_units(module)):
        module._fsdp_unit = None  # nothing to train here: frozen parameters stay whole on every rank
    else:
        module._fsdp_unit = FSDPUnit(module, group, param_dtype, output_dtype, reshard_after_forward, prefetch)
    _record_order_under(module)
    return module


def _record_order_under(root: nn.Module) -> None:
    """Give the units under `root` one shared _UnitOrder, reset by root's forward pre-hook at each step."""
    units = _units(root)
    if len(units) < 2:
        return
    order = _UnitOrder()
    for prefix, unit in units:
        unit.order, unit.name = order, prefix.rstrip(".") or "root"
    root.register_forward_pre_hook(order.start_step, prepend=True)  # before the root unit's own pre-hook


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of a fully_shard-ed module, on every rank (a collective)."""
    state = {name: t.clone() for name, t in module.state_dict().items()}  # pieces, buffers, frozen params
    for prefix, unit in _units(module):
        for full, owners_of_p in zip(unit.full_parameters(), unit.owners):
            for qualified, _, _ in owners_of_p:
                state[prefix + qualified] = full
    return state
