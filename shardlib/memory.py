"""Memory of training and inference: the formulas of the course, and tools that measure the real thing.

Notation: Psi parameters, N data-parallel ranks, s sequence length, b micro-batch size,
h hidden size, a attention heads. Bytes, not GiB, unless a name says otherwise.

Inference (weights only, no KV cache):   bytes = Psi * bytes_per_element(dtype)
    fp32 4, bf16/fp16 2, int8/fp8 1, int4 0.5.

Training with Adam, "model states" = parameters + gradients + optimizer state, per parameter:
    fp32_adam              4 + 4 + 8      = 16   (m, v in fp32)
    mixed_adam             2 + 2 + 12     = 16   (fp16/bf16 params and grads; fp32 master, m, v)
                                                 ZeRO, arXiv 1910.02054, Section 3.1 (K = 12)
    mixed_adam_fp32_grads  2 + 4 + 12     = 18   (gradients accumulated in fp32)
                                                 Megatron Core distributed optimizer docs;
                                                 Hugging Face "Model training anatomy" (6 + 4 + 8)
    mixed_adam_fp32_main_grads 2 + 2 + 16 = 20  (16-bit grads, fp32 main grads beside master, m, v)
                                                 Megatron Core distributed optimizer: 4 + 16/d sharded
    bf16_master_adam       2 + 2 + 6      = 10   (bf16 master weights, grads and Adam moments)
                                                 DeepSpeedExamples training/bf16_master_weight
    Each source counts different copies of the same parameter: that is why 10, 16 and 18
    all appear in print (see TRAINING_RECIPES for the exact sources).

ZeRO data parallelism, model states per rank (ZeRO paper, Figure 1, K = 12):
    stage 0 (DDP)  (2 + 2 + K) Psi         = 16 Psi
    stage 1        2 Psi + 2 Psi + K Psi/N = 4 Psi + 12 Psi / N      optimizer state sharded
    stage 2        2 Psi + (2 + K) Psi/N   = 2 Psi + 14 Psi / N      ... and gradients
    stage 3        (2 + 2 + K) Psi / N     = 16 Psi / N              ... and parameters
    Sharding a tensor of n elements pads it to ceil(n / N) * N elements.
Communication per rank and step, ring collectives (ZeRO paper, Section 7):
    stages 0, 1, 2: 2 (N-1)/N Psi elements (all-reduce = reduce-scatter + all-gather)
    stage 3:        3 (N-1)/N Psi elements (all-gather forward, all-gather backward, reduce-scatter)

Activations saved for backward, one transformer layer, 16-bit, no recomputation
(Korthikanti et al., arXiv 2205.05198, Sections 4.1, 4.2):
    s b h (34 + 5 a s / h)  bytes;  selective recomputation: 34 s b h;  full recomputation: 2 s b h;
    t-way tensor parallel s b h (10 + 24/t + 5 a s/(h t)), with sequence parallelism s b h/t (34 + 5 a s/h).
What the course GPT's block keeps, term by term against the paper's: course_gpt_activation_terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

# ---------------------------------------------------------------------------------
# bytes per element

DTYPE_BYTES: dict = {
    torch.float64: 8, "fp64": 8, "float64": 8,
    torch.float32: 4, "fp32": 4, "float32": 4,
    torch.bfloat16: 2, "bf16": 2, "bfloat16": 2,
    torch.float16: 2, "fp16": 2, "float16": 2,
    torch.float8_e4m3fn: 1, torch.float8_e5m2: 1, "fp8": 1,
    torch.int8: 1, torch.uint8: 1, "int8": 1,
    "int4": 0.5,
}


def dtype_bytes(dtype) -> float:
    """Bytes per element of a torch dtype or of a name such as "bf16" or "int4"."""
    try:
        return DTYPE_BYTES[dtype]
    except (KeyError, TypeError):
        names = sorted(k for k in DTYPE_BYTES if isinstance(k, str))
        raise ValueError(f"unknown dtype {dtype!r}: use a torch dtype or one of {names}") from None


def inference_bytes(n_params: float, dtype="bf16") -> float:
    """Bytes of the weights alone (no KV cache, no activations): Psi * bytes_per_element."""
    return n_params * dtype_bytes(dtype)


# ---------------------------------------------------------------------------------
# training recipes: bytes per parameter


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each model state, what they hold, and who quotes the total."""

    params: float
    grads: float
    optimizer: float
    copies: str
    source: str
    accumulate: float = 0.0  # bytes moved per parameter per micro-batch to add its gradient into a separate sum

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


TRAINING_RECIPES: dict[str, Recipe] = {
    "fp32_adam": Recipe(
        4, 4, 8,
        copies="fp32 weights (4), fp32 gradients (4), Adam m and v in fp32 (4 + 4)",
        source="Megatron Core distributed optimizer: 'fp32 parameters, fp32 gradients: 16' "
               "(https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html)",
    ),
    "mixed_adam": Recipe(
        2, 2, 12,
        copies="fp16/bf16 weights (2) and gradients (2); fp32 master weights, m and v (4 + 4 + 4)",
        source="ZeRO, arXiv 1910.02054, Section 3.1: 2 Psi + 2 Psi + K Psi with K = 12, 16 Psi in all",
    ),
    "mixed_adam_fp32_grads": Recipe(
        2, 4, 12,
        copies="bf16 weights (2); gradients kept in fp32 (4); fp32 master weights, m and v (12)",
        source="Megatron Core distributed optimizer: 'bf16 parameters, fp32 gradients: 18' "
               "(https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html); "
               "Hugging Face 'Model training anatomy': weights 6 (fp32 + half copy) + gradients 4 + Adam 8 "
               "(https://huggingface.co/docs/transformers/model_memory_anatomy); "
               "DeepSpeedExamples training/bf16_master_weight/README.md: baseline 18N",
    ),
    "mixed_adam_fp32_main_grads": Recipe(
        2, 2, 16,
        copies="fp16/bf16 weights (2) and gradients (2); fp32 master weights, m, v and main gradients (4 x 4), "
               "the 16 sharded by Megatron's distributed optimizer",
        source="Megatron Core distributed optimizer: 'fp16 parameters, fp16 gradients: 20', '4 + 16/d' with the "
               "distributed optimizer (https://github.com/NVIDIA/Megatron-LM/blob/main/docs/user-guide/features/"
               "dist_optimizer.md)",
    ),
    "bf16_master_adam": Recipe(
        2, 2, 6,
        copies="bf16 weights (2) and gradients (2); master weights, m and v all in bf16 (2 + 2 + 2)",
        source="DeepSpeedExamples training/bf16_master_weight/README.md, 'Memory Breakdown': "
               "bf16_master_weights_and_grads + bf16_optimizer_states = 10N "
               "(https://github.com/deepspeedai/DeepSpeedExamples/tree/master/training/bf16_master_weight)",
    ),
    "pure_bf16_adam": Recipe(
        2, 2, 4,
        copies="model cast to bf16, torch.optim.AdamW keeps m and v in the parameters' dtype; no master copy",
        source="a combination, not a quoted total: what `model.to(torch.bfloat16)` + torch.optim.AdamW "
               "allocates (measured in lesson 00)",
    ),
    "mixed_adam_8bit": Recipe(
        2, 2, 6,
        copies="bf16 weights (2) and gradients (2); fp32 master (4); m and v in 8 bits (1 + 1)",
        source="a combination, not a quoted total: 8-bit Adam states (Dettmers et al., arXiv 2110.02861; "
               "block scales ignored) with an fp32 master copy. Another way to reach 10.",
    ),
}


def get_recipe(recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in TRAINING_RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: use one of {sorted(TRAINING_RECIPES)} or a Recipe")
    return TRAINING_RECIPES[recipe]


def _states(params: float, grads: float, optimizer: float) -> dict:
    return dict(params=params, grads=grads, optimizer=optimizer, total=params + grads + optimizer)


def training_bytes(n_params: float, recipe="mixed_adam") -> dict:
    """Model states of one full replica: dict(params, grads, optimizer, total) in bytes."""
    r = get_recipe(recipe)
    return _states(r.params * n_params, r.grads * n_params, r.optimizer * n_params)


# ---------------------------------------------------------------------------------
# ZeRO


def padded_numel(numel: int, world_size: int) -> int:
    """Elements after padding so that N ranks get equal shards: ceil(numel / N) * N."""
    _check_world_size(world_size)
    return math.ceil(numel / world_size) * world_size


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def _check_stage(stage: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0 (plain DDP), 1, 2 or 3, got {stage!r}")


def zero_model_state_bytes(n_params: float, world_size: int, stage: int, recipe="mixed_adam",
                           padded: bool = False) -> dict:
    """Model states held by one rank under ZeRO stage 0..3: dict(params, grads, optimizer, total).

    Stage 1 shards the optimizer state over N ranks, stage 2 also the gradients, stage 3 also
    the parameters (ZeRO, arXiv 1910.02054, Figure 1). With `padded=True` a shard holds
    ceil(Psi / N) elements, as when one flat tensor of Psi elements is padded and split.
    """
    _check_world_size(world_size)
    _check_stage(stage)
    r = get_recipe(recipe)
    shard = padded_numel(n_params, world_size) // world_size if padded else n_params / world_size
    return _states(
        r.params * (shard if stage >= 3 else n_params),
        r.grads * (shard if stage >= 2 else n_params),
        r.optimizer * (shard if stage >= 1 else n_params),
    )


def zero_comm_elements(n_params: float, world_size: int, stage: int) -> float:
    """Elements each rank sends per step with ring collectives: 2(N-1)/N Psi, or 3(N-1)/N Psi at stage 3."""
    _check_world_size(world_size)
    _check_stage(stage)
    passes = 3 if stage == 3 else 2
    return passes * (world_size - 1) / world_size * n_params


def zero3_forward_peak_bytes(unit_numels: list[int], world_size: int, element_size: int, *, prefetch: bool,
                              staging_copies: int = 0, activation_bytes: int = 0) -> int:
    """Most bytes a ZeRO-3 forward holds on top of its shards: the gathered units, padded to N*c elements.

    One unit is whole while it computes; with prefetch the next one is gathered meanwhile, so two
    consecutive units are whole at once (FSDP, arXiv 2304.11277, Section 3.3). staging_copies:
    buffers of a unit's size the backend allocates while it gathers (gloo gathers into a staging
    buffer and copies out: 1; NCCL writes in place: 0). activation_bytes: what forward saves for backward.
    """
    full = [padded_numel(n, world_size) * element_size for n in unit_numels]  # (N*c,) each
    window = 2 if prefetch else 1
    gathered = max(sum(full[k:k + window]) for k in range(len(full)))
    return gathered + staging_copies * max(full) + activation_bytes


def offloaded_model_state_bytes(n_params: float, world_size: int, stage: int, recipe="mixed_adam") -> dict:
    """Model states of one rank with the optimizer offloaded to the CPU (ZeRO-Offload, arXiv 2101.06840):
    dict(device, host). The device keeps the parameters and gradients of `zero_model_state_bytes`; the
    host keeps the optimizer state (with mixed_adam the fp32 master, m and v: 12 Psi/N, or 12 Psi at
    stage 0). Per step the gradients go down and the parameters come back: see
    shardlib.parallel.offload.offload_bytes_per_step."""
    states = zero_model_state_bytes(n_params, world_size, stage, recipe)
    return dict(device=states["params"] + states["grads"], host=states["optimizer"])


# ---------------------------------------------------------------------------------
# activations


def activation_bytes_per_layer(seq_len: int, batch: int, hidden: int, heads: int, recompute=None, *,
                               tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one transformer layer keeps for backward on one GPU, 16-bit (Korthikanti et al.,
    arXiv 2205.05198, sections 4.1, 4.2 and 5, Table 2), t = tp:

    recompute=None         s b h (34 + 5 a s / h) = 34 sbh + 5 a s^2 b   (t = 1)
                           s b h (10 + 24 / t + 5 a s / (h t))          tensor parallel
                           s b h / t (34 + 5 a s / h)                   tensor + sequence parallel
    recompute="selective"  the same without the 5 a s^2 b term (attention core recomputed)
    recompute="full"       2 s b h, or 2 s b h / t under sequence parallelism (the layer input)
    The 34 counts 16-bit tensors (2 bytes) and dropout masks (1 byte) of a GPT-2 style layer; the 10
    of them outside the tensor-parallel regions are divided by t only with sequence parallelism.
    What the course GPT itself keeps, term by term: course_gpt_activation_terms.
    """
    if recompute not in (None, "selective", "full"):
        raise ValueError(f"recompute must be None, 'selective' or 'full', got {recompute!r}")
    _check_world_size(tp)
    s, b, h, a, t = seq_len, batch, hidden, heads, tp
    scores = 5 * a * s * s * b if recompute is None else 0
    if recompute == "full":
        return _exact(2 * s * b * h, t if sequence_parallel else 1)
    if sequence_parallel:
        return _exact(34 * s * b * h + scores, t)
    return 10 * s * b * h + _exact(24 * s * b * h + scores, t)


def _exact(bytes_: int, t: int):
    """bytes_ / t, an int when t divides it."""
    return bytes_ // t if bytes_ % t == 0 else bytes_ / t


def course_gpt_activation_terms(seq_len: int, batch: int, hidden: int, heads: int, recompute=None, *,
                                tp: int = 1, sequence_parallel: bool = False, keep_gathered_input: bool = False,
                                element_size: int = 2) -> list[dict]:
    """What one block of the course GPT (shardlib.models.Block, split by shardlib/parallel/tensor_gpt.py)
    keeps for backward on one rank, term by term beside the paper's (activation_bytes_per_layer):
    [{"term", "paper", "course"}] in bytes. Activations of `element_size` bytes (2: bf16/fp16), dropout 0,
    multi-head attention through scaled_dot_product_attention, recompute None or "selective", as PyTorch's
    CPU kernels keep them (on CUDA the LayerNorm statistics are fp32 and each attention kernel keeps its
    own bookkeeping: not modelled here).

    The paper's 34 s b h + 5 a s^2 b and the course GPT's differ in four named places: the course GPT has
    no dropout after attention and after the MLP (the paper's 2 s b h of masks); its fused attention keeps
    no s x s tensor (the paper's softmax output, dropout mask and dropout output, 5 a s^2 b) but a
    log-sum-exp per query and head, in fp32; and each LayerNorm keeps its mean and 1/std per token
    (in the activations' dtype), which the paper leaves out.
    """
    if recompute not in (None, "selective"):
        raise ValueError(f"recompute must be None or 'selective' for the course GPT's terms, got {recompute!r}")
    if keep_gathered_input and not sequence_parallel:
        raise ValueError("keep_gathered_input=True chooses what sequence parallelism keeps: use sequence_parallel=True")
    s, b, h, a, t, e = seq_len, batch, hidden, heads, tp, element_size
    sbh, selective = s * b * h, recompute == "selective"
    out = t if sequence_parallel else 1  # the tensors between the tensor-parallel regions
    column_input = 1 if keep_gathered_input else out  # what the column layers keep of their gathered input
    rows = [  # (term, paper 16-bit bytes, course bytes) before the split
        ("LayerNorm inputs (2)", 4 * sbh / out, 2 * e * sbh / out),
        ("q/k/v projection input (LayerNorm 1 output)", 2 * sbh / out, e * sbh / column_input),
        ("Q and K", 4 * sbh / t, 2 * e * sbh / t),
        ("V", 2 * sbh / t, e * sbh / t),
        ("softmax output", 0 if selective else 2 * a * s * s * b / t, 0),
        ("softmax dropout mask", 0 if selective else a * s * s * b / t, 0),
        ("softmax dropout output", 0 if selective else 2 * a * s * s * b / t, 0),
        ("output projection input", 2 * sbh / t, e * sbh / t),
        ("dropout mask after attention", sbh / out, 0),
        ("fc input (LayerNorm 2 output)", 2 * sbh / out, e * sbh / column_input),
        ("GeLU input", 8 * sbh / t, 4 * e * sbh / t),
        ("GeLU output (proj input)", 8 * sbh / t, 4 * e * sbh / t),
        ("dropout mask after the MLP", sbh / out, 0),
        ("LayerNorm mean and 1/std (2 x 2 per token)", 0, 4 * s * b * e / out),
        ("attention log-sum-exp (fp32, per query and head)", 0, 0 if selective else a * s * b * max(e, 4) / t),
    ]
    return [{"term": term, "paper": _whole(paper), "course": _whole(course)} for term, paper, course in rows]


def _whole(x: float):
    return int(x) if float(x).is_integer() else x


# ---------------------------------------------------------------------------------
# measuring real tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a tensor: a DTensor's local shard, any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage_key(t: torch.Tensor):
    s = _local(t).untyped_storage()  # a DTensor: its local shard
    where = s._cdata if t.is_meta else s.data_ptr()  # meta storages have no address: tell them apart by object
    return (t.device, where), s.nbytes()


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared weights counted once)."""
    seen = {}
    for t in tensors:
        key, nbytes = _storage_key(_local(t))
        seen[key] = nbytes
    return sum(seen.values())


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes of the real parameters, gradients and optimizer state on this rank.

    Returns dict(params, grads, optimizer, optimizer_scalars, total). Shared storages count once;
    DTensor (sharded) parameters count their local shard. `optimizer_scalars` is the part of
    `optimizer` held in one-element tensors, such as Adam's per-tensor `step` counter.
    """
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in (optimizer.state.values() if optimizer else []) for v in s.values()
             if isinstance(v, torch.Tensor)]
    scalars = [v for v in state if _local(v).numel() == 1]
    p, g, o = unique_storage_bytes(params), unique_storage_bytes(grads), unique_storage_bytes(state)
    return dict(params=p, grads=g, optimizer=o, optimizer_scalars=unique_storage_bytes(scalars),
                total=p + g + o)


def _is_parameter(t: torch.Tensor, param_keys: set) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter) or _storage_key(t)[0] in param_keys


def saved_activations(fn, *args, **kwargs) -> list[dict]:
    """Run fn(*args, **kwargs) and list the tensors autograd saved for backward, one per storage.

    Parameters (and views of them) are left out, as are the parameters of `fn` when it is a
    module. Each record: dict(shape, dtype, bytes), bytes being the whole storage kept alive.
    """
    param_keys = {_storage_key(p)[0] for p in fn.parameters()} if isinstance(fn, nn.Module) else set()
    kept, records = {}, []

    def pack(t):
        if not _is_parameter(t, param_keys):
            key, nbytes = _storage_key(t)
            if key not in kept:
                kept[key] = t  # holding it stops the allocator from reusing the address meanwhile
                records.append(dict(shape=tuple(t.shape), dtype=t.dtype, bytes=nbytes))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return records


def saved_activation_bytes(fn, *args, **kwargs) -> int:
    """Bytes of the distinct tensors autograd saves for backward while running fn (parameters excluded)."""
    return sum(r["bytes"] for r in saved_activations(fn, *args, **kwargs))


def peak_cuda_bytes(fn, *args, device=None, **kwargs) -> int:
    """CUDA only: torch.cuda.max_memory_allocated while fn runs, above what was allocated before.

    device: a CUDA device (default: this rank's, shardlib.current_device())."""
    from shardlib.launch import current_device

    device = torch.device(device) if device is not None else current_device()
    if device.type != "cuda":
        raise RuntimeError(f"peak_cuda_bytes measures a CUDA device, not {device}; on CPU use saved_activation_bytes")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
