"""Lesson 09's DeepSpeed table and chart: bytes per rank beside the formulas, and each ds_config key's shardlib.

The runs are shardlib/lessons/deepspeed_run.py's `compare_zero`; the formulas shardlib.memory's
ZeRO table (arXiv 1910.02054, Figure 1) with fp32 bytes per parameter: shardlib 4 (params) + 4
(grads) + 8 (m, v); DeepSpeed 4 + 4 + 12, because it keeps an fp32 master partition even when the
model is fp32 (`DEEPSPEED_FP32`). Per rank: stage 1 4 Psi + 4 Psi + 12 Psi/N ... stage 3 20 Psi/N.
"""

from __future__ import annotations

from shardlib import memory

__all__ = ["CONFIG_KEYS", "DEEPSPEED_FP32", "plot_zero_bytes", "zero_rows"]

# DeepSpeed's bytes per parameter in fp32 training: an fp32 master partition beside m and v
DEEPSPEED_FP32 = memory.Recipe(4, 4, 12, copies="fp32 weights (4), fp32 gradients (4); fp32 master partition, m, v (12)",
                               source="DeepSpeed 0.19 stage_1_and_2.py / stage3.py: single_partition_of_fp32_groups, "
                                      "fp32_partitioned_groups_flat (measured in lesson 09)")




def zero_rows(results: dict, n_params: int) -> list[dict]:
    """One row per (N, stage, library): bytes per rank held (rank 0's peak) beside the formulas.

    results: {(world_size, stage): compare_zero(...)}.
    """
    rows = []
    for (n, stage), per_rank in sorted(results.items()):
        for library, recipe in (("deepspeed", DEEPSPEED_FP32 if stage else "fp32_adam"), ("shardlib", "fp32_adam")):
            held = per_rank[0][library]["held"]
            formula = memory.zero_model_state_bytes(n_params, n, stage, recipe=recipe)
            rows.append(dict(N=n, stage=stage, library=library, **{k: held[k] for k in ("params", "grads", "optimizer",
                                                                                          "total")},
                             formula=round(formula["total"])))
    return rows


def plot_zero_bytes(rows: list[dict], world_size: int):
    """Stacked bars, params / grads / optimizer per rank, DeepSpeed beside shardlib at each stage."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["N"] == world_size]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
    for i, r in enumerate(rows):
        bottom = 0.0
        for kind, color in colors.items():
            ax.bar(i, r[kind] / 1024, bottom=bottom, color=color, label=kind if i == 0 else None,
                   hatch="//" if r["library"] == "deepspeed" else None, edgecolor="white")
            bottom += r[kind] / 1024
        ax.plot([i - 0.4, i + 0.4], [r["formula"] / 1024] * 2, color="black", lw=1.5,
                label="formula" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{'DS' if r['library'] == 'deepspeed' else 'ours'}\nZeRO-{r['stage']}"
                                     for r in rows])
    ax.set_ylabel("model states per rank (KiB)")
    ax.set_title(f"What each rank holds, N = {world_size} (hatched: DeepSpeed's own objects)")
    ax.legend(ncols=4, fontsize=8)
    fig.tight_layout()
    return fig


# ds_config key -> what it does -> the shardlib code that does the same (the lesson's table)
CONFIG_KEYS = [
    ("zero_optimization.stage", "0: all-reduce gradients; 1: shard optimizer state; 2: + gradients; 3: + parameters",
     "stage 0: parallel.ddp.DistributedDataParallel; 1-2: parallel.zero.ZeroOptimizer(stage=); "
     "3: parallel.fsdp.fully_shard (parallel.zero_stages.apply_zero picks)"),
    ("reduce_bucket_size", "elements per gradient reduction (and the size of the flat buffer gradients are copied into)",
     "ZeroOptimizer(bucket_cap_mb=); DistributedDataParallel(bucket_cap_mb=) (MiB, not elements)"),
    ("allgather_bucket_size", "elements per all-gather of updated parameters (stages 1-2)",
     "ZeroOptimizer(bucket_cap_mb=): one all-gather per bucket in step() (comm.ops.all_gather_into_tensor)"),
    ("overlap_comm", "reduce a bucket while backward computes the next (CUDA streams; no effect on CPU)",
     "DistributedDataParallel's async all-reduce from grad hooks; ZeroOptimizer stage 2's _on_grad_ready"),
    ("contiguous_gradients", "copy gradients into one preallocated flat buffer as they arrive",
     "ZeroOptimizer stage 1: p.grad are views of one flat_grad; DDP Bucket.buffer"),
    ("use_multi_rank_bucket_allreduce", "true (default): all-reduce a bucket spanning several owners; "
     "false: reduce each slice to its owner", "ZeroOptimizer: one reduce-scatter per bucket (comm.ops.reduce_scatter_tensor; the paper's 2(N-1)/N Psi)"),
    ("stage3_prefetch_bucket_size", "elements gathered ahead of the module that needs them",
     "fsdp.fully_shard(prefetch=True): the next unit's all-gather starts while this one computes (lesson 13)"),
    ("stage3_param_persistence_threshold", "parameters smaller than this stay whole on every rank",
     "fully_shard on blocks only; the root's leftover parameters form one more unit"),
    ("stage3_max_live_parameters / stage3_max_reuse_distance", "keep gathered parameters for reuse in backward",
     "fully_shard(reshard_after_forward=False)"),
    ("offload_optimizer / offload_param", "keep optimizer state / parameters in CPU memory or NVMe (ZeRO-Offload, "
     "ZeRO-Infinity)", "parallel.offload.CPUOffloadOptimizer (lesson 13); lesson 09's big-model inference offloads weights with Accelerate"),
    ("gradient_accumulation_steps", "micro-batches per optimizer step; stage 1 reduces once, at the last",
     "ZeroOptimizer stage 1 accumulates into flat_grad; stage 2 reduce-scatters each micro-batch"),
    ("gradient_clipping", "clip the global gradient norm (default 1.0 in DeepSpeed 0.19)", "not done: set 0.0 to compare"),
    ("bf16.enabled", "bf16 params and grads, fp32 master partition", "apply_zero(param_dtype=torch.bfloat16)"),
]
