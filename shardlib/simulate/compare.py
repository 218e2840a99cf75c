"""The planner's prediction of a simulated rank, side by side: what the code did against the formulas.

shardlib.plan.predict(spec, cluster, layout, global_batch, stage=k) gives the memory and the bytes
sent of a GPU of pipeline stage k, from the formulas of shardlib/plan/cost.py; the simulation gives
the same quantities from the tensors and calls the code made (run.py). Both describe one layout, so
their ratio says which formula, or which piece of code, is off. With attention="flash" (meta.py)
no s x s scores are kept: the planner counts FlashAttention as selective recomputation (its own
rule, cost.py), so a layout without recomputation is predicted as "selective"; "unfused" attention
keeps them, as the planner's no-recomputation formula does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlib.plan.inputs import Cluster
from shardlib.plan.planner import predict
from shardlib.simulate.run import Simulation

__all__ = ["Comparison", "compare", "planner_layout", "TARGETS"]

# how close the code and the formulas must be: model states within 1%, the activation peak within 3%,
# the bytes sent exactly (a ratio of 1 up to the ring model's rounding down of (n-1)/n S)
TARGETS = {"model states": 0.01, "activation peak": 0.03, "sent": 1e-6}


@dataclass(frozen=True)
class Comparison:
    quantity: str  # "model states", "activation peak", "buffers", "sent dp", "sent tp", ...
    simulated: float
    planned: float
    target: float | None  # the largest |ratio - 1| allowed, None: shown, not held to a target

    @property
    def ratio(self) -> float:
        if self.planned == 0:
            return 1.0 if self.simulated == 0 else float("inf")
        return self.simulated / self.planned

    @property
    def within(self) -> bool:
        return self.target is None or abs(self.ratio - 1) <= self.target or abs(self.simulated - self.planned) < 64


def planner_layout(sim: Simulation):
    """The layout as the planner is told it: FlashAttention counted as selective recomputation."""
    layout = sim.layout
    return replace(layout, recompute=layout.recompute or "selective") if sim.attention == "flash" else layout


def compare(sim: Simulation, *, gpus_per_node: int = 8) -> list[Comparison]:
    """Each quantity the planner predicts for the rank's stage, simulated against planned."""
    n = sim.layout.n_gpus
    cluster = Cluster.of(n, gpus_per_node=min(gpus_per_node, n))
    planned = predict(sim.spec, cluster, planner_layout(sim), sim.global_batch, stage=sim.stage).costs
    rows = [Comparison("model states", sim.model_states["total"], planned.memory.model_states, TARGETS["model states"]),
            Comparison("activation peak", sim.activation_peak, planned.memory.activations, TARGETS["activation peak"]),
            Comparison("buffers", sim.buffer_peak, planned.memory.buffers, None)]
    sent = sim.sent_by_group()
    for group in ("dp", "tp", "pp", "cp", "ep"):
        rows.append(Comparison(f"sent {group}", sent[group], getattr(planned.sent, group), TARGETS["sent"]))
    return rows
