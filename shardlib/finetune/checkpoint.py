"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically, and export.

Each rank writes only its own shards, with no gather to one rank: under FULL_SHARD in fp32,
12 Psi/N bytes per rank (parameters 4 and Adam's two moments 8 bytes per parameter; gradients
are not saved), 12 Psi in all; under DDP every rank holds everything, and DCP writes each
replicated tensor once, spreading the writes over the ranks. DCP stores every tensor with
its global shape and offsets, so a checkpoint written by N ranks loads on M ranks, under
another strategy, or on one process (https://docs.pytorch.org/docs/stable/distributed.checkpoint.html).

Layout of a checkpoint directory:

    run/checkpoints/step_000040/        committed (renamed into place once complete)
        __0_0.distcp, __1_0.distcp      one shard file per rank
        .metadata                       DCP's index of tensors
        shardlib.json                   step, model fingerprint, labels, world size
    run/checkpoints/step_000060.tmp/    being written, or left by a crash: never loaded

A rank killed while saving leaves only a `.tmp` directory, so the last committed
checkpoint is always complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

FORMAT = "shardlib-finetune-checkpoint/1"
META_FILE = "shardlib.json"


class CheckpointError(ValueError):
    """A checkpoint that does not exist, is incomplete, or belongs to another model."""


def model_fingerprint(model: torch.nn.Module, config, model_id: str, label_names: list[str]) -> dict:
    """What a checkpoint must match: architecture, labels and every parameter's global shape."""
    shapes = [f"{name}:{tuple(p.shape)}" for name, p in get_model_state_dict(model).items()]
    digest = hashlib.sha256("\n".join(sorted(shapes)).encode()).hexdigest()[:16]
    return {"model_id": str(model_id), "model_type": getattr(config, "model_type", type(model).__name__),
            "labels": list(label_names), "n_tensors": len(shapes), "shapes_sha256": digest}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step_{step:06d}"


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The committed checkpoint with the highest step, or None (.tmp directories are skipped)."""
    found = [p for p in Path(checkpoint_dir).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
             and (p / META_FILE).is_file()]
    return max(found, key=lambda p: int(p.name.split("_")[1])) if found else None


def prune_checkpoints(checkpoint_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` committed checkpoints (keep < 1 keeps all)."""
    committed = sorted((p for p in Path(checkpoint_dir).glob("step_*") if not p.name.endswith(".tmp")),
                       key=lambda p: int(p.name.split("_")[1]))
    for old in committed[:-keep] if keep >= 1 else []:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(checkpoint_dir, step: int, model, optimizer, fingerprint: dict, extra: dict,
                    fault=None) -> Path:
    """Every rank calls this. Writes to step_XXXXXX.tmp, then rank 0 renames it into place."""
    final = step_dir(checkpoint_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by an earlier crash
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fault is not None:  # fault injection for tests: a rank dying mid-save
        fault()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))  # returns once all ranks wrote
    if _rank() == 0:
        meta = {"format": FORMAT, "step": step, "fingerprint": fingerprint, **extra}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # the commit: atomic on one file system
    _barrier()
    return final


def read_metadata(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint: {META_FILE} is missing "
                              "(a .tmp directory is one a crash interrupted; use the previous step)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint}: unknown checkpoint format {meta.get('format')!r}")
    return meta


def check_compatible(meta: dict, fingerprint: dict, checkpoint) -> None:
    """A clear error when a checkpoint was written for another model or label set."""
    theirs = meta["fingerprint"]
    differences = [f"{key}: checkpoint has {theirs.get(key)!r}, this run has {fingerprint[key]!r}"
                   for key in ("model_type", "labels", "n_tensors", "shapes_sha256") if theirs.get(key) != fingerprint[key]]
    if differences:
        raise CheckpointError(f"{checkpoint} was written for model {theirs.get('model_id')!r}, not for this run's "
                              f"model {fingerprint['model_id']!r}; " + "; ".join(differences)
                              + ". Start a new run directory, or resume with the model it was written for.")


def load_checkpoint(checkpoint, model, optimizer, fingerprint: dict) -> dict:
    """Every rank calls this; loads (and reshards) the checkpoint into model and optimizer."""
    meta = read_metadata(checkpoint)
    check_compatible(meta, fingerprint, checkpoint)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(checkpoint))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta


def export_pretrained(model, config, tokenizer, export_dir) -> Path | None:
    """Every rank calls this: gather the full weights to rank 0 (on CPU), which writes a
    Hugging Face model directory (save_pretrained) atomically. Returns the path on rank 0."""
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    export_dir = Path(export_dir)
    if _rank() == 0:
        from transformers import AutoModelForSequenceClassification

        # save_pretrained imports DeepSpeed where it is installed (accelerate's unwrap), which logs
        # "Setting accelerator to CPU" on a machine without GPUs: true, and nothing to act on here
        logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to" not in record.getMessage())
        plain = AutoModelForSequenceClassification.from_config(config)
        plain.load_state_dict(full_sd, strict=True)
        tmp = export_dir.with_name(export_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(export_dir, ignore_errors=True)
        tmp.rename(export_dir)
    _barrier()
    return export_dir if _rank() == 0 else None
