"""What a fine-tuning run is asked to do (FinetuneConfig), checked before any process starts,
and the mixed precision a device gets.

Mixed precision on GPUs (the model states stay fp32 shards; compute and gathers are 16-bit):
bf16 where the GPU computes it natively, compute capability 8.0 (Ampere) and newer; fp16 with
gradient scaling where it does not (T4 sm_75, V100 sm_70), because fp16's 5-bit exponent
underflows small gradients unless the loss is scaled up first (Micikevicius et al., *Mixed
Precision Training*, arXiv 1710.03740, section 3.2). The capability is read through NVML
(shardlib.devices) in the process that launches, so that process never starts CUDA.
Configuration only: no tensors, no communication (a run's costs: shardlib/finetune/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlib.finetune.data import default_data_dir
from shardlib.finetune.model import DEFAULT_MODEL_ID, check_strategy

ZERO_STAGE = {"DDP": 0, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3, "HYBRID_SHARD": 3}
MIXED_PRECISION = ("auto", "no", "bf16", "fp16")
PROGRESS = ("bar", "final", "none")  # a live tqdm bar, one line with the final bar at the end, nothing


@dataclass
class FinetuneConfig:
    """One fine-tuning run; every field is also a command-line flag (python -m shardlib.finetune --help)."""

    model_id: str = DEFAULT_MODEL_ID
    data_dir: str = ""  # "": the topic data set shipped in the package (shardlib/data/topics)
    output_dir: str = "runs/finetune"
    strategy: str | None = "FULL_SHARD"  # None: the one an accelerate config chose (else FULL_SHARD)
    max_length: int = 32
    batch_size: int = 16  # global: examples per optimizer step, over all ranks and micro-batches
    grad_accum: int = 1  # micro-batches per optimizer step on each rank
    epochs: int = 1
    max_steps: int | None = None  # caps the schedule (default: epochs * steps per epoch)
    lr: float = 1e-4
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    seed: int = 0
    dropout: float | None = None  # override the model's dropout (0: identical steps on any N)
    eval_batch_size: int = 64
    max_eval_examples: int | None = None  # evaluate on the first k of each split (quick runs)
    evaluate: bool = True
    checkpoint_every: int = 0  # steps; 0: no periodic checkpoints
    stop_after: int | None = None  # save a checkpoint and stop at this step (resume later)
    stop_file: str | None = None  # when this file appears, save a checkpoint at the end of the step and stop
    resume: bool | str = False  # True: latest checkpoint in output_dir; "auto": that if any; or a path
    keep_checkpoints: int = 2  # committed checkpoints kept (older ones are deleted)
    export: bool = False  # write output_dir/model with save_pretrained at the end
    device: str = "auto"  # auto | cpu | cuda
    mixed_precision: str = "auto"  # auto (GPU: bf16 where native, else fp16; CPU: no) | no | bf16 | fp16
    activation_checkpointing: bool | None = None  # None: on GPU only
    replicate_size: int | None = None  # HYBRID_SHARD replicas (default: number of nodes)
    layer_cls_to_wrap: str | None = None  # default: the model's _no_split_modules
    offline: bool = True
    progress: str = "bar"  # bar | final | none (True and False mean bar and none)
    measure_memory: bool | int = False  # model-state bytes after forward, backward, step: True at the run's
    # second step, k at step k (fp16's gradient scaler may skip the first steps, and Adam's state with them)

    def __post_init__(self):
        if self.strategy is not None:
            self.strategy = check_strategy(self.strategy)
        self.data_dir = str(self.data_dir or default_data_dir())
        for name in ("max_length", "batch_size", "grad_accum", "epochs", "eval_batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, got {self.mixed_precision!r}")
        if isinstance(self.progress, bool):
            self.progress = "bar" if self.progress else "none"
        if self.progress not in PROGRESS:
            raise ValueError(f"progress must be one of {', '.join(PROGRESS)} (or True / False), got {self.progress!r}")

    def check_world_size(self, world_size: int) -> None:
        """Errors a launch would hit, raised before it starts."""
        per_step = world_size * self.grad_accum
        if self.batch_size % per_step:
            raise ValueError(f"batch_size {self.batch_size} must divide evenly over {world_size} ranks x "
                             f"{self.grad_accum} micro-batches; use a multiple of {per_step}")
        if self.strategy == "HYBRID_SHARD":
            replicas = self.replicate_size or 1
            if replicas < 2 or world_size % replicas or world_size == replicas:
                raise ValueError(f"HYBRID_SHARD needs replicate_size R with 1 < R < N and R dividing N={world_size} "
                                 f"(got {self.replicate_size}); e.g. replicate_size=2 on 4 ranks, or one per node")


def resolve_mixed_precision(asked: str, device_type: str, capability: tuple[int, int] | None = None,
                            gpu_name: str = "this GPU") -> str:
    """"no", "bf16" or "fp16" for a device; `capability` is the GPU's (major, minor) compute capability.

    A 16-bit format the device cannot use well is an error that names the one to use instead."""
    if device_type == "cpu":
        if asked == "fp16":
            raise ValueError("mixed_precision='fp16' needs a GPU (it trains with gradient scaling on CUDA); "
                             "on CPU use 'no' (fp32) or 'bf16'")
        return "no" if asked == "auto" else asked
    native_bf16 = capability is not None and tuple(capability) >= (8, 0)
    sm = f"sm_{capability[0]}{capability[1]}" if capability else "compute capability unknown"
    if asked == "auto":
        return "bf16" if native_bf16 else "fp16"
    if asked == "bf16" and not native_bf16:
        raise ValueError(f"mixed_precision='bf16' asked for, but {gpu_name} ({sm}) has no native bf16 (that needs "
                         "compute capability 8.0, Ampere or newer); use mixed_precision='fp16' (with gradient "
                         "scaling), 'auto' (which picks fp16 there) or 'no'")
    return asked
