"""What can run: a layout's sizes against the model and the cluster (check_layout), and the planner's
options; each refusal says what to change. What a framework refuses but the planner still costs is
Layout.caveats() (shardlib/plan/inputs.py).
"""

from __future__ import annotations

from shardlib.plan.cost import ATTENTION, DEFAULT_ATTENTION
from shardlib.plan.inputs import CP_METHODS, RECOMPUTE, Cluster, Layout
from shardlib.plan.model import ModelSpec


def check_batch(global_batch) -> None:
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer (sequences per step), got {global_batch!r}")


def check_options(cluster: Cluster, efficiency, overlap, reserve_gib: float, attention: str = DEFAULT_ATTENTION,
                  scatter_gather: bool = True, overlap_with_pipeline: bool = True, headroom: float = 0.0,
                  async_tp_backward: bool = True, checkpoint_early_stop: bool = False) -> None:
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], the fraction of the GPU's measured matmul ceiling "
                         f"(Cluster.matmul_tflops) the products reach; got {efficiency!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION} (Transformer Engine's fused attention, "
                         f"FlashAttention-2, FlashAttention's Triton kernel, or the scores written out), got {attention!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True (data-parallel communication overlapped with compute) or False; "
                         f"got {overlap!r}")
    for name, value in (("scatter_gather", scatter_gather), ("overlap_with_pipeline", overlap_with_pipeline),
                        ("async_tp_backward", async_tp_backward), ("checkpoint_early_stop", checkpoint_early_stop)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False (shardlib.plan.plan's docstring says what it means); "
                             f"got {value!r}")
    if not 0 <= reserve_gib < cluster.gpu_mem_gib:
        raise ValueError(f"reserve_gib must be in [0, {cluster.gpu_mem_gib:g}) GiB, got {reserve_gib!r}")
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be in [0, 1), the share of a GPU's memory a recommended layout leaves "
                         f"free (0.2 by default); got {headroom!r}")


def check_layout(spec: ModelSpec, cluster: Cluster, layout: Layout, global_batch: int) -> None:
    """Raise ValueError, saying what to change, for a layout that cannot run."""
    check_batch(global_batch)
    lay, problems = layout, []
    d, t, p, c, b, e, v = lay.dp, lay.tp, lay.pp, lay.cp, lay.micro_batch, lay.ep, lay.virtual_stages
    if min(d, t, p, c, b, e, v) < 1:
        raise ValueError(f"layout {lay} cannot run: dp, tp, pp, cp, ep, micro_batch and virtual_stages must be "
                         f">= 1 (got {d}, {t}, {p}, {c}, {e}, {b}, {v})")
    if lay.n_gpus != cluster.n_gpus:
        problems.append(f"dp*cp*tp*pp = {lay.n_gpus} but the cluster has {cluster.n_gpus} GPUs")
    elif global_batch % (d * b):
        problems.append(f"global batch {global_batch} is not a multiple of dp*micro_batch = {d * b}")
    if spec.n_head % t or spec.kv_heads % t or spec.ffn % t:
        problems.append(f"tp={t} must divide the heads ({spec.n_head}, {spec.kv_heads} key/value) and "
                        f"the MLP size ({spec.ffn})")
    if p > spec.n_layer:
        problems.append(f"pp={p} is more stages than the {spec.n_layer} layers")
    if v > 1 and (p == 1 or p * v > spec.n_layer + 2):
        problems.append(f"virtual_stages={v} needs pp > 1 and a layer in every chunk but the first and the last "
                        f"(which may hold only the embedding or the loss: Megatron-Core's "
                        f"account_for_embedding_in_pipeline_split): pp*virtual_stages at most {spec.n_layer} + 2")
    elif v > 1 and lay.n_gpus == cluster.n_gpus and not global_batch % (d * b) and (global_batch // (d * b)) % p:
        problems.append(f"the interleaved schedule runs micro-batches in groups of pp={p}: the "
                        f"{global_batch // (d * b)} micro-batches per step must be a multiple of it "
                        "(Megatron-Core, megatron/core/pipeline_parallel/schedules.py)")
    if lay.tp_overlap and not (lay.sequence_parallel and t > 1):
        problems.append("tp_overlap overlaps sequence parallelism's all-gathers and reduce-scatters with the "
                        "products they feed: it needs tp > 1 and sequence_parallel=True")
    if lay.zero not in (0, 1, 2, 3) or lay.recompute not in RECOMPUTE or lay.cp_method not in CP_METHODS:
        problems.append(f"zero must be 0..3, recompute one of {RECOMPUTE}, cp_method one of {CP_METHODS}")
    if lay.sequence_parallel and t > 1 and (spec.seq_len // c) % t:
        problems.append(f"sequence parallelism needs tp={t} to divide the {spec.seq_len // c} tokens per rank")
    if c > 1 and lay.cp_method in ("ring", "allgather") and spec.seq_len % (2 * c):
        problems.append(f"{lay.cp_method} attention splits each sequence in 2*cp = {2 * c} chunks (load balance): "
                        f"the sequence length {spec.seq_len} must be a multiple of it")
    if c > 1 and lay.cp_method == "ulysses" and ((spec.n_head // t) % c or (spec.kv_heads // t) % c):
        problems.append(f"Ulysses gives each of cp={c} ranks whole heads: cp must divide the {spec.n_head // t} "
                        f"heads and {spec.kv_heads // t} key/value heads per tensor-parallel rank")
    if e > 1 and (not spec.moe or spec.n_experts % e or d % e):
        problems.append(f"ep={e} needs a mixture of experts whose {spec.n_experts} experts it divides, and dp={d} "
                        "a multiple of it (experts are split inside the data-parallel group)")
    if problems:
        raise ValueError(f"layout {lay} cannot run: " + "; ".join(problems))
