"""What shardlib.plan is given: the model (shardlib/plan/model.py), the cluster, a layout.

A layout puts N = dp * cp * tp * pp GPUs to work, numbered tp fastest, then cp, then dp, then pp
(Megatron-LM's order tp-cp-ep-dp-pp): a tensor-parallel group is t neighbouring GPUs, a
context-parallel group spans t*c of them, an expert-parallel group (inside the data-parallel one)
t*c*ep, a data-parallel group t*c*d, a pipeline all N.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardlib.plan.attention import CUDNN_H100, FLASH2, LENGTHS
from shardlib.plan.fitted import ATTENTION_TRITON, FITTED
from shardlib.plan.model import PRESETS, ModelSpec, count_text, load_model  # noqa: F401  (re-exported)

GiB = 2**30
A100_MATMUL = 267.9  # TFLOP/s, the measured bf16 matmul maximum of an A100 SXM (shardlib/plan/gemm.py)
RECOMPUTE = (None, "selective", "full")
CP_METHODS = ("ring", "ulysses", "allgather")
CP_SUFFIX = dict(ring="", ulysses="u", allgather="g")  # how a layout's name shows its method


@dataclass(frozen=True)
class Cluster:
    """GPUs: n_nodes x gpus_per_node, memory in GiB (2**30 bytes; an "80 GB" A100 has 80 GiB),
    bandwidths in GB/s (1e9 bytes) per GPU and direction, bf16 dense peak in TFLOP/s.
    Defaults: a DGX A100 node. 312 TFLOP/s bf16, 2,039 GB/s of HBM, PCIe Gen4 64 GB/s both ways
    (A100 datasheet,
    https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf);
    NVLink 600 GB/s counting both directions, so 300 each way (HGX A100,
    https://developer.nvidia.com/blog/introducing-hgx-a100-most-powerful-accelerated-server-platform-for-ai-hpc/);
    between nodes one 200 Gb/s HDR InfiniBand link per GPU, 25 GB/s (DGX SuperPOD reference
    architecture, RA-09950-001). host_mem_bw_gbps: CPU memory bandwidth per GPU for an offloaded
    optimizer step: a DGX A100's two AMD EPYC 7742 have 8 DDR4-3200 channels each, 2 x 204.8 GB/s
    for 8 GPUs. matmul_tflops: the fastest bf16 matrix product measured on the GPU, n_sm its
    streaming multiprocessors (shardlib/plan/gemm.py; GPUS below; without a measurement, the A100's
    267.9 / 312 of peak_tflops), matmul_fraction the part of that rate a training job's products reach
    (fitted, shardlib/plan/fitted.py; the A100's by default), triton_attention the part of peak_tflops
    FlashAttention's Triton kernel reaches (fitted, the same file), flash_tflops and fused_tflops the benchmark
    speeds of FlashAttention-2 and of Transformer Engine's fused attention at attention.LENGTHS
    (shardlib/plan/attention.py: cuDNN's kernel on the H100, FlashAttention-2 elsewhere; without a benchmark, the
    A100's FlashAttention-2 times peak_tflops / 312). alpha_us: latency per step of a ring collective: an 8-byte
    all-reduce over 2 NVLink A100s takes 9.85 us for its 2 steps (https://github.com/NVIDIA/nccl-tests/issues/331)."""

    n_nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    intra_bw_gbps: float = 300.0
    inter_bw_gbps: float = 25.0
    peak_tflops: float = 312.0
    alpha_us: float = 5.0
    hbm_bw_gbps: float = 2039.0
    pcie_bw_gbps: float = 32.0
    host_mem_bw_gbps: float = 51.2
    matmul_tflops: float | None = None  # None: peak_tflops x 267.9 / 312, the A100's measured ratio
    n_sm: int = 108
    matmul_fraction: float = FITTED["a100"]
    triton_attention: float = ATTENTION_TRITON["a100"]  # of peak_tflops: FlashAttention's Triton kernel (fitted.py)
    flash_tflops: tuple | None = None  # FlashAttention-2's benchmark, TFLOP/s at attention.LENGTHS
    fused_tflops: tuple | None = None  # Transformer Engine's fused attention (None: flash_tflops)

    def __post_init__(self):
        if self.matmul_tflops is None:  # a GPU without a measurement: the A100's measured fraction of its peak
            object.__setattr__(self, "matmul_tflops", self.peak_tflops * A100_MATMUL / 312.0)
        if self.flash_tflops is None:  # nor a benchmark of its attention: the A100's, scaled by the peak
            object.__setattr__(self, "flash_tflops", tuple(x * self.peak_tflops / 312.0 for x in FLASH2["a100"]))
        if self.fused_tflops is None:  # Transformer Engine runs FlashAttention-2 off Hopper
            object.__setattr__(self, "fused_tflops", self.flash_tflops)
        for key, value in asdict(self).items():
            if key.endswith("_tflops") and isinstance(value, tuple):
                if len(value) != len(LENGTHS) or not all(isinstance(x, (int, float)) and x > 0 for x in value):
                    raise ValueError(f"Cluster.{key} must be {len(LENGTHS)} positive TFLOP/s, one per sequence "
                                     f"length of {LENGTHS}, got {value!r}")
                continue
            whole = key in ("n_nodes", "gpus_per_node", "n_sm")
            if not (isinstance(value, (int, float)) and value > 0) or (whole and not isinstance(value, int)):
                raise ValueError(f"Cluster.{key} must be a positive {'integer' if whole else 'number'}, got {value!r}")

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @classmethod
    def of(cls, n_gpus: int, gpus_per_node: int = 8, gpu: str | None = None, **kwargs) -> "Cluster":
        """n_gpus in nodes of gpus_per_node (fewer than that: one node holding them all); gpu: a name
        of GPUS ("a100", "h100") whose figures the keyword arguments may override."""
        if gpu is not None:
            if gpu not in GPUS:
                raise ValueError(f"unknown gpu {gpu!r}: use one of {sorted(GPUS)} or give the figures as keywords")
            kwargs = {**GPUS[gpu], **kwargs}
        if not isinstance(n_gpus, int) or n_gpus < 1:
            raise ValueError(f"the number of GPUs must be a positive integer, got {n_gpus!r}")
        if n_gpus <= gpus_per_node:
            return cls(1, n_gpus, **kwargs)
        if n_gpus % gpus_per_node:
            raise ValueError(f"{n_gpus} GPUs do not fill nodes of {gpus_per_node}: use a multiple of "
                             f"{gpus_per_node} or set gpus_per_node")
        return cls(n_gpus // gpus_per_node, gpus_per_node, **kwargs)


# Servers of 8 GPUs. A100 SXM 80GB: the defaults above; 108 SMs (A100 whitepaper). H100 SXM 80GB: 989 TFLOP/s
# dense bf16, 3,350 GB/s HBM3, NVLink 900 GB/s both ways, 132 SMs
# (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet); one 400 Gb/s ConnectX-7 per
# GPU between servers (https://www.nvidia.com/en-us/data-center/dgx-h100/); PCIe 5.0 x16, 64 GB/s each way.
# matmul_tflops: measured maxima of bf16 products (ml-engineering's table, shardlib/plan/gemm.py).
GPUS = {
    "a100": dict(gpu_mem_gib=80.0, peak_tflops=312.0, matmul_tflops=A100_MATMUL, n_sm=108, hbm_bw_gbps=2039.0,
                 intra_bw_gbps=300.0, inter_bw_gbps=25.0, pcie_bw_gbps=32.0, matmul_fraction=FITTED["a100"]),
    "h100": dict(gpu_mem_gib=80.0, peak_tflops=989.0, matmul_tflops=792.1, n_sm=132, hbm_bw_gbps=3350.0,
                 intra_bw_gbps=450.0, inter_bw_gbps=50.0, pcie_bw_gbps=64.0, matmul_fraction=FITTED["h100"],
                 triton_attention=ATTENTION_TRITON["h100"], flash_tflops=FLASH2["h100"], fused_tflops=CUDNN_H100),
}


@dataclass(frozen=True)
class Layout:
    """One way to run the job. micro_batch: sequences per forward on one GPU.

    cp: context-parallel size (each rank keeps s/cp of every sequence), by ring attention
    (arXiv 2310.01889), Ulysses all-to-alls (arXiv 2309.14509) or an all-gather of K, V (Llama 3, arXiv
    2407.21783, Sec. 3.3.2: cp_method "allgather", its transfers on the critical path); ep: expert-parallel size, inside
    the data-parallel group (each rank keeps E/ep experts; GShard, arXiv 2006.16668);
    virtual_stages: v chunks of layers per pipeline rank, the interleaved 1F1B schedule
    (arXiv 2104.04473); offload: optimizer states and step on the CPU (ZeRO-Offload, arXiv 2101.06840);
    tp_overlap: the tensor-parallel all-gathers and reduce-scatters of sequence parallelism split into
    chunks and overlapped with the matrix products they feed, as Megatron-Core's --tp-comm-overlap does
    with Transformer Engine's userbuffers (needs sequence_parallel).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str | None = None  # None, "selective" or "full"
    sequence_parallel: bool = False
    cp: int = 1
    cp_method: str = "ring"  # "ring", "ulysses" or "allgather"
    ep: int = 1
    virtual_stages: int = 1
    offload: bool = False
    tp_overlap: bool = False

    @property
    def n_gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def caveats(self) -> list[str]:
        """What a framework refuses about this layout that the planner still costs (marked * in its table)."""
        notes = []
        if self.zero >= 2 and self.pp > 1:
            notes.append(f"ZeRO-{self.zero} inside a pipeline: DeepSpeed refuses it (\"ZeRO-2 and ZeRO-3 are "
                         "incompatible with pipeline parallelism\", deepspeed/runtime/pipe/engine.py) because its "
                         "collectives then run once per micro-batch, tens to hundreds of times a step "
                         "(https://github.com/deepspeedai/DeepSpeed/issues/4164); costed here that way")
        return notes

    def __str__(self) -> str:
        sp = ("+sp" if self.sequence_parallel else "") + ("+overlap" if self.tp_overlap else "")
        cp = f" cp{self.cp}{CP_SUFFIX[self.cp_method]}" if self.cp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        v = f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        offload = " offload" if self.offload else ""
        return (f"dp{self.dp} tp{self.tp}{sp}{cp} pp{self.pp}{v}{ep} zero{self.zero} "
                f"b{self.micro_batch} {self.recompute or 'no'}-recompute{offload}")
