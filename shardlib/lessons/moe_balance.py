"""A mixture of experts trained, then measured on expert-parallel ranks: load per rank, dropped
tokens, bytes (lesson 12).

`train_moe` trains the course GPT with a MoE in every block on the course text (one rank, its
device) and returns its weights; `expert_parallel_load` and `capacity_sweep` run those weights with
the experts split over the launched ranks (shardlib.parallel.experts) and measure, on held-out
batches, what each rank's experts are sent and what the all-to-alls carry, from the routing and the
ledger of the real run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlib.comm import comm_ledger, ops
from shardlib.launch import current_device
from shardlib.models import GPTConfig, build_gpt, text_batches
from shardlib.parallel.experts import parallelize_gpt_experts
from shardlib.reference import rank_slice

__all__ = ["train_moe", "expert_parallel_load", "capacity_sweep"]


def train_moe(config: GPTConfig, steps: int, batch_size: int = 8, lr: float = 3e-3, seed: int = 0) -> dict:
    """Train on `steps` batches of the course text. Returns {"state": CPU state dict} and, per step, the
    cross-entropy ("loss", without the balancing loss), the balancing loss ("aux", mean over layers) and
    the share of assignments dropped ("dropped", over all layers)."""
    device = current_device()
    model = build_gpt(config, seed=seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    history = {"aux": [], "loss": [], "dropped": []}
    for inputs, targets in text_batches(batch_size, config.seq_len, steps, seed=seed):
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(inputs.to(device), targets.to(device))
        loss.backward()
        optimizer.step()
        aux = sum(block.mlp.aux_loss.item() for block in model.blocks)
        history["loss"].append(loss.item() - config.aux_loss_coef * aux)
        history["aux"].append(aux / config.n_layer)
        kept = torch.cat([block.mlp.routing.kept.flatten() for block in model.blocks])
        history["dropped"].append(1 - kept.float().mean().item())
    history["state"] = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    return history


def _expert_parallel_model(config: GPTConfig, state: dict):
    model = build_gpt(config, seed=0)
    model.load_state_dict(state)
    return parallelize_gpt_experts(model.to(current_device()), group=dist.group.WORLD)


def _local_counts(model, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignments routed to each expert, assignments kept) from this rank's tokens, summed over layers."""
    routed = torch.zeros(n_experts, device=current_device())
    kept = torch.zeros(n_experts, device=current_device())
    for block in model.blocks:
        experts = block.mlp.routing.experts
        routed += torch.bincount(experts.flatten(), minlength=n_experts)
        kept += torch.bincount(experts[block.mlp.routing.kept], minlength=n_experts)
    return routed, kept


@torch.no_grad()
def expert_parallel_load(config: GPTConfig, state: dict, batches: list) -> dict:
    """In each rank: forward the held-out `batches` (this rank's slice of each) with the experts split
    over every rank. Returns, summed over ranks: per rank, the assignments its experts were sent
    (before capacity) and kept; and the fraction dropped."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _expert_parallel_model(config, state)
    routed = kept = 0
    for batch in batches:
        inputs, targets = (t.to(current_device()) for t in rank_slice(batch, rank, n))
        model(inputs, targets)
        counts = torch.stack(_local_counts(model, config.n_experts))  # (2, E)
        ops.all_reduce(counts, group=dist.group.WORLD)  # every rank's tokens
        routed, kept = routed + counts[0], kept + counts[1]
    per_rank = lambda c: c.view(n, -1).sum(1).tolist()  # noqa: E731 - experts [r E/N, (r+1) E/N) are rank r's
    return {"routed": per_rank(routed), "kept": per_rank(kept), "dropped": 1 - (kept.sum() / routed.sum()).item()}


@torch.no_grad()
def capacity_sweep(config: GPTConfig, state: dict, batches: list, factors: list[float]) -> list[dict]:
    """In each rank: for each capacity factor, the held-out loss, the fraction of assignments dropped,
    and per rank and MoE layer forward the bytes of the expert buffers and the all-to-all bytes sent
    (the ledger's records of the real calls)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _expert_parallel_model(config, state)
    rows = []
    for factor in factors:
        for block in model.blocks:
            block.mlp.capacity_factor = factor
        totals = torch.zeros(3, device=current_device())  # loss, routed, kept
        with comm_ledger() as ledger:
            for batch in batches:
                inputs, targets = (t.to(current_device()) for t in rank_slice(batch, rank, n))
                _, loss = model(inputs, targets)
                routed, kept = _local_counts(model, config.n_experts)
                totals += torch.stack([loss - config.aux_loss_coef * sum(b.mlp.aux_loss for b in model.blocks),
                                       routed.sum(), kept.sum()])
        ops.all_reduce(totals, group=dist.group.WORLD)
        calls = ledger.calls("all_to_all")  # 2 per MoE layer and batch
        rows.append({"capacity_factor": factor, "loss": totals[0].item() / (n * len(batches)),
                     "dropped": 1 - (totals[2] / totals[1]).item(),
                     "buffer_bytes": 2 * ledger.bytes("all_to_all") // calls,  # dispatched + returned, one layer
                     "sent_bytes": 2 * ledger.sent_bytes("all_to_all") // calls})  # per MoE layer forward
    return rows
