"""What one GPU of a layout holds and sends, item by item: the planner's prediction in the form a
measurement takes (bytes of parameters, gradients, optimizer states, activations; every collective with
its group, kind, tensor size and calls per step), to hold beside a rank's measured memory and its
communication ledger (shardlib.comm). The numbers are those of shardlib/plan/cost.py, not a second model.

    per_gpu(spec, cluster, Layout(dp=2, tp=4, pp=2, zero=1), global_batch=16, stage=1)
    -> {"layout": ..., "stage": 1, "layers": ..., "micro_batches": ...,
        "memory": {"params", "grads", "optimizer", "activations", "buffers", "runtime", "host", "model_states", "total"},
        "collectives": [{"group": "tp", "kind": "all_reduce", "group_size": 4, "bytes": S, "calls": n,
                         "sent": bytes one GPU sends per step}, ...],
        "sent": {"dp": ..., "tp": ..., "pp": ..., "cp": ..., "ep": ..., "pcie": ...}}

Bytes of a collective are those of the whole tensor S (an all-gather's output, a reduce-scatter's input);
`sent` is what one GPU sends for it per step with ring algorithms (2 (n-1)/n S per all-reduce, (n-1)/n S
otherwise; the message itself for a point-to-point "send"). Activations are the most a GPU of the stage
holds at once (its 1F1B or interleaved warm-up), model states after the optimizer step.
"""

from __future__ import annotations

from dataclasses import asdict

from shardlib.plan.cost import DEFAULT_ATTENTION, Layouts, Options, _one_thread, _stage, layers_of_stage
from shardlib.plan.inputs import Cluster, Layout
from shardlib.plan.model import ModelSpec
from shardlib.plan.planner import _row
from shardlib.plan.rules import check_layout, check_options


def per_gpu(spec: ModelSpec, cluster: Cluster, layout: Layout, global_batch: int, *, stage: int = 0,
            recipe="mixed_adam", efficiency: float | None = None, overlap: bool = True,
            attention: str = DEFAULT_ATTENTION, scatter_gather: bool = True) -> dict:
    """One GPU of pipeline stage `stage`: its memory by kind and its collectives one by one (module docstring);
    options as shardlib.plan.plan's."""
    check_options(cluster, efficiency, overlap, 0.0, attention, scatter_gather)
    check_layout(spec, cluster, layout, global_batch)
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage must be in 0..{layout.pp - 1}, got {stage}")
    c = Layouts.from_rows([_row(layout)])
    options = Options(recipe, efficiency, overlap, attention, scatter_gather=scatter_gather)
    with _one_thread():
        costs, collectives = _stage(spec, cluster, c, global_batch, options, c.pp * 0 + stage, collectives=True)
    row = costs.row(0)
    listed = []
    for x in collectives:
        calls, sent = float(x.calls[0]), float(x.sent[0])
        if calls and sent:  # point-to-point sends go to a neighbour: the pipeline's, or the ring attention's
            size = int(x.ring.n[0]) if x.ring is not None else layout.pp if x.group == "pp" else layout.cp
            listed.append(dict(group=x.group, kind=x.kind, group_size=size, bytes=float(x.nbytes[0]), calls=calls,
                               sent=sent))
    memory = {**asdict(row.memory), "model_states": row.memory.model_states, "total": row.memory.total}
    layers = float(layers_of_stage(spec.n_layer, c.pp, c.pp * 0 + stage)[0])
    return dict(layout=str(layout), stage=stage, layers=layers, micro_batches=float(row.n_micro), memory=memory,
                collectives=listed, sent=asdict(row.sent))
