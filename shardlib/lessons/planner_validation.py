"""The planner against published large training runs: their hardware, layout and step time.

Each run is described as its authors state it (model sizes, GPUs, links, parallel sizes, micro-batch,
recomputation); the planner predicts its step time (shardlib.plan.predict) and we compare it with
the step time the authors published, or derived from what they published:

- Megatron-LM, Narayanan et al., arXiv 2104.04473, Table 1: ten GPT models (1.7B to 1T) on 32 to
  3,072 A100 80GB GPUs of NVIDIA's Selene (DGX A100 nodes, 8 x 200 Gb/s HDR InfiniBand each),
  sequence length 2,048, vocabulary 51,200, fp16 mixed precision, full activation recomputation.
  Micro-batch sizes, virtual pipeline stages and data-parallel implementation (PyTorch's DDP,
  overlapped, or Megatron's "local" one, after the backward) are those of the paper's own scripts,
  https://github.com/NVIDIA/Megatron-LM/blob/main/examples/sc21/run_table_1.sh. Published: achieved
  TFLOP/s per GPU, X, counting F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs per step (eq. 3,
  recomputation included): the step took F / (N X) seconds.
- BLOOM-176B, arXiv 2211.05100 (Sec. 3.4: 48 nodes of 8 A100 80GB, NVLink inside a node, 4 Omni-Path
  100 Gb/s links per node) trained with tp 4, pp 12, dp 8, micro-batch 2, global batch 2,048 of 2,048
  tokens, full recomputation, bf16 with fp32 gradient accumulation and a ZeRO-1 style optimizer
  (bigscience train/tr11-176B-ml/tr11-176B-ml.slurm and README.md). Published: 105.22 s per iteration at
  that batch (train/tr11-176B-ml/chronicles.md, 2022-03-18), 149 TFLOP/s per GPU.
- Llama 3 405B, arXiv 2407.21783, Table 4: 8,192 and 16,384 H100 80GB GPUs (Sec. 3.3.1: NVLink inside
  8-GPU servers, 400 Gb/s per GPU between them), tp 8, cp 1 or 16, pp 16, dp the rest, 16M tokens per
  batch; published BF16 MFU 43%, 41%, 38% of 989 TFLOP/s (H100 SXM datasheet, dense bf16). The paper
  describes an interleaved pipeline schedule (Sec. 3.3.2) without giving its number of virtual stages,
  nor the micro-batch size: we take v = 2 (the least interleaving) and micro-batch 1, and say so. Its
  126 layers are split 7 + 14 x 8 + 7 over the 16 stages, as the paper does (Sec. 3.3.2). The
  planner's activation model finds v = 2 needs more than 80 GB (the paper's memory savings are not
  modelled); with v = 1, which it accepts, it predicts the 1F1B bubble and a slower step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlib.plan import Cluster, Layout, ModelSpec, predict

A100 = dict(gpus_per_node=8, gpu_mem_gib=80, peak_tflops=312, intra_bw_gbps=300, inter_bw_gbps=25)
# H100 SXM: 989 TFLOP/s dense bf16, NVLink 900 GB/s both ways, 3.35 TB/s HBM3
# (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)
H100 = dict(gpus_per_node=8, gpu_mem_gib=80, peak_tflops=989, intra_bw_gbps=450, inter_bw_gbps=50, hbm_bw_gbps=3350)


@dataclass(frozen=True)
class PublishedRun:
    """A run as published: what ran, and the step time it took (published or derived, `derivation`)."""

    name: str
    spec: ModelSpec
    cluster: Cluster
    layout: Layout
    global_batch: int
    recipe: str
    overlap: bool
    published: str  # the figure as its authors give it
    step_s: float  # the step time it means
    source: str
    assumed: str = ""  # what the source does not say and we chose


# Megatron-LM Table 1: (parameters in billions, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU),
# with the micro-batch, virtual stages and DDP of examples/sc21/run_table_1.sh
MEGATRON_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1, "torch"),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1, "torch"),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1, "torch"),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1, "torch"),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1, "local"),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3, "local"),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2, "local"),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2, "local"),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3, "local"),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1, "local"),
)


def megatron_flops(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """FLOPs of one step with full recomputation, arXiv 2104.04473 eq. (3)."""
    return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def _megatron_runs() -> list[PublishedRun]:
    runs = []
    for size, heads, h, layers, t, p, n, batch, tflops, b, v, ddp in MEGATRON_TABLE_1:
        spec = ModelSpec(layers, h, heads, 51200, 2048, tied_embeddings=True, name=f"gpt-{size:g}b")
        layout = Layout(dp=n // (t * p), tp=t, pp=p, micro_batch=b, recompute="full", virtual_stages=v)
        runs.append(PublishedRun(
            f"Megatron-LM GPT {size:g}B", spec, Cluster.of(n, **A100), layout, batch, "mixed_adam", ddp == "torch",
            f"{tflops} TFLOP/s per GPU", megatron_flops(batch, 2048, layers, h, 51200) / (n * tflops * 1e12),
            "arXiv 2104.04473, Table 1; examples/sc21/run_table_1.sh"))
    return runs


def _bloom() -> PublishedRun:
    cluster = Cluster.of(384, **{**A100, "inter_bw_gbps": 4 * 100 / 8 / 8})  # 4 x 100 Gb/s per node of 8 GPUs
    layout = Layout(dp=8, tp=4, pp=12, zero=1, micro_batch=2, recompute="full")
    return PublishedRun("BLOOM-176B", ModelSpec.preset("bloom-176b"), cluster, layout, 2048, "mixed_adam_fp32_grads",
                        False, "105.22 s per iteration", 105.22,
                        "arXiv 2211.05100, Sec. 3.4; bigscience train/tr11-176B-ml (slurm script, README, chronicles)")


def _llama3(n_gpus: int, cp: int, mfu: float, virtual_stages: int = 2) -> PublishedRun:
    seq = 131072 if cp > 1 else 8192
    spec = replace(ModelSpec.preset("llama3-405b"), seq_len=seq, name=f"llama3-405b, {seq // 1024}k context")
    cluster = Cluster.of(n_gpus, **H100)
    batch = 16 * 2**20 // seq  # 16M tokens per batch
    dp = n_gpus // (8 * cp * 16)
    layout = Layout(dp=dp, tp=8, pp=16, cp=cp, zero=1, micro_batch=1, virtual_stages=virtual_stages,
                    sequence_parallel=True, recompute="selective")
    model_flops = (6 * spec.matmul_params() + 12 * spec.n_layer * seq * spec.hidden) * batch * seq
    return PublishedRun(
        f"Llama 3 405B, {n_gpus:,} GPUs, cp {cp}", spec, cluster, layout, batch, "mixed_adam", True,
        f"BF16 MFU {mfu:.0%}", model_flops / (mfu * n_gpus * 989e12), "arXiv 2407.21783, Table 4 and Sec. 3.3",
        assumed=f"micro-batch 1, v = {virtual_stages}, sequence parallel, FlashAttention (counted as selective "
                "recomputation); MFU read as model FLOPs 6 Psi + 12 L s h per token")


def published_runs() -> list[PublishedRun]:
    """Every run of the module docstring, ready for predict()."""
    return _megatron_runs() + [_bloom()] + [_llama3(*row) for row in LLAMA3_TABLE_4]


LLAMA3_TABLE_4 = ((8192, 1, 0.43), (16384, 1, 0.41), (16384, 16, 0.38))  # GPUs, cp, BF16 MFU


def validate(runs: list[PublishedRun] | None = None, **options) -> list[dict]:
    """Predicted against published step time for each run: rows with the error (predicted / published - 1)
    and whether the planner finds the published layout fits. `options` go to predict (e.g. efficiency)."""
    rows = []
    for run in runs or published_runs():
        e = predict(run.spec, run.cluster, run.layout, run.global_batch, recipe=run.recipe, overlap=run.overlap,
                    **options)
        rows.append(dict(run=run.name, gpus=run.cluster.n_gpus, layout=str(run.layout), published=run.published,
                         published_step_s=run.step_s, predicted_step_s=e.step_s, error=e.step_s / run.step_s - 1,
                         memory_gib=e.memory_bytes / 2**30, fits=e.fits, mfu=e.mfu, source=run.source,
                         assumed=run.assumed))
    return rows


def format_validation(rows: list[dict]) -> str:
    """The table: published step time (or what it means), predicted, error; memory the planner predicts."""
    lines = [f"{'run':<32} {'GPUs':>6} {'published':>24} {'step s':>8} {'predicted':>9} {'error':>7} "
             f"{'GiB/GPU':>8} {'fits':>5}"]
    for r in rows:
        lines.append(f"{r['run']:<32} {r['gpus']:>6} {r['published']:>24} {r['published_step_s']:>8.2f} "
                     f"{r['predicted_step_s']:>9.2f} {r['error']:>+7.1%} {r['memory_gib']:>8.1f} "
                     f"{'yes' if r['fits'] else 'no':>5}{' *' if r['assumed'] else ''}")
    assumed = {r["assumed"] for r in rows if r["assumed"]}
    return "\n".join(lines + [f"* not published, assumed: {a}" for a in sorted(assumed)])


if __name__ == "__main__":  # python -m shardlib.lessons.planner_validation
    print(format_validation(validate()))
