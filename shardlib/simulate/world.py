"""One rank of a large job in this process: torch.distributed's fake backend, and the rank's groups.

The fake backend (torch.testing._internal.distributed.fake_pg: a FakeStore, backend "fake") lets a
process be rank r of a world of N without the N-1 others: init_process_group returns at once,
every collective and point-to-point call returns a finished Work and moves no data. shardlib's
techniques call it through shardlib.comm.ops as they would call gloo or NCCL, so the ledger
records exactly the calls and bytes of rank r.

Ranks are numbered as the planner numbers them (shardlib/plan/inputs.py, Megatron-LM's order):
tp fastest, then cp, then dp, then pp; an expert-parallel group of ep ranks is ep consecutive
data-parallel indices. The groups of one rank:

    tp          t ranks: the same layer split t ways
    cp          c ranks: the same sequence split c ways
    pp          p ranks: the stages, one rank each
    dense dp    d c ranks holding the same (non-expert) parameters: their gradients are reduced here
    ep          e ranks exchanging tokens for their experts (all-to-all)
    expert dp   d c / e ranks holding the same experts
    embedding   the first and the last stage of the rank's pipeline: a tied embedding's two copies
                (shardlib/parallel/tied_embeddings.py)
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from shardlib.mesh import Mesh
from shardlib.plan.inputs import Layout

__all__ = ["fake_world", "RankGroups", "rank_groups", "rank_coordinates"]

DIMS = ("pp", "dp", "cp", "tp")
BACKENDS = "cpu:fake,cuda:fake,meta:fake"  # the fake backend for meta tensors too (batched sends look it up)


@contextmanager
def fake_world(rank: int, world_size: int):
    """This process as rank `rank` of `world_size`, on the fake backend, for the duration of the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks: use --rank 0..{world_size - 1}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process (a launched rank?): simulate "
                           "from a notebook cell or a script, where no process group exists yet")
    hook = sys.excepthook  # init_process_group prefixes every later traceback with "[rank r]": undone after
    dist.init_process_group(BACKENDS, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def rank_coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """{pp, dp, cp, tp, ep} indices of a global rank (no process group needed)."""
    mesh = Mesh((layout.pp, layout.dp, layout.cp, layout.tp), DIMS, rank=rank, create_groups=False)
    coords = mesh.coordinates()
    return dict(coords, ep=coords["dp"] % layout.ep)


@dataclass
class RankGroups:
    """This rank's process groups, and each group's global ranks (how the ledger names them)."""

    tp: object
    cp: object
    pp: object
    dense_dp: object
    ep: object
    expert_dp: object
    embedding: object
    ranks: dict  # group name -> tuple of global ranks


def rank_groups(layout: Layout, rank: int) -> RankGroups:
    """Create this rank's groups (inside fake_world). One process holds one rank, so only its own
    groups are made (torch.distributed asks every rank to create every group; there are no others)."""
    mesh = Mesh((layout.pp, layout.dp, layout.cp, layout.tp), DIMS, rank=rank, create_groups=False)
    here = mesh.coordinates()

    def members(**free) -> tuple:
        """Global ranks that share this rank's coordinates except those in `free` (dim -> allowed indices)."""
        out = []
        for other in range(mesh.world_size):
            coords = mesh.coordinates(other)
            if all(coords[d] in free[d] if d in free else coords[d] == here[d] for d in DIMS):
                out.append(other)
        return tuple(out)

    e, d = layout.ep, layout.dp
    ep_block = range(here["dp"] - here["dp"] % e, here["dp"] - here["dp"] % e + e)
    same_experts = range(here["dp"] % e, d, e)
    ranks = {"tp": members(tp=range(layout.tp)), "cp": members(cp=range(layout.cp)),
             "pp": members(pp=range(layout.pp)), "dense_dp": members(dp=range(d), cp=range(layout.cp)),
             "ep": members(dp=ep_block), "expert_dp": members(dp=same_experts, cp=range(layout.cp)),
             "embedding": members(pp=(0, layout.pp - 1))}
    groups = {name: dist.new_group(list(r)) for name, r in ranks.items()}
    return RankGroups(**groups, ranks=ranks)
