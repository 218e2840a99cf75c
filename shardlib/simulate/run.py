"""One training step of one rank of a large job, run by shardlib's own code on meta tensors.

    result = simulate(ModelSpec.preset("llama-70b"), Layout(dp=4, tp=8, pp=2, zero=1,
                      sequence_parallel=True), rank=0, global_batch=64)
    result.model_states["total"], result.activation_peak, result.sent_by_group()

This process becomes rank `rank` of dp*cp*tp*pp ranks on the fake backend (world.py), builds the
rank's chunks at the model's true shape on the meta device (model.py), applies ZeRO (optim.py),
and runs the step: the pipeline's schedule (shardlib.parallel.pipeline.pipeline_step: 1F1B, or
interleaved 1F1B with v chunks; each tensor-parallel rank sends 1/t of a boundary tensor without
sequence parallelism, Megatron-LM's scatter/gather), or the m micro-batches one after the other
without a pipeline, then the gradient reductions (a tied embedding's two copies summed first) and
the AdamW step. The ledger (shardlib.comm.comm_ledger) records
every call; timeline.py the memory. Nothing is allocated: a 70B-parameter rank runs on a laptop.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from shardlib.comm import CommRecord, comm_ledger
from shardlib.parallel.pipeline import pipeline_step
from shardlib.parallel.schedules import schedule_interleaved_1f1b
from shardlib.parallel.tied_embeddings import sync_tied_embeddings
from shardlib.plan.inputs import Cluster, Layout
from shardlib.plan.model import ModelSpec
from shardlib.plan.planner import check_layout
from shardlib.simulate.meta import meta_execution
from shardlib.simulate.model import build_chunks
from shardlib.simulate.optim import DataParallel
from shardlib.simulate.timeline import MemoryTimeline, Sample, Where
from shardlib.simulate.world import fake_world, rank_coordinates, rank_groups

__all__ = ["Simulation", "simulate", "representative_ranks"]


@dataclass
class Simulation:
    """What rank `rank` held and sent during one step. Bytes throughout."""

    spec: ModelSpec
    layout: Layout
    rank: int
    global_batch: int
    attention: str  # "flash" or "unfused"
    coords: dict  # pp, dp, cp, tp, ep indices
    n_micro: int  # m: micro-batches per step
    layers: list[list[int]]  # each chunk's layers
    model_states: dict  # params, grads, optimizer at rest (backward done, before the step), and total
    activation_peak: int
    activation_peak_where: Where
    peak: int  # model states + buffers + activations, at its highest
    peak_where: Where
    buffer_peak: int
    records: list[CommRecord] = field(repr=False)
    group_ranks: dict = field(repr=False)  # group name -> global ranks
    samples: list[Sample] = field(repr=False)
    wall_s: float = 0.0

    @property
    def stage(self) -> int:
        return self.coords["pp"]

    def group_of(self, record: CommRecord) -> str:
        """Which of this rank's groups a ledger record belongs to (groups of the same ranks: by the call)."""
        if record.kind in ("send", "recv"):
            peer = record.peers[0]
            return next((n for n in ("pp", "cp") if peer in self.group_ranks[n] and len(self.group_ranks[n]) > 1), "?")
        order = ("ep", "cp") if record.kind == "all_to_all" else ("tp", "dense_dp", "expert_dp", "cp", "ep", "pp",
                                                                  "embedding")
        group = next((n for n in order if self.group_ranks[n] == tuple(record.peers)), "?")
        return "pp" if group == "embedding" else group  # the planner counts the tied embedding's sum as pp traffic

    def by_group(self) -> dict[str, dict[str, dict[str, int]]]:
        """{group: {kind: {calls, bytes, sent_bytes}}} from the ledger."""
        table: dict = {}
        for r in self.records:
            row = table.setdefault(self.group_of(r), {}).setdefault(r.kind, {"calls": 0, "bytes": 0, "sent_bytes": 0})
            row["calls"] += 1
            row["bytes"] += r.nbytes
            row["sent_bytes"] += r.sent_bytes
        return table

    def sent_by_group(self) -> dict[str, int]:
        """Bytes sent per step in each of the planner's groups: dp (dense and expert), tp, pp, cp, ep."""
        sent = dict.fromkeys(("dp", "tp", "pp", "cp", "ep"), 0)
        for r in self.records:
            group = self.group_of(r)
            group = "dp" if group in ("dense_dp", "expert_dp") else group
            sent[group] = sent.get(group, 0) + r.sent_bytes
        return sent


def _schedule(layout: Layout):
    if layout.virtual_stages > 1:
        return functools.partial(schedule_interleaved_1f1b, virtual_stages=layout.virtual_stages)
    return "1f1b"


def simulate(spec: ModelSpec, layout: Layout, *, rank: int = 0, global_batch: int, attention: str = "flash",
             keep_gathered_input: bool = False, gpus_per_node: int = 8) -> Simulation:
    """Run rank `rank`'s step of `layout` (shardlib.plan.Layout) for `spec` with `global_batch` sequences.
    attention: "flash" (as GPUs run it today) or "unfused" (scores kept, as before FlashAttention; meta.py).
    keep_gathered_input: sequence parallelism keeps the gathered inputs of the column layers for backward
    (shardlib/parallel/sequence.py) instead of their shards.
    Bad layouts are refused with the planner's own checks (check_layout), before anything runs."""
    n = layout.n_gpus
    check_layout(spec, Cluster.of(n, gpus_per_node=min(gpus_per_node, n)), layout, global_batch)
    if layout.offload:
        raise ValueError("optimizer offload is not simulated: drop offload=True")
    if spec.tied_embeddings and layout.pp > 1 and layout.zero > 1:
        raise ValueError(f"tied embeddings on two pipeline stages sum their whole gradients after backward, which "
                         f"ZeRO-{layout.zero} has already reduce-scattered: use zero 0 or 1 with pp > 1 (DeepSpeed's "
                         "pipeline engine and Megatron-LM's distributed optimizer do)")
    start = time.perf_counter()
    m = global_batch // (layout.dp * layout.micro_batch)
    with fake_world(rank, n), meta_execution(attention):
        groups, coords = rank_groups(layout, rank), rank_coordinates(layout, rank)
        chunks = build_chunks(spec, layout, coords, groups, keep_gathered_input=keep_gathered_input)
        data_parallel = DataParallel(chunks, layout.zero, groups)
        data_parallel.prime()
        timeline = MemoryTimeline(chunks, data_parallel)
        tokens = torch.empty(m * layout.micro_batch, spec.seq_len, dtype=torch.long, device="meta")  # (m b, s)
        with comm_ledger() as ledger, timeline.recording():
            if layout.pp > 1:
                scatter = groups.tp if layout.tp > 1 and not layout.sequence_parallel else None  # 1/t per tp rank
                pipeline_step(chunks if len(chunks) > 1 else chunks[0], (tokens, tokens), m, _schedule(layout),
                              group=groups.pp, measure_memory=False, scatter_gather=scatter)
                sync_tied_embeddings(chunks, group=groups.embedding)
            else:
                stage = chunks[0]
                for x in tokens.chunk(m):  # (b, s) each
                    (stage.loss(stage(x), x) / m).backward()
            data_parallel.finish_gradients()
            timeline.mark("backward done")
            at_rest = dict(params=timeline.params, grads=timeline.grads, optimizer=timeline.optimizer)
            data_parallel.step()
            timeline.mark("step")
        records = list(ledger.records)
    layers = [[int(i) for i in c.blocks] for c in chunks]
    return Simulation(spec, layout, rank, global_batch, attention, coords, m, layers,
                      dict(at_rest, total=sum(at_rest.values())), timeline.activation_peak,
                      timeline.activation_peak_where, timeline.peak, timeline.peak_where, timeline.buffer_peak,
                      records, groups.ranks, timeline.samples, time.perf_counter() - start)


def representative_ranks(layout: Layout) -> dict[str, int]:
    """Ranks whose memory and traffic differ: rank 0 (first pipeline stage) and the last rank (last
    stage), and with experts the first rank holding the last expert-parallel group's share."""
    ranks = {"rank 0": 0, "last rank": layout.n_gpus - 1}
    if layout.ep > 1:
        ranks["expert rank"] = (layout.ep - 1) * layout.cp * layout.tp  # dp index ep-1: other experts than rank 0's
    return ranks
