"""shardlib.mesh and shardlib.parallel.hybrid: coordinates, process groups, and hybrid layouts against one device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardlib.parallel.hybrid
from shardlib import launch
from shardlib.checks.harness import TOLERANCE
from shardlib.checks.hybrid import verify_hybrid
from shardlib.mesh import Mesh, training_mesh


def test_coordinates_follow_megatron_order():
    # rank = (pp * d + dp) * t + tp: written out by hand for d = p = t = 2
    mesh = training_mesh(dp=2, pp=2, tp=2, create_groups=False)
    expected = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1),
                4: (1, 0, 0), 5: (1, 0, 1), 6: (1, 1, 0), 7: (1, 1, 1)}
    for rank, (pp, dp, tp) in expected.items():
        assert mesh.coordinates(rank) == {"pp": pp, "dp": dp, "tp": tp}
        assert mesh.rank_at(pp=pp, dp=dp, tp=tp) == rank


def test_groups_along_each_dimension():
    mesh = training_mesh(dp=2, pp=2, tp=2, create_groups=False)
    assert mesh.groups_along("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups_along("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups_along("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    seen = Mesh((2, 2, 2), ("pp", "dp", "tp"), rank=5, create_groups=False)
    assert (seen.rank("pp"), seen.rank("dp"), seen.rank("tp")) == (1, 0, 1)
    assert seen.ranks("dp") == [5, 7] and seen.ranks("pp") == [1, 5]
    assert seen.size("tp") == 2 and seen.size("ep") == 1  # a dimension the mesh lacks has size 1


def test_bad_meshes_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="same, non-zero length"):
        Mesh((2, 2), ("dp",), create_groups=False)
    with pytest.raises(ValueError, match="distinct"):
        Mesh((2, 2), ("dp", "dp"), create_groups=False)
    with pytest.raises(ValueError, match=">= 1"):
        Mesh((2, 0), ("dp", "tp"), create_groups=False)
    with pytest.raises(ValueError, match="no dimension 'pp'"):
        Mesh((2, 2), ("dp", "tp"), create_groups=False).groups_along("pp")
    with pytest.raises(RuntimeError, match="without process groups"):
        Mesh((2, 2), ("dp", "tp"), create_groups=False).group("tp")


def _group_sums():
    # each rank contributes 10**rank: the sum over a group spells out its members
    mesh = Mesh((2, 2), ("dp", "tp"))
    out = {}
    for dim in ("dp", "tp"):
        x = torch.tensor([10.0 ** dist.get_rank()])
        dist.all_reduce(x, group=mesh.group(dim))
        out[dim] = (round(x.item()), dist.get_process_group_ranks(mesh.group(dim)))
    return out


def test_mesh_groups_talk_to_the_right_ranks():
    per_rank = launch(_group_sums, 4)
    for rank, out in enumerate(per_rank):
        tp_members = [rank - rank % 2, rank - rank % 2 + 1]
        dp_members = [rank % 2, rank % 2 + 2]
        assert out["tp"] == (sum(10 ** r for r in tp_members), tp_members)
        assert out["dp"] == (sum(10 ** r for r in dp_members), dp_members)


def _wrong_world():
    Mesh((2, 2), ("dp", "tp"))


def test_mesh_must_cover_the_world():
    with pytest.raises(Exception, match="needs 4 ranks, but 2 were launched"):
        launch(_wrong_world, 2)


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["dp-tp", "zero3-tp", "dp-pp", "pp-tp", "hsdp"])
def test_hybrid_layout_matches_one_device(technique):
    result = verify_hybrid(4, technique)
    assert result["passed"], result
    assert result["max_rel_diff"] <= TOLERANCE


@pytest.mark.slow
def test_three_dimensional_layout_matches_one_device():
    result = verify_hybrid(8, "dp-pp-tp")  # 2 x 2 x 2 on 8 CPU ranks
    assert result["passed"], result


def test_hybrid_check_fails_without_the_data_parallel_all_reduce(monkeypatch):
    # the check must catch a layout whose replicas never average their gradients (ranks are forked)
    monkeypatch.setattr(shardlib.parallel.hybrid, "all_reduce_gradients", lambda module, group=None: None)
    result = verify_hybrid(4, "dp-tp")
    assert not result["passed"]
    assert result["max_rel_diff"] > 1e-4


def test_hybrid_refuses_what_it_cannot_compose():
    with pytest.raises(ValueError, match="runs on world size 4 only"):
        verify_hybrid(2, "dp-tp")
    with pytest.raises(ValueError, match="'replicate' dimension needs a 'shard'"):
        shardlib.parallel.hybrid.data_parallel_dims(Mesh((2,), ("replicate",), create_groups=False))
    with pytest.raises(ValueError, match="no 'dp'|has none"):
        shardlib.parallel.hybrid.data_parallel_dims(Mesh((2,), ("tp",), create_groups=False), zero3=True)
