"""A device mesh: the launched ranks arranged in a grid with named dimensions, one process group per line.

Every technique of the course talks within one process group: data parallelism all-reduces
gradients among the replicas, tensor parallelism all-reduces activations among the t ranks that
split a layer, pipeline parallelism sends activations from one stage to the next. Combining them
(3-D parallelism, "PTD-P": Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", arXiv 2104.04473) means arranging the N = d * p * t ranks in a
grid and giving each technique the group of ranks along its own axis. `Mesh` is that grid, named
after PyTorch's `DeviceMesh` (torch.distributed.device_mesh.init_device_mesh(device, shape,
mesh_dim_names=...)): the same idea, without DTensor.

How ranks map to coordinates. The grid is laid out in row-major (C) order: the LAST dimension
varies fastest. For `training_mesh(dp=2, pp=2, tp=2)` the dimensions are ("pp", "dp", "tp"), as
Megatron-LM orders them (tp fastest, then dp, then pp), and

    rank = (pp_index * d + dp_index) * t + tp_index

    rank  0  1  2  3  4  5  6  7
    pp    0  0  0  0  1  1  1  1
    dp    0  0  1  1  0  0  1  1
    tp    0  1  0  1  0  1  0  1

The group along a dimension holds the ranks whose other coordinates are equal: here the tp groups
are {0,1} {2,3} {4,5} {6,7} (neighbours), the dp groups {0,2} {1,3} {4,6} {5,7} (stride t), the pp
groups {0,4} {1,5} {2,6} {3,7} (stride d*t).

Why tp innermost. Launchers number the GPUs of one node consecutively, so the innermost dimension
lands inside a node, on its fastest links (NVLink, hundreds of GB/s), and the outermost crosses
nodes (InfiniBand/Ethernet, tens of GB/s). Tensor parallelism all-reduces b*s*h activations four
times per layer per micro-batch, on the critical path, so it goes innermost; pipeline parallelism
sends one b*s*h activation per micro-batch per stage boundary, point to point, and tolerates the
slowest links, so it goes outermost; data parallelism all-reduces the gradients once per step and
can overlap them with the backward, so it sits between (arXiv 2104.04473, Section 3, Takeaways 1
and 2: tensor parallelism up to the GPUs of one server, pipeline parallelism across servers).

Memory and communication are those of the techniques composed, each on its own group: with Psi
parameters, model states per rank 16 Psi / (t p) bytes (mixed-precision Adam) and / (d t p) with
ZeRO-3 over dp; per step a rank sends, in its tp group 4 * 2(t-1)/t * b s h elements per layer it
holds and per micro-batch (b the micro-batch on this replica), in its pp group b s h per
micro-batch to each neighbour, and in its dp group 2(d-1)/d * Psi/(t p) (3(d-1)/d with ZeRO-3).
shardlib/parallel/hybrid.py composes them.

Groups are created collectively: torch.distributed.new_group must be called by EVERY rank, for
every group, in the same order, even for the groups a rank does not belong to. `Mesh(...)` does it
in its constructor, so every rank must construct the same meshes in the same order. A mesh holds
no global state: pass it (or its groups) to whatever needs them.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch.distributed as dist

__all__ = ["Mesh", "training_mesh"]


class Mesh:
    """The N launched ranks as a grid of `shape`, dimensions named `dim_names` (last = fastest).

        mesh = Mesh((2, 2), ("dp", "tp"))       # on 4 ranks: tp groups {0,1} {2,3}, dp {0,2} {1,3}
        mesh.size("tp"), mesh.rank("dp")         # t, and this rank's index along dp
        mesh.group("tp")                         # this rank's tp process group, for the technique

    rank: the global rank whose view this is (default: this process's). create_groups: make the
    process groups (default: when torch.distributed is initialised); without them the mesh still
    answers every question about coordinates, which is how a notebook draws one.
    """

    def __init__(self, shape: Sequence[int], dim_names: Sequence[str], *, rank: int | None = None,
                 create_groups: bool | None = None):
        shape, dim_names = tuple(shape), tuple(dim_names)
        if len(shape) != len(dim_names) or not shape:
            raise ValueError(f"shape {shape} and dim_names {dim_names} must have the same, non-zero length")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"dimension names must be distinct, got {dim_names}")
        if any(not isinstance(n, int) or n < 1 for n in shape):
            raise ValueError(f"every dimension size must be an integer >= 1, got shape {shape}")
        self.shape, self.dim_names = shape, dim_names
        self.world_size = math.prod(shape)
        initialised = dist.is_available() and dist.is_initialized()
        if create_groups is None:
            create_groups = initialised
        if create_groups and not initialised:
            raise RuntimeError("process groups need torch.distributed initialised: build the mesh inside a function "
                               "run by shardlib.launch (or torchrun), or pass create_groups=False for coordinates only")
        if create_groups and dist.get_world_size() != self.world_size:
            raise ValueError(f"a mesh of shape {dict(zip(dim_names, shape))} needs {self.world_size} ranks, "
                             f"but {dist.get_world_size()} were launched: make the sizes multiply to the world size")
        if create_groups and rank is not None and rank != dist.get_rank():
            raise ValueError(f"a mesh with process groups is seen from this process's rank {dist.get_rank()}, "
                             f"not rank {rank}: pass create_groups=False to look from another rank")
        self.global_rank = rank if rank is not None else (dist.get_rank() if initialised else 0)
        if not 0 <= self.global_rank < self.world_size:
            raise ValueError(f"rank {self.global_rank} is outside a mesh of {self.world_size} ranks")
        self._groups = self._create_groups() if create_groups else None

    # -- coordinates (no communication) --------------------------------------------------

    def coordinates(self, rank: int | None = None) -> dict[str, int]:
        """{dim: index} of a global rank (default: this one); the last dimension varies fastest."""
        rank = self.global_rank if rank is None else rank
        coords = {}
        for name, size in zip(reversed(self.dim_names), reversed(self.shape)):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.dim_names}

    def rank_at(self, **coords: int) -> int:
        """The global rank at the given coordinates (every dimension named)."""
        if set(coords) != set(self.dim_names):
            raise ValueError(f"give a coordinate for each of {self.dim_names}, got {sorted(coords)}")
        rank = 0
        for name, size in zip(self.dim_names, self.shape):
            if not 0 <= coords[name] < size:
                raise ValueError(f"{name}={coords[name]} is outside 0..{size - 1}")
            rank = rank * size + coords[name]
        return rank

    def size(self, dim: str) -> int:
        """Ranks along `dim` (1 for a dimension the mesh does not have)."""
        return self.shape[self.dim_names.index(dim)] if dim in self.dim_names else 1

    def rank(self, dim: str) -> int:
        """This rank's index along `dim` (0 for a dimension the mesh does not have)."""
        return self.coordinates()[dim] if dim in self.dim_names else 0

    def groups_along(self, dim: str) -> list[list[int]]:
        """Every group of `dim`: lists of global ranks that differ only in their `dim` coordinate."""
        self._check_dim(dim)
        others = [n for n in self.dim_names if n != dim]
        groups = []
        for fixed in itertools.product(*(range(self.size(n)) for n in others)):
            where = dict(zip(others, fixed))
            groups.append([self.rank_at(**where, **{dim: i}) for i in range(self.size(dim))])
        return groups

    def ranks(self, dim: str) -> list[int]:
        """The global ranks of this rank's group along `dim`, in the order of their `dim` index."""
        return next(g for g in self.groups_along(dim) if self.global_rank in g)

    # -- process groups -----------------------------------------------------------------

    def _create_groups(self) -> dict:
        mine = {}
        for dim in self.dim_names:  # the same calls, in the same order, on every rank
            for ranks in self.groups_along(dim):
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    mine[dim] = group
        return mine

    def group(self, dim: str):
        """This rank's process group along `dim` (PyTorch: DeviceMesh.get_group(dim))."""
        self._check_dim(dim)
        if self._groups is None:
            raise RuntimeError("this mesh was built without process groups (torch.distributed was not "
                               "initialised): build it inside a launched function to communicate")
        return self._groups[dim]

    get_group = group

    def _check_dim(self, dim: str) -> None:
        if dim not in self.dim_names:
            raise ValueError(f"the mesh has no dimension {dim!r}; its dimensions are {self.dim_names}")

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"Mesh({dims}; rank {self.global_rank} at {self.coordinates()})"


def training_mesh(dp: int = 1, pp: int = 1, tp: int = 1, **kwargs) -> Mesh:
    """The 3-D training mesh in Megatron-LM's order: dimensions ("pp", "dp", "tp"), tp fastest."""
    return Mesh((pp, dp, tp), ("pp", "dp", "tp"), **kwargs)
