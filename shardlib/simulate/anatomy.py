"""What one layer keeps for backward, tensor by tensor, and which module kept it.

Korthikanti et al. (arXiv 2205.05198, Section 4.1) count a transformer layer's activations term by
term: the LayerNorms' inputs, the q/k/v input, q and k, v, the output projection's input, the MLP's
input, its hidden activations, the dropout masks. `layer_anatomy` runs one layer of a ModelSpec as
a rank of a tensor- (and context-) parallel group on meta tensors and lists what autograd saved,
each storage once, under the innermost module that was running: the same list, measured, so a
difference between the simulation and the formula can be named term by term.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from shardlib.plan.inputs import Layout
from shardlib.plan.model import ModelSpec
from shardlib.simulate.meta import meta_execution
from shardlib.simulate.model import build_layer
from shardlib.simulate.world import fake_world, rank_groups

__all__ = ["SavedTensor", "layer_anatomy"]


@dataclass(frozen=True)
class SavedTensor:
    module: str  # e.g. "attn.q_proj", "mlp.fc", "ln_1"
    shape: tuple
    dtype: torch.dtype
    nbytes: int  # bytes of its storage (a view keeps its whole storage alive)


def layer_anatomy(spec: ModelSpec, layout: Layout, *, micro_batch: int | None = None, attention: str = "flash",
                  keep_gathered_input: bool = False) -> list[SavedTensor]:
    """The tensors one layer of `spec` saves on rank 0 of the layout's tp (and cp) group, forward of one
    micro-batch. Only tp, cp, sequence parallelism and recomputation shape a layer's activations; under
    full recomputation this is what the layer keeps while it is recomputed."""
    b = micro_batch or layout.micro_batch
    local = Layout(tp=layout.tp, cp=layout.cp, sequence_parallel=layout.sequence_parallel, cp_method=layout.cp_method)
    with fake_world(0, local.n_gpus), meta_execution(attention):
        groups = rank_groups(local, 0)
        from shardlib.parallel.context import check_context_parallel

        seq_layout = check_context_parallel(spec.seq_len, layout.cp, layout.cp_method, spec.n_head // layout.tp,
                                            spec.kv_heads // layout.tp) if layout.cp > 1 else None
        if layout.recompute not in (None, "selective", "full"):
            raise ValueError(f"recompute must be None, 'selective' or 'full', got {layout.recompute!r}")
        with torch.device("meta"):
            layer = build_layer(spec, layout.tp, groups, sequence_parallel=local.sequence_parallel,
                                layout=seq_layout, cp_method=layout.cp_method, keep_gathered_input=keep_gathered_input,
                                recompute_mode=layout.recompute).to(torch.bfloat16)
        tokens = seq_layout.length(0) if seq_layout else spec.seq_len
        tokens //= layout.tp if local.sequence_parallel else 1
        x = torch.empty(b, tokens, spec.hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
        return _saved_by(layer, x)


def _saved_by(layer: torch.nn.Module, x: torch.Tensor) -> list[SavedTensor]:
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    stack, seen, saved = [""], set(), []
    handles = []
    for name, module in layer.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name) and None))
        handles.append(module.register_forward_hook(lambda m, a, out: stack.pop() and None))

    def pack(t):
        key = t.untyped_storage()._cdata
        if t.is_meta and key not in params and key not in seen:
            seen.add(key)
            saved.append(SavedTensor(stack[-1] or "(layer)", tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
    finally:
        for handle in handles:
            handle.remove()
    return saved
