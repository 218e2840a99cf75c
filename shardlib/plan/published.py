"""Published training runs the planner is held against: what ran, on what, and how long a step took.

Training and held-out runs, never mixed. training_runs() fix the cost model's free constants
(shardlib/plan/fitted.py, by shardlib.plan.validate.fit()); held_out_runs() and mosaic.fsdp_runs() (another engine,
shown apart) are used for nothing but the error they report. Every
figure is the source's; what a source does not publish is either chosen by the planner among the
settings the source allows (`free`: the best that fits, said in the table) or assumed and said
(`assumed`). `search` narrows the ranking to what the run's software could do (SOFTWARE).

training_runs()
- Megatron-LM, Narayanan et al., arXiv 2104.04473, Table 1 (also the repository's images/cases_april2021.png):
  ten GPT models, 1.7B to 1T, on 32 to 3,072 A100 80GB of Selene (DGX A100: NVLink, 8 x 200 Gb/s HDR
  InfiniBand per node), s = 2,048, V = 51,200, fp16, full recomputation. Micro-batch, virtual stages and
  data-parallel implementation (PyTorch's DDP, overlapped, or Megatron's "local" one, after the backward)
  from the paper's own script, examples/sc21/run_table_1.sh. The Megatron-LM of that time ran pipelines only with
  the local one ("We only support local DDP with multiple micro-batches", megatron/training.py, April 2021): in
  the ranking, a layout with pp > 1 reduces its gradients after the backward (overlap_with_pipeline=False).
  Published: TFLOP/s per GPU X, counting F = 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) FLOPs per step (eq. 3,
  recomputation included): step = F / (N X).
- Megatron-Core, H100 weak scaling (NVIDIA/Megatron-LM README, "Training Speed and Scalability", the table
  images/model_table.png, r0.8.0): nine GPT models, 1.7B to 462B, on 48 to 6,144 H100, V = 131,072,
  s = 4,096, data-parallel size 48, with --overlap-grad-reduce --overlap-param-gather (the distributed
  optimizer) and --tp-comm-overlap; bf16, so gradients accumulated and reduced in fp32 (Megatron-LM's
  arguments.py). Published: TFLOP/s per GPU by Megatron's num_floating_point_operations (no recomputation
  counted). Micro-batch, virtual stages and recomputation are not published: free. Attention: Transformer
  Engine's, which runs cuDNN's kernel on Hopper (attention="fused", shardlib/plan/attention.py), as in the NeMo
  runs below.

held_out_runs()
- GPT-3 175B on 1,024 A100 (Megatron-LM README, January 2021, and examples/pretrain_gpt3_175B.sh): t 8, p 16,
  micro-batch 1, batch 1,536, fp16, full recomputation; "each iteration takes around 32 seconds resulting in
  138 teraFLOPs per GPU"; step from the TFLOP/s by eq. 3. The software of that date had neither the interleaved
  schedule nor the scatter/gather of pipeline messages (SOFTWARE["megatron-2021-01"]).
- BLOOM-176B, arXiv 2211.05100 (Sec. 3.4: 48 nodes of 8 A100 80GB, 4 x 100 Gb/s Omni-Path per node), t 4,
  p 12, d 8, micro-batch 2, batch 2,048, full recomputation, bf16 with fp32 gradient accumulation and a ZeRO-1
  optimizer (bigscience train/tr11-176B-ml/tr11-176B-ml.slurm): DeepSpeed's BF16_Optimizer, which keeps the bf16
  gradients beside their fp32 sums (DEEPSPEED_BF16_OPTIMIZER); 105.22 s per iteration (chronicles.md).
- Megatron-LM in 2022, Korthikanti et al., arXiv 2205.05198, Tables 3 and 5: GPT 22B, 175B, 530B and 1T on 8 to
  512 A100 80GB with one data-parallel rank, t 8, p 1 to 64, each timed twice: with full recomputation (the
  baseline; tensor parallelism as before the paper, no sequence parallelism: assumed) and with sequence parallelism
  and selective recomputation; unfused attention. Micro-batch and virtual stages are not published: free. The
  code of that spring (megatron/mpu/layers.py at cfd2e21, 2022-04-28) all-reduces each column-parallel layer's
  input gradient (reduce-scatters it, with sequence parallelism) beside that layer's weight-gradient product
  (async_tp_backward), by default since 2021-09-07; the runs before that date, BigScience's Megatron-DeepSpeed
  (its ColumnParallelLinear all-reduces in copy_to_tensor_model_parallel_region's backward), MT-NLG's engine and
  Llama 3 (which describes no TP overlap) are costed without it.
- MT-NLG 530B, arXiv 2201.11990, Sec. 2.4: Megatron's tensor parallelism in DeepSpeed's pipeline engine, t 8,
  p 35, batch 1,920 on 2,240, 2,800 and 3,360 A100; 60.1, 50.2 and 44.4 s per iteration. Missed: predicted 18-22%
  fast (MT_NLG_MISS says what was checked); reported beside the set's figures, not in them (`known_miss`).
- Llama 3 405B, arXiv 2407.21783, Table 4: 8,192 and 16,384 H100 (NVLink in servers of 8, 400 Gb/s per GPU
  between them), t 8, c 1 or 16, p 16, 2,048 (or 128) sequences per batch; BF16 MFU 43%, 41%, 38% of 989
  TFLOP/s, model FLOPs read as 6 Psi + 12 L s h per token; no activation checkpointing at 8k (Sec. 3.3.2),
  FlashAttention; FSDP sharding the optimizer states and gradients (ZeRO-2 inside the pipeline: marked, see
  Layout.caveats); context parallelism by all-gathering K and V (Sec. 3.3.2), the only kind its search tries. Not published: the micro-batch (1 assumed) and the virtual stages (8: Sec. 3.3.2 has the
  first chunk of the first stage hold only the embedding, chunks of one layer). At 131k tokens the step time
  is not derived (how the MFU counts causal attention changes it 1.4 x): memory only.
- Nemotron-4 340B, arXiv 2406.11704, Table 2 (quoted at https://aiportalx.com/nvidia/nemotron-4-340b): the
  last stage of its batch ramp on all 6,144 H100, batch 2,304, 8.0 s per iteration; the layout of
  NeMo-Framework-Launcher's launcher_scripts/conf/training/nemotron/nemotron_340b.yaml (768 nodes, the same
  batch): t 8, p 8, v 12, micro-batch 1, sequence parallel, selective recomputation, TP overlap, distributed
  optimizer reducing in bf16.
- Memory only (FP8 runs: step times are not compared; the layouts must fit): NeMo 24.07's pre-training
  table on DGX-H100 (NVIDIA/NeMo docs/source/performance/performance_summary.md): every dense row, among them
  Nemotron-340B on 128 GPUs (t 8, p 8, v 12, batch 32). Recomputation is not published: free.

MosaicML's FSDP benchmarks, another engine, are in shardlib/plan/mosaic.py: held out too, and shown apart.

bloom_layout_search(): five layouts of BLOOM timed side by side on its cluster before training (its chronicle):
a check of the ranking itself, used for nothing else (validate.side_by_side). megatron_sweeps(): Megatron-LM's
sweeps of one model over tensor, pipeline and data parallelism on 64 GPUs of the training set's cluster
(Figures 13-15), held by the order the paper reports (validate.sweeps), and used for nothing else.

Not used: OPT-175B (its iteration time and micro-batch are not in a source this project's search reaches), PaLM
(TPU v4, which the planner does not model).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardlib.memory import Recipe
from shardlib.plan.inputs import Cluster, Layout
from shardlib.plan.model import ModelSpec


@dataclass(frozen=True)
class PublishedRun:
    """A run as published: what ran, and the step time it took (published or derived from what was)."""

    name: str
    spec: ModelSpec
    cluster: Cluster
    layout: Layout
    global_batch: int
    recipe: str | Recipe  # a name of shardlib.memory.TRAINING_RECIPES, or the run's own
    published: str  # the figure as its authors give it
    step_s: float | None  # the step time it means (None: memory only)
    source: str
    overlap: bool = True
    scatter_gather: bool = True  # pipeline messages split over the tensor-parallel ranks (arXiv 2104.04473, 4.1)
    overlap_with_pipeline: bool = True  # data-parallel overlap also when pp > 1 (False: Megatron-LM, 2021)
    async_tp_backward: bool = True  # column layers' input-gradient collectives beside their weight gradients
    # (Megatron-LM since 2021-09; False: Megatron-LM before, Megatron-DeepSpeed's forks, and where nothing is said)
    checkpoint_early_stop: bool = False  # full recomputation stops at the last saved tensor (PyTorch >= 2.1)
    attention: str = "flash"
    free: dict = field(default_factory=dict)  # unpublished knobs: the values the planner may choose among
    assumed: str = ""  # what the source does not say and we chose
    gpu: str = "a100"  # which fitted matmul fraction applies (shardlib/plan/fitted.py)
    search: dict = field(default_factory=dict)  # what the framework of the run could not do, or the study held
    # fixed: narrows the planner's default search when the published layout is ranked (SOFTWARE)
    known_miss: str = ""  # why the planner misses this run past the held-out targets: reported, not in the figures


def megatron_flops(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """FLOPs of one step with full recomputation, arXiv 2104.04473 eq. (3)."""
    return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def megatron_core_flops(spec: ModelSpec, batch: int) -> float:
    """FLOPs of one step as Megatron-LM counts them (megatron/training/training.py,
    num_floating_point_operations): 12 B s L h^2 ((1 + g/a + s/h) + f/h (3/2 gated) + V / (2 L h))."""
    h, s, L = spec.hidden, spec.seq_len, spec.n_layer
    attention = 1 + spec.kv_heads / spec.n_head + s / h
    mlp = spec.ffn / h * (1.5 if spec.gated_mlp else 1.0) * (spec.top_k if spec.moe else 1)
    return 12.0 * batch * s * L * h * h * (attention + mlp + spec.vocab_size / (2 * L * h))


# Megatron-LM Table 1: (parameters in billions, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU,
# micro-batch, virtual stages, DDP) with the micro-batch, virtual stages and DDP of examples/sc21/run_table_1.sh
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
# Megatron-Core H100 weak scaling (README's images/model_table.png): (billions, heads, hidden, layers, t, p,
# GPUs, batch, TFLOP/s per GPU); data-parallel size 48 throughout
MEGATRON_CORE_H100 = (
    (1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8),
    (7.1, 32, 4096, 30, 2, 1, 96, 192, 465.9),
    (16, 48, 6144, 32, 4, 1, 192, 192, 489.1),
    (32, 56, 7168, 48, 8, 1, 384, 192, 459.6),
    (70, 64, 8192, 84, 8, 2, 768, 384, 419.7),
    (119, 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    (177, 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    (314, 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    (462, 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)
# Megatron-LM in 2022, Korthikanti et al., arXiv 2205.05198: Table 3's layouts and Table 5's seconds per
# iteration with full recomputation (the baseline) and with sequence parallelism and selective recomputation (the
# paper's): (billions, heads, hidden, layers, t, p, GPUs, batch, full s, selective s); one data-parallel rank,
# s 2,048, V 51,200. The repository's README gives the MFU of the same four runs (41.5, 51.4, 56.0, 56.3%), which
# these batches and times reproduce by 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) over 312 TFLOP/s.
MEGATRON_2022 = (
    (22, 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10),
    (175, 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    (530, 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83),
    (1000, 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
)
# Megatron-Turing NLG 530B on DeepSpeed's pipeline engine with Megatron's tensor parallelism (arXiv 2201.11990,
# Sec. 2.4): t 8, p 35, batch 1,920 on 280, 350 and 420 DGX A100: (GPUs, seconds per iteration, TFLOP/s per GPU)
MT_NLG = ((2240, 60.1, 126), (2800, 50.2, 121), (3360, 44.4, 113))
MT_NLG_MISS = (
    "predicted fast at all three sizes, by more than any cost of the model explains: each micro-batch takes longer "
    "than predicted and each step carries seconds the model has no cost for (split below); Megatron-LM's own "
    "engine took less per sequence on the same shape and GPUs, bubble and step included, than these runs' slot "
    "alone (below), and is predicted within the targets there; DeepSpeed's 1F1B schedule, "
    "its gradient reduction after the drain and its per-micro-batch copies were checked (deepspeed/runtime/pipe, "
    "2021), and BLOOM on the same engine is not missed")
# NeMo 24.07, DGX-H100, FP8 (memory only): (model, GPUs, batch, micro-batch, s, t, p, c, v)
NEMO_24_07 = (
    ("llama-7b", 8, 128, 1, 4096, 1, 1, 1, 1), ("llama-13b", 16, 128, 1, 4096, 1, 4, 1, 10),
    ("llama-70b", 64, 128, 1, 4096, 4, 4, 1, 20), ("nemotron4-340b", 128, 32, 1, 4096, 8, 8, 1, 12),
    ("gpt3-175b", 128, 256, 1, 2048, 4, 8, 1, 6), ("gpt3-175b", 512, 2048, 2, 2048, 4, 8, 1, 6),
)
# What the software of a run could do, as choices for planner.plan(): the ranking searches only these.
SOFTWARE = {
    # Megatron-LM in 2021: no sequence parallelism, selective recomputation or distributed optimizer (2022), no
    # context parallelism, no TP overlap; Table 1 recomputes every layer in every run (run_table_1.sh); as many
    # layers on every stage ("num_layers must be divisible by pipeline_model_parallel_size", megatron/model/
    # transformer.py) and interleaving on more than 2 stages only ("pipeline-model-parallel size should be greater
    # than 2 with interleaved schedule", megatron/arguments.py; both at commit aed2f75, 2021-04-11)
    "megatron-2021": dict(zero_stages=(0,), sequence_parallel=(False,), tp_overlap=(False,), max_cp=1,
                          recompute=("full",), even_stages=True, min_interleaved_pp=3),
    # Megatron-DeepSpeed for BLOOM (2022): its BF16 optimizer is ZeRO-1; no sequence parallelism or selective
    # recomputation (Megatron-LM added them later that year); DeepSpeed's pipeline engine runs 1F1B without
    # interleaving (deepspeed/runtime/pipe/schedule.py, TrainSchedule: 2 (m + p - 1) steps) and splits each message
    # over the tensor-parallel ranks (engine.py, is_pipe_partitioned)
    "megatron-deepspeed-2022": dict(zero_stages=(0, 1), sequence_parallel=(False,), tp_overlap=(False,), max_cp=1,
                                    recompute=(None, "full"), virtual_stages=(1,)),
    # Megatron-LM in 2022 (arXiv 2205.05198): sequence parallelism and selective recomputation, interleaving; no
    # distributed optimizer, context parallelism or TP overlap yet
    "megatron-2022": dict(zero_stages=(0,), tp_overlap=(False,), max_cp=1),
    # Composer's FSDP (MosaicML): data parallelism only, with FSDP's sharding strategies NO_SHARD, SHARD_GRAD_OP,
    # FULL_SHARD (ZeRO 0, 2, 3) and activation checkpointing on or off; micro-batches up to the tables' 128
    "composer-fsdp": dict(tp=1, pp=1, cp=1, zero_stages=(0, 2, 3), recompute=(None, "full"), sequence_parallel=(False,),
                          tp_overlap=(False,), max_micro_batch=128),
    # Megatron-Core / NeMo in 2024: the distributed optimizer (ZeRO-1), no ZeRO-2 or -3
    "megatron-core-2024": dict(zero_stages=(0, 1)),
    # Llama 3's 4D parallelism (arXiv 2407.21783, Sec. 3.3.2) describes no overlap of TP communication, and its
    # data parallelism is FSDP, whose sharding strategies are ZeRO-3, ZeRO-2 or none (torch.distributed.fsdp.
    # ShardingStrategy: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and their hybrids), inside its pipeline too (Sec. 3.3.2):
    # no optimizer-only ZeRO-1; its context
    # parallelism all-gathers K and V ("the all-gather communication latency is exposed in the critical path")
    "llama3": dict(tp_overlap=(False,), zero_stages=(0, 2, 3), zero_in_pipeline=(0, 2, 3), cp_methods=("allgather",)),
}
# the same in January 2021, before the interleaved schedule and the scatter/gather of pipeline messages: both
# reached the repository's main branch on 2021-02-16/17 (commits 72e4230 "Turn scatter-gather optimization on
# by default" and 76e3fca "Merge branch 'better_schedule'"), after the GPT-3 175B note of 2021-01-11 (152aab3)
SOFTWARE["megatron-2021-01"] = {**SOFTWARE["megatron-2021"], "virtual_stages": (1,)}
A100 = dict(gpu="a100")
H100 = dict(gpu="h100")
CHOOSE = dict(micro_batch=(1, 2, 4, 8), virtual_stages=None, recompute=(None, "selective", "full"))


def _megatron_table_1() -> list[PublishedRun]:
    runs = []
    for size, heads, h, layers, t, p, n, batch, tflops, b, v, ddp in MEGATRON_TABLE_1:
        spec = ModelSpec(layers, h, heads, 51200, 2048, tied_embeddings=True, name=f"gpt-{size:g}b")
        layout = Layout(dp=n // (t * p), tp=t, pp=p, micro_batch=b, recompute="full", virtual_stages=v)
        runs.append(PublishedRun(
            f"Megatron-LM GPT {size:g}B", spec, Cluster.of(n, **A100), layout, batch, "mixed_adam_fp32_main_grads",
            f"{tflops} TFLOP/s per GPU", megatron_flops(batch, 2048, layers, h, 51200) / (n * tflops * 1e12),
            "arXiv 2104.04473, Table 1; examples/sc21/run_table_1.sh", overlap=ddp == "torch", attention="unfused",
            overlap_with_pipeline=False, async_tp_backward=False,
            search=SOFTWARE["megatron-2021"]))
    return runs


def _megatron_core_h100() -> list[PublishedRun]:
    runs = []
    for size, heads, h, layers, t, p, n, batch, tflops in MEGATRON_CORE_H100:
        spec = ModelSpec(layers, h, heads, 131072, 4096, name=f"gpt-{size:g}b, V 131k")
        layout = Layout(dp=48, tp=t, pp=p, zero=1, sequence_parallel=t > 1, tp_overlap=t > 1)
        runs.append(PublishedRun(
            f"Megatron-Core GPT {size:g}B", spec, Cluster.of(n, **H100), layout, batch, "mixed_adam_fp32_grads",
            f"{tflops} TFLOP/s per GPU", megatron_core_flops(spec, batch) / (n * tflops * 1e12),
            "NVIDIA/Megatron-LM README, images/model_table.png", free=CHOOSE, gpu="h100",
            search=SOFTWARE["megatron-core-2024"], attention="fused"))
    return runs


def megatron_2022_runs() -> list[PublishedRun]:
    """MEGATRON_2022 as runs, two per model in its order: full recomputation, then SP + selective."""
    runs = []
    for size, heads, h, layers, t, p, n, batch, full_s, selective_s in MEGATRON_2022:
        spec = ModelSpec(layers, h, heads, 51200, 2048, tied_embeddings=True, name=f"gpt-{size:g}b")
        for recompute, sp, seconds in (("full", False, full_s), ("selective", True, selective_s)):
            layout = Layout(dp=n // (t * p), tp=t, pp=p, recompute=recompute, sequence_parallel=sp)
            held = {} if sp else dict(recompute=("full",), sequence_parallel=(False,))  # the paper's baseline
            runs.append(PublishedRun(
                f"Megatron-LM 2022 GPT {size:g}B, {'SP + selective' if sp else 'full recompute'}", spec,
                Cluster.of(n, **A100), layout, batch, "mixed_adam_fp32_main_grads", f"{seconds} s per iteration",
                seconds, "arXiv 2205.05198, Tables 3 and 5", attention="unfused",
                free=dict(micro_batch=(1, 2, 4, 8), virtual_stages=None),
                assumed="" if sp else "the baseline is tensor parallelism as it was before the paper: no sequence "
                                      "parallelism", search={**SOFTWARE["megatron-2022"], **held}))
    return runs


def _mt_nlg(n_gpus: int, seconds: float, tflops: int) -> PublishedRun:
    spec = ModelSpec(105, 20480, 128, 51200, 2048, tied_embeddings=True, name="mt-nlg-530b")
    layout = Layout(dp=n_gpus // 280, tp=8, pp=35, recompute="full")
    return PublishedRun(f"MT-NLG 530B, {n_gpus:,} GPUs", spec, Cluster.of(n_gpus, **A100), layout, 1920, "mixed_adam",
                        f"{seconds} s ({tflops} TFLOP/s per GPU)", seconds,
                        "arXiv 2201.11990, Sec. 2.4 (as quoted in cli99/llm-analysis, examples/megatron-turing-nlg)",
                        overlap=False, attention="unfused", free=dict(micro_batch=(1, 2, 4)),
                        search=SOFTWARE["megatron-deepspeed-2022"], async_tp_backward=False,
                        assumed="DeepSpeed's pipeline engine reduces the gradients after the pipeline drains "
                                "(ReduceGrads, the schedule's last step); fp16 with fp32 master weights",
                        known_miss=MT_NLG_MISS)


def _gpt3_1024() -> PublishedRun:
    spec = ModelSpec(96, 12288, 96, 51200, 2048, tied_embeddings=True, name="gpt3-175b")
    layout = Layout(dp=8, tp=8, pp=16, micro_batch=1, recompute="full")
    return PublishedRun("GPT-3 175B, Megatron-LM", spec, Cluster.of(1024, **A100), layout, 1536,
                        "mixed_adam_fp32_main_grads", "138 TFLOP/s per GPU (~32 s)",
                        megatron_flops(1536, 2048, 96, 12288, 51200) / (1024 * 138e12),
                        "Megatron-LM README (Jan 2021); examples/pretrain_gpt3_175B.sh", overlap=False,
                        scatter_gather=False, overlap_with_pipeline=False, async_tp_backward=False, attention="unfused",
                        search=SOFTWARE["megatron-2021-01"],
                        assumed="Megatron's 'local' DDP of 2021: gradients reduced after the backward")


# DeepSpeed's BF16_Optimizer, as BLOOM ran it in a pipeline (DeepSpeed PR #1801, "bf16+pipeline parallelism",
# 2022-04-19: deepspeed/runtime/bf16_optimizer.py keeps a full fp32 gradient buffer, fp32_groups_gradients_flat =
# zeros_like(bf16 weights, fp32); pipe/engine.py accumulates each micro-batch's bf16 gradients into it with
# update_hp_grads(clear_lp_grads=False), so the bf16 ones stay until the next backward clears them, and that
# pass over every gradient runs once per micro-batch, outside the backward's products)
DEEPSPEED_BF16_OPTIMIZER = Recipe(
    2, 6, 12, copies="bf16 weights (2); bf16 gradients, kept between micro-batches (2), and their fp32 "
                     "accumulation (4); fp32 master weights, m and v (12), partitioned over data parallelism",
    source="DeepSpeed deepspeed/runtime/bf16_optimizer.py and runtime/pipe/engine.py (PR #1801, 2022)",
    accumulate=2 + 4 + 4 + 4 + 4)  # after every backward, update_hp_grads: hp.add_(lp.grad.to(fp32)) per parameter:
# the bf16 gradient read, its fp32 copy written and read, the fp32 sum read and written


def _bloom() -> PublishedRun:
    cluster = Cluster.of(384, **A100, inter_bw_gbps=4 * 100 / 8 / 8)  # 4 x 100 Gb/s per node of 8 GPUs
    layout = Layout(dp=8, tp=4, pp=12, zero=1, micro_batch=2, recompute="full")
    return PublishedRun("BLOOM-176B", ModelSpec.preset("bloom-176b"), cluster, layout, 2048, DEEPSPEED_BF16_OPTIMIZER,
                        "105.22 s per iteration", 105.22,
                        "arXiv 2211.05100, Sec. 3.4; bigscience train/tr11-176B-ml (slurm script, chronicles)",
                        overlap=False, attention="unfused", search=SOFTWARE["megatron-deepspeed-2022"],
                        async_tp_backward=False,
                        assumed="Megatron-DeepSpeed's BF16 optimizer reduces the gradients after the backward")


# BLOOM's layout search, timed side by side on its own 48 nodes before training (bigscience
# train/tr11-176B-ml/chronicles-prequel.md, "Rebalancing layers", 2022-02-28: the final shape, 70 layers of h 14336,
# the BF16 optimizer, the embedding partitioned as a layer): (dp, tp, pp, micro-batch, heads, seconds per iteration,
# memory in GB as the chronicle reports it). Each time is the second iteration's ("the data isn't exact and can
# fluctuate a bit", the chronicle); BLOOM trained with the third row's layout.
BLOOM_LAYOUT_SEARCH = (
    (4, 8, 12, 2, 64, 121.63, 40), (8, 4, 12, 2, 64, 102.03, 59), (8, 4, 12, 2, 112, 104.50, 59),
    (8, 4, 12, 2, 128, 105.89, 60), (8, 4, 12, 4, 64, 102.27, 73),
)


def bloom_layout_search() -> list[tuple[PublishedRun, float]]:
    """BLOOM's layouts measured side by side (BLOOM_LAYOUT_SEARCH): (run, measured GB) each. Used for nothing but
    the comparison of what the planner predicts between them with what was measured (validate.side_by_side)."""
    bloom, runs = _bloom(), []
    for d, t, p, b, heads, seconds, gigabytes in BLOOM_LAYOUT_SEARCH:
        spec = replace(bloom.spec, n_head=heads, name=f"bloom-176b, {heads} heads")
        layout = replace(bloom.layout, dp=d, tp=t, pp=p, micro_batch=b)
        runs.append((replace(bloom, name=f"BLOOM {heads} heads, {layout}", spec=spec, layout=layout,
                             published=f"{seconds} s per iteration", step_s=seconds,
                             source="bigscience train/tr11-176B-ml/chronicles-prequel.md (2022-02-28)"), gigabytes))
    return runs


# Megatron-LM's own sweeps of one model over layouts of 64 A100 of Selene (arXiv 2104.04473, Sec. 5.4, Figures
# 13-15; the layouts of examples/sc21/run_figure_13.sh, _14.sh and _15.sh: micro-batch 1, full recomputation, the
# local DDP, fp16, no interleaving). The figures are plots: what is held is the order the paper's text gives
# (its words, quoted).
# (figure, layers, hidden, heads, batches, the layouts as (dp, tp, pp), what the text says of their order,
# "peak" at the layout of that index or "falling" along them)
MEGATRON_SWEEPS = (
    (13, 32, 20480, 128, (32, 128), tuple((1, 64 // p, p) for p in (2, 4, 8, 16, 32)), ("peak", 2),
     "peak performance when the tensor-parallel size is equal to the number of GPUs in a single node"),
    (14, 32, 3840, 32, (32, 512), tuple((64 // p, 1, p) for p in (2, 4, 8, 16, 32)), ("falling", None),
     "for each batch size, the throughput decreases as the pipeline-parallel size increases"),
    (15, 32, 3840, 32, (32, 128, 512), tuple((64 // t, t, 1) for t in (2, 4, 8, 16, 32)), ("falling", None),
     "as the tensor-model-parallel size increases, we perform smaller matrix multiplications on every GPU, "
     "decreasing utilization on each GPU"),
)


def megatron_sweeps() -> list[tuple[int, int, str, tuple, str, list[PublishedRun]]]:
    """MEGATRON_SWEEPS as runs: (figure, batch, the order claimed, its index, the paper's words, the runs) per
    figure and batch. Used for nothing but holding the planner's order to the measured one (validate.sweeps)."""
    out = []
    for figure, layers, h, heads, batches, layouts, (order, index), words in MEGATRON_SWEEPS:
        spec = ModelSpec(layers, h, heads, 51200, 2048, tied_embeddings=True, name=f"gpt, {layers} x {h}")
        for batch in batches:
            runs = [PublishedRun(f"Figure {figure}, batch {batch}, dp{d} tp{t} pp{p}", spec, Cluster.of(64, **A100),
                                 Layout(dp=d, tp=t, pp=p, micro_batch=1, recompute="full"), batch,
                                 "mixed_adam_fp32_main_grads", f"Figure {figure}", None,
                                 f"arXiv 2104.04473, Figure {figure}; examples/sc21/run_figure_{figure}.sh",
                                 overlap=False, attention="unfused", overlap_with_pipeline=False,
                                 async_tp_backward=False)
                    for d, t, p in layouts]
            out.append((figure, batch, order, index, words, runs))
    return out


def _llama3(n_gpus: int, cp: int, mfu: float) -> PublishedRun:
    seq = 131072 if cp > 1 else 8192
    spec = replace(ModelSpec.preset("llama3-405b"), seq_len=seq, name=f"llama3-405b, {seq // 1024}k context")
    dp = n_gpus // (8 * cp * 16)
    batch = dp * (16 if n_gpus > 8192 else 32)  # Table 4's batch size per DP rank
    layout = Layout(dp=dp, tp=8, pp=16, cp=cp, zero=2, sequence_parallel=True, virtual_stages=8,
                    cp_method="allgather" if cp > 1 else "ring")
    model_flops = (6 * spec.matmul_params() + 12 * spec.n_layer * seq * spec.hidden) * batch * seq
    # At 131k tokens the attention term 12 L s h is 1.3 x 6 Psi: whether the MFU counts it whole or causal (half)
    # changes the step time it implies 1.4 x, and the paper does not say: no step time is derived there.
    step = model_flops / (mfu * n_gpus * 989e12) if cp == 1 else None
    return PublishedRun(
        f"Llama 3 405B, {n_gpus:,} GPUs, cp {cp}", spec, Cluster.of(n_gpus, **H100), layout, batch, "mixed_adam",
        f"BF16 MFU {mfu:.0%}" + ("" if step else " (memory only)"), step, "arXiv 2407.21783, Table 4 and Sec. 3.3",
        search=SOFTWARE["llama3"], gpu="h100", async_tp_backward=False,
        assumed="micro-batch 1; v = 8, one layer per chunk (Sec. 3.3.2: the first chunk of the first stage holds "
                "only the embedding); sequence parallel, no TP overlap; FSDP sharding optimizer states and gradients "
                "as ZeRO-2 with 16-bit gradients; MFU read as 6 Psi + 12 L s h per token")


def _nemotron4() -> PublishedRun:
    layout = Layout(dp=96, tp=8, pp=8, zero=1, micro_batch=1, recompute="selective", sequence_parallel=True,
                    virtual_stages=12, tp_overlap=True)
    return PublishedRun("Nemotron-4 340B", ModelSpec.preset("nemotron4-340b"), Cluster.of(6144, **H100), layout, 2304,
                        "mixed_adam_fp32_main_grads", "8.0 s per iteration", 8.0,
                        "arXiv 2406.11704, Table 2; NeMo-Framework-Launcher conf/training/nemotron/nemotron_340b.yaml",
                        gpu="h100", search=SOFTWARE["megatron-core-2024"], attention="fused")


def _nemo_24_07() -> list[PublishedRun]:
    runs = []
    for name, n, batch, b, s, t, p, cp, v in NEMO_24_07:
        spec = ModelSpec.preset(name, seq_len=s)
        layout = Layout(dp=n // (t * p * cp), tp=t, pp=p, cp=cp, zero=1, micro_batch=b, virtual_stages=v,
                        sequence_parallel=t > 1)
        runs.append(PublishedRun(f"NeMo 24.07 {name}, {n} GPUs", spec, Cluster.of(n, **H100), layout, batch,
                                 "mixed_adam_fp32_main_grads", "FP8 (memory only)", None,
                                 "NVIDIA/NeMo docs/source/performance/performance_summary.md (24.07)",
                                 free=dict(recompute=(None, "selective", "full")), gpu="h100",
                                 search=SOFTWARE["megatron-core-2024"], attention="fused"))
    return runs


def training_runs() -> list[PublishedRun]:
    """The runs the free constants are fitted on."""
    return _megatron_table_1() + _megatron_core_h100()


def held_out_runs() -> list[PublishedRun]:
    """The runs never used for fitting: step time and memory, then memory only."""
    llama3 = [_llama3(*row) for row in ((8192, 1, 0.43), (16384, 1, 0.41), (16384, 16, 0.38))]
    return ([_gpt3_1024(), _bloom()] + [_mt_nlg(*row) for row in MT_NLG] + megatron_2022_runs() + llama3
            + [_nemotron4()] + _nemo_24_07())
