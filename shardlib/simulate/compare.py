"""The planner's prediction of a simulated rank, side by side: what the code did against the formulas.

shardlib.plan.per_gpu(spec, cluster, layout, global_batch, stage=k, attention=...) gives the memory of a
GPU of pipeline stage k and every collective it takes part in (group, kind, bytes, calls), from the
formulas of shardlib/plan/cost.py; the simulation gives the same quantities from the tensors and calls
the code made (run.py). Both describe one layout, so their ratio says which formula, or which piece of
code, is off. Bytes sent are held per group and kind of collective ("sent tp all_gather"): a
sequence-parallel block that all-gathers too little shows there even where the group's total would hide
it. The attention kernel is the simulation's: "flash" keeps no s x s scores, "unfused" keeps them, and
the planner is told which.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlib.plan.inputs import Cluster
from shardlib.plan.ledger import per_gpu
from shardlib.simulate.run import Simulation

__all__ = ["Comparison", "compare", "simulated_sent", "TARGETS"]

# how close the code and the formulas must be: model states within 1%, the activation peak within 3%,
# the bytes sent exactly (a ratio of 1 up to the ring model's rounding down of (n-1)/n S)
TARGETS = {"model states": 0.01, "activation peak": 0.03, "sent": 1e-6}
GROUPS = ("dp", "tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class Comparison:
    quantity: str  # "model states", "activation peak", "buffers", "sent tp all_gather", ...
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


def simulated_sent(sim: Simulation) -> dict[tuple[str, str], int]:
    """{(group, kind): bytes sent per step} from the ledger, in the planner's names (dense and expert data
    parallelism are both "dp"; a receive sends nothing)."""
    sent: dict = {}
    for group, kinds in sim.by_group().items():
        group = "dp" if group in ("dense_dp", "expert_dp") else group
        for kind, row in kinds.items():
            if kind not in ("recv", "barrier"):
                sent[group, kind] = sent.get((group, kind), 0) + row["sent_bytes"]
    return sent


def compare(sim: Simulation, *, gpus_per_node: int = 8) -> list[Comparison]:
    """Each quantity the planner predicts for the rank's stage, simulated against planned."""
    n = sim.layout.n_gpus
    cluster = Cluster.of(n, gpus_per_node=min(gpus_per_node, n))
    planned = per_gpu(sim.spec, cluster, sim.layout, sim.global_batch, stage=sim.stage, attention=sim.attention)
    memory = planned["memory"]
    rows = [Comparison("model states", sim.model_states["total"], memory["model_states"], TARGETS["model states"]),
            Comparison("activation peak", sim.activation_peak, memory["activations"], TARGETS["activation peak"]),
            Comparison("buffers", sim.buffer_peak, memory["buffers"], None)]
    planned_sent: dict = {}
    for x in planned["collectives"]:
        planned_sent[x["group"], x["kind"]] = planned_sent.get((x["group"], x["kind"]), 0.0) + x["sent"]
    simulated = simulated_sent(sim)
    for group, kind in sorted(set(planned_sent) | set(simulated), key=lambda k: (GROUPS.index(k[0])
                                                                                 if k[0] in GROUPS else 9, k[1])):
        rows.append(Comparison(f"sent {group} {kind}", simulated.get((group, kind), 0),
                               planned_sent.get((group, kind), 0.0), TARGETS["sent"]))
    return rows
