"""Hybrid parallelism: data, pipeline and tensor parallelism, ZeRO-3 and HSDP, composed on a Mesh.

Each technique of the course runs unchanged on the process group of its own mesh dimension
(shardlib/mesh.py); composing them is choosing which group each one gets (PTD-P, Narayanan et al.,
arXiv 2104.04473). For the course GPT on a mesh with dimensions among pp, dp, tp:

    tp  the layers split t ways (shardlib/parallel/tensor_gpt.py)             on mesh.group("tp")
    pp  the blocks cut into p stages (shardlib/parallel/pipeline.py)       on mesh.group("pp"); a stage of a
        tensor-parallel model is itself split t ways, and each of its t ranks sends 1/t of the
        (b/m, s, h) activation to the rank with the same tp index in the next stage, which
        all-gathers the pieces over tp (Megatron-LM's scatter/gather, arXiv 2104.04473, Section 4.1);
        a model with tied embeddings sums the gradients of the two ends' copies over the group of the
        first and the last stage (shardlib/parallel/tied_embeddings.py)
    dp  the global batch cut d ways; gradients averaged           on mesh.group("dp")
        (shardlib/parallel/ddp.py), or, with zero3=True, the (tensor-parallel) parameters fully
        sharded over it (shardlib/parallel/fsdp.py: ZeRO-3 x TP)

HSDP, hybrid sharded data parallelism (PyTorch FSDP, Zhao et al., arXiv 2304.11277, Section 3.2.1):
a mesh with dimensions ("replicate", "shard"), r x s = N ranks. Parameters are fully sharded
within each shard group of s ranks (ZeRO-3 on fast links) and replicated across the r groups; after
backward every rank all-reduces its gradient shard with the ranks holding the same shard in the
other groups. PyTorch: fully_shard(module, mesh=init_device_mesh(dev, (r, s),
mesh_dim_names=("replicate", "shard"))).

Per rank, Psi parameters, B global batch, m micro-batches, b = B/(d m) examples per micro-batch:

    model states   16 Psi_r bytes, Psi_r = Psi_split/t + Psi_replicated of this rank's stage
                   (tp_gpt.py); ZeRO-3 over dp: 16 Psi_r / d; HSDP: 16 Psi / s
    tp group       per micro-batch and block of the stage: 2 all-reduces of b s h forward,
                   2 backward; the embedding, output head and loss add theirs (tensor_parallel.py)
    pp group       per micro-batch: b s h / t elements to each neighbouring stage (activation forward,
                   gradient backward), and an all-gather of b s h in the tp group for each one received;
                   tied embeddings: an all-reduce of V h / t between the first and the last stage
    dp group       2(d-1)/d Psi_r elements per step (all-reduce); ZeRO-3: 3(d-1)/d Psi_r
    HSDP           3(s-1)/s Psi in the shard group, 2(r-1)/r Psi/s in the replicate group

Not done here: ZeRO-3 combined with pipeline stages (refused).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlib.comm import ops
from shardlib.mesh import Mesh
from shardlib.models import GPT
from shardlib.parallel.ddp import all_reduce_gradients
from shardlib.parallel.fsdp import full_state_dict as fsdp_full_state_dict
from shardlib.parallel.fsdp import fully_shard
from shardlib.parallel.pipeline import GPTStage, check_microbatches, gpt_stage, pipeline_step
from shardlib.parallel.tied_embeddings import embedding_group, sync_tied_embeddings
from shardlib.parallel.tensor_gpt import (
    TensorParallelGPT,
    check_tp_config,
    parallelize_gpt,
    vocab_parallel_cross_entropy,
)
from shardlib.reference import model_loss, rank_slice

__all__ = ["HybridGPT", "TensorParallelGPTStage", "data_parallel_dims"]


class TensorParallelGPTStage(GPTStage):
    """A pipeline stage cut from a TensorParallelGPT: the same modules as GPTStage, each split t
    ways; its last stage's logits are (b, s, V/t), so the loss is the vocabulary-parallel one."""

    def __init__(self, model: TensorParallelGPT, stage_index: int, num_stages: int, layers: range, *, group):
        super().__init__(model, stage_index, num_stages, layers)
        self.group = group

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, group=self.group)  # (b, s, V/t) -> scalar


def data_parallel_dims(mesh: Mesh, zero3: bool = False) -> tuple[str | None, str | None]:
    """(dimension the parameters are sharded over, dimension they are replicated over), or None."""
    if "shard" in mesh.dim_names:
        if "dp" in mesh.dim_names:
            raise ValueError("a mesh has either a 'dp' dimension or 'replicate'/'shard' (HSDP), not both")
        return "shard", "replicate" if "replicate" in mesh.dim_names else None
    if "replicate" in mesh.dim_names:
        raise ValueError("a 'replicate' dimension needs a 'shard' dimension beside it (HSDP); "
                         "for plain data parallelism name the dimension 'dp'")
    if zero3 and "dp" not in mesh.dim_names:
        raise ValueError(f"ZeRO-3 shards over the data-parallel dimension, and mesh {mesh.dim_names} has none: "
                         "add a 'dp' dimension")
    if "dp" not in mesh.dim_names:
        return None, None
    return ("dp", None) if zero3 else (None, "dp")


class HybridGPT:
    """This rank's part of a GPT laid out on `mesh`, and the step that trains it.

        mesh = training_mesh(dp=2, pp=2, tp=2)            # inside a launched function, 8 ranks
        hybrid = HybridGPT(build_gpt(config, seed=0), mesh)
        optimizer = torch.optim.AdamW(hybrid.module.parameters(), lr=3e-4)
        loss = hybrid.forward_backward(global_batch, n_microbatches=2); optimizer.step()
        state = hybrid.full_state_dict()                  # this stage's parameters, whole

    model: the full single-device GPT, the same on every rank (same seed). zero3: shard the
    parameters over "dp" (ZeRO-3 / FSDP) instead of replicating them. A mesh with "replicate" and
    "shard" dimensions is HSDP. layers_per_stage: blocks per pipeline stage (default: balanced).
    """

    def __init__(self, model: GPT, mesh: Mesh, *, zero3: bool = False, layers_per_stage: list[int] | None = None):
        unknown = set(mesh.dim_names) - {"pp", "dp", "tp", "replicate", "shard"}
        if unknown:
            raise ValueError(f"HybridGPT knows the dimensions pp, dp, tp, replicate, shard; got {sorted(unknown)}")
        t, p = mesh.size("tp"), mesh.size("pp")
        check_tp_config(model.config, t)
        self.mesh = mesh
        self.shard_dim, self.replicate_dim = data_parallel_dims(mesh, zero3)
        if self.shard_dim and p > 1:
            raise ValueError("ZeRO-3 / HSDP with pipeline stages is not composed here: use plain data "
                             "parallelism with pipeline parallelism (zero3=False)")
        module = parallelize_gpt(model, group=mesh.group("tp")) if t > 1 else model  # frozen stays frozen
        self.partition_dims = {name: getattr(q, "partition_dim", None) for name, q in module.named_parameters()}
        if p > 1:
            stage = gpt_stage(model, mesh.rank("pp"), p, layers_per_stage)  # which blocks: cut the full model
            blocks = [int(i) for i in stage.blocks]
            layers = range(blocks[0], blocks[-1] + 1)
            module = (TensorParallelGPTStage(module, mesh.rank("pp"), p, layers, group=mesh.group("tp")) if t > 1
                      else stage)
        if self.shard_dim:
            group = mesh.group(self.shard_dim)
            for block in module.blocks:
                fully_shard(block, group=group)
            fully_shard(module, group=group)
        self.module = module
        tied = p > 1 and model.config.tie_embeddings
        self.embedding_group = embedding_group(mesh.groups_along("pp"), mesh.global_rank) if tied else None

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """(index of this rank's replica among all data-parallel ranks, their number): the batch slice."""
        rank, size = 0, 1
        for dim in self.mesh.dim_names:  # outer dimension first
            if dim in (self.shard_dim, self.replicate_dim):
                rank, size = rank * self.mesh.size(dim) + self.mesh.rank(dim), size * self.mesh.size(dim)
        return rank, size

    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor], n_microbatches: int = 1,
                         schedule: str = "1f1b") -> float | None:
        """Forward and backward of this rank's share of the global batch; on return every trainable
        parameter's .grad is (its shard of) the gradient of the mean loss over the global batch.
        Returns the mean loss over this replica's examples (None on pipeline stages but the last)."""
        inputs, targets = rank_slice(batch, *self.data_parallel_rank_and_size())  # (B/d, s) each
        if self.mesh.size("pp") > 1:
            tp = self.mesh.group("tp") if self.mesh.size("tp") > 1 else None  # each tp rank sends 1/t
            loss = pipeline_step(self.module, (inputs, targets), n_microbatches, schedule,
                                 group=self.mesh.group("pp"), measure_memory=False, scatter_gather=tp).loss
            if self.embedding_group is not None:
                sync_tied_embeddings(self.module, group=self.embedding_group)
        else:
            check_microbatches(inputs.shape[0], n_microbatches)
            loss = 0.0
            for micro_batch in zip(inputs.chunk(n_microbatches), targets.chunk(n_microbatches)):
                micro_loss = model_loss(self.module, micro_batch) / n_microbatches  # (b/m, s) each
                micro_loss.backward()
                loss += micro_loss.item()
        if self.replicate_dim and self.mesh.size(self.replicate_dim) > 1:
            all_reduce_gradients(self.module, group=self.mesh.group(self.replicate_dim))  # (shard) grads
        return loss

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stage of the single-device state dict, whole (a collective over dp and tp)."""
        if self.shard_dim:
            local = fsdp_full_state_dict(self.module)  # gathered over the shard group: tp-local tensors
        else:
            local = {name: t.detach().clone() for name, t in self.module.state_dict().items()}
        tp_group = self.mesh.group("tp") if self.mesh.size("tp") > 1 else None
        return {name: t if tp_group is None or self.partition_dims.get(name) is None
                else _gather_along(t, self.partition_dims[name], tp_group) for name, t in local.items()}


def _gather_along(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate the group's shards along `dim`: (.., n/t, ..) -> (.., n, ..)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    ops.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
