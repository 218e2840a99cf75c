"""Planning for inference: what one GPU holds to serve a model (weights + KV cache) at a batch and a
context, and what it sends per generated token, under tensor (t) and pipeline (p) parallelism.

Per GPU, for the stage that holds most (L/p layers, the embedding on the first, the output layer
on the last; shardlib/plan/model.py counts the parameters as Megatron splits them):
    weights    (Psi_split / t + Psi_replicated of the stage) x bytes per weight
    KV cache   2 x (L/p) x kv_heads_per_rank x head_dim x context x batch x bytes per value, with
               kv_heads_per_rank = kv_heads / t, or 1 when t > kv_heads: a rank needs whole kv
               heads, so grouped-query attention's few kv heads are replicated (Megatron, vLLM;
               shardlib/inference/kv_cache.py; their k and v weights too). Grouped-query attention: kv_heads < heads
               (Ainslie et al., arXiv 2305.13245; Llama 2 70B: 8 of 64, arXiv 2307.09288).
Bytes the busiest GPU sends per decode step (b sequences, one new token each; shardlib/inference/generate.py):
    TP         2 all-reduces of b h values per layer (attention, MLP) and one for the vocabulary-
               parallel embedding: (2 L/p + 1) x 2 (t-1)/t x b h values, and the last stage gathers
               the b V logits: (t-1)/t x b V values (Megatron-LM, arXiv 1909.08053)
    PP         b h values to the next stage (the last stage sends the b new token ids, 8 bytes each,
               back to the first)
Per generated token: the step's bytes / b. Decode time, a roofline (Pope et al., arXiv 2211.05102):
each step reads the stage's weights and cache once, max(bytes / HBM bandwidth, 2 Psi_stage b / FLOP/s),
times p stages one after the other, plus the collectives (alpha-beta, as for training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlib.comm import AlphaBeta
from shardlib.memory import dtype_bytes
from shardlib.plan.inputs import Cluster, GiB
from shardlib.plan.model import ModelSpec

GPU_SIZES_GIB = (24, 40, 80)  # e.g. a 24 GB L4 or RTX 4090, an A100 40GB, an A100 or H100 80GB


@dataclass
class InferenceEstimate:
    """One GPU of a (tp, pp) serving layout: bytes held, bytes sent per decode step, seconds per token."""

    model: str
    gpu_mem_gib: float
    tp: int
    pp: int
    batch: int
    context: int
    weight_bytes: float
    kv_cache_bytes: float
    tp_sent_per_step: float
    pp_sent_per_step: float
    step_s: float  # one decode step of the whole batch (a roofline)
    max_batch: int  # the most sequences of `context` tokens that fit next to the weights

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_cache_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_mem_gib * GiB

    @property
    def sent_per_token(self) -> float:
        return (self.tp_sent_per_step + self.pp_sent_per_step) / self.batch


def kv_heads_per_rank(spec: ModelSpec, t: int) -> int:
    if spec.kv_heads % t and t % spec.kv_heads:
        raise ValueError(f"tp={t} must divide the {spec.kv_heads} key/value heads or be a multiple of them")
    return max(spec.kv_heads // t, 1)


def _stages(spec: ModelSpec, p: int) -> list[tuple[bool, bool, int]]:
    """(first, last, layers) of the stages that can hold most: the first, the last, a middle one."""
    base, extra = divmod(spec.n_layer, p)
    if p == 1:
        return [(True, True, spec.n_layer)]
    middle = [(False, False, base + (extra > 0))] if p > 2 else []
    return [(True, False, base + (extra > p - 2)), (False, True, base)] + middle


def predict_inference(spec: ModelSpec, cluster: Cluster, *, tp: int = 1, pp: int = 1, batch: int = 1,
                      context: int | None = None, weight_dtype="bf16", kv_dtype=None) -> InferenceEstimate:
    """Weights + KV cache on the busiest GPU of `tp` x `pp` GPUs serving `batch` sequences of `context`
    tokens (default the model's seq_len), bytes sent and seconds per decode step (module docstring)."""
    context = context or spec.seq_len
    if min(tp, pp, batch, context) < 1:
        raise ValueError(f"tp, pp, batch and context must be >= 1, got {tp}, {pp}, {batch}, {context}")
    if spec.n_head % tp or spec.ffn % tp:
        raise ValueError(f"tp={tp} must divide the {spec.n_head} heads and the MLP size {spec.ffn}")
    if pp > spec.n_layer:
        raise ValueError(f"pp={pp} is more stages than the {spec.n_layer} layers")
    w, kv = dtype_bytes(weight_dtype), dtype_bytes(kv_dtype or weight_dtype)
    heads, h, V = kv_heads_per_rank(spec, tp), spec.hidden, spec.vocab_size
    per_sequence = 2 * heads * spec.head_dim * context * kv  # one layer's keys and values of one sequence
    tp_link = AlphaBeta(cluster.alpha_us * 1e-6, cluster.intra_bw_gbps * 1e9)
    rows = []
    for first, last, layers in _stages(spec, pp):
        split, replicated = spec.stage_params(first, last, layers)
        experts = layers * spec.n_experts * sum(spec.mlp_params()) / tp
        kv_replicas = layers * (2 * h + spec.bias + bool(spec.bias if spec.key_bias is None else spec.key_bias)) \
            * spec.head_dim * (heads - spec.kv_heads / tp)  # k, v of whole kv heads when tp > kv_heads
        weights = (split / tp + replicated + experts + kv_replicas) * w
        cache = layers * per_sequence * batch
        tp_sent = ((2 * layers + first) * 2 * (tp - 1) / tp * batch * h + last * (tp - 1) / tp * batch * V) * w
        pp_sent = 0 if pp == 1 else (batch * 8 if last else batch * h * w)
        read = (weights + cache) / (cluster.hbm_bw_gbps * 1e9)
        flops = 2 * (split / tp + experts / max(spec.n_experts, 1) * spec.top_k) * batch / (cluster.peak_tflops * 1e12)
        comm = (2 * layers + first) * tp_link.time("all_reduce", batch * h * w, tp) + last * tp_link.time(
            "all_gather", batch * V * w, tp)
        rows.append((weights + cache, weights, cache, tp_sent, pp_sent, max(read, flops) + comm, layers))
    _, weights, cache, _, _, _, layers = max(rows)  # the stage that holds most
    tp_sent, pp_sent, stage_s = (max(row[i] for row in rows) for i in (3, 4, 5))  # the busiest sender, the slowest
    room = cluster.gpu_mem_gib * GiB - weights
    max_batch = max(0, math.floor(room / (layers * per_sequence))) if room > 0 else 0
    bandwidth = cluster.intra_bw_gbps if tp * pp <= cluster.gpus_per_node else cluster.inter_bw_gbps
    hop = cluster.alpha_us * 1e-6 + batch * h * w / (bandwidth * 1e9)  # one point-to-point send between stages
    return InferenceEstimate(spec.name, cluster.gpu_mem_gib, tp, pp, batch, context, weights, cache, tp_sent, pp_sent,
                             pp * stage_s + (pp - 1) * hop, max_batch)


def inference_table(spec: ModelSpec, *, batch: int = 1, context: int | None = None,
                    gpu_sizes=GPU_SIZES_GIB, weight_dtype="bf16", kv_dtype=None, **cluster) -> list[InferenceEstimate]:
    """For each GPU size: one GPU, then the fewest GPUs that fit by TP (t <= 8, in one node) and by PP."""
    rows = []
    for size in gpu_sizes:
        gpu = Cluster(gpu_mem_gib=size, **cluster)
        options = dict(batch=batch, context=context, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
        one = predict_inference(spec, gpu, **options)
        rows.append(one)
        if one.fits:
            continue
        for key in ("tp", "pp"):
            sizes = [t for t in (2, 4, 8) if spec.n_head % t == 0] if key == "tp" else [2, 4, 8, 16]
            tried = [predict_inference(spec, gpu, **{key: n}, **options) for n in sizes if n <= spec.n_layer]
            rows.append(next((e for e in tried if e.fits), tried[-1]))
    return rows


def format_inference_table(rows: list[InferenceEstimate]) -> str:
    lines = [f"{'GPU GiB':>7} {'tp':>3} {'pp':>3} {'weights':>8} {'KV cache':>8} {'total':>8} {'fits':>5} "
             f"{'max batch':>9} {'TP B/token':>11} {'PP B/token':>11} {'ms/token':>9}"]
    for e in rows:
        lines.append(f"{e.gpu_mem_gib:>7g} {e.tp:>3} {e.pp:>3} {e.weight_bytes / GiB:>8.1f} "
                     f"{e.kv_cache_bytes / GiB:>8.2f} {e.total_bytes / GiB:>8.1f} {'yes' if e.fits else 'no':>5} "
                     f"{e.max_batch:>9} {_bytes(e.tp_sent_per_step / e.batch):>11} "
                     f"{_bytes(e.pp_sent_per_step / e.batch):>11} {e.step_s * 1e3:>9.1f}")
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for size, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
