"""Fine-tune a Hugging Face classifier with Accelerate + FSDP2 on N ranks, with sharded checkpoints.

One function, `train(config)`, runs on every rank however the ranks were started:

    notebook / script   accelerate.notebook_launcher(train, (config,), num_processes=N)
                        or shardlib.launch(train, N, args=(config,))  (returns each rank's result)
    GPUs, one node      accelerate launch --config_file shardlib/configs/accelerate/fsdp2_1node_4gpu.yaml \
                            -m shardlib.finetune --epochs 3
    anywhere            torchrun --nproc-per-node N -m shardlib.finetune --strategy FULL_SHARD

Per-rank model states (Psi parameters, N ranks, S ranks per shard group; mixed-precision
Adam, ZeRO arXiv 1910.02054): DDP 16 Psi, SHARD_GRAD_OP 2 Psi + 14 Psi/N, FULL_SHARD
16 Psi/N, HYBRID_SHARD 16 Psi/S. Bytes sent per rank and step: 2 Psi (DDP,
SHARD_GRAD_OP), 3 Psi (FULL_SHARD). See shardlib.finetune.model for how each maps to FSDP2.

On GPUs the FSDP strategies go through Accelerate's FSDP2 plugin (bf16 mixed precision,
activation checkpointing). On CPU Accelerate applies no FSDP plugin (its multi-CPU mode
wraps the model in DDP), so there `train` applies PyTorch's fully_shard itself with the
same per-block wrapping, and checks that each rank holds 1/N of every parameter.

The data order is a function of (seed, step) and dropout masks of (seed, step, rank), so
a run stopped after k steps and resumed from its checkpoint computes the same losses as
the uninterrupted run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlib.finetune.checkpoint import (
    CheckpointError,
    export_pretrained,
    latest_checkpoint,
    load_checkpoint,
    model_fingerprint,
    prune_checkpoints,
    save_checkpoint,
    step_dir,
)
from shardlib.finetune.data import global_batch_indices, load_dataset, rank_slice, steps_per_epoch, tokenize
from shardlib.finetune.model import DEFAULT_MODEL_ID, STRATEGIES, check_strategy, load_classifier, resolve_model_path
from shardlib.finetune.rank import (
    all_reduce_sum,
    append_jsonl,
    evaluate,
    learning_rate,
    make_accelerator,
    memory_snapshot,
    prepare_model,
    resolve_strategy,
    set_cpu_threads,
    sync_gradients,
    typical,
)

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "data" / "topics"
ZERO_STAGE = {"DDP": 0, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3, "HYBRID_SHARD": 3}


@dataclass
class FinetuneConfig:
    model_id: str = DEFAULT_MODEL_ID
    data_dir: str = str(DEFAULT_DATA)
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
    resume: bool | str = False  # True: latest checkpoint in output_dir; "auto": that if any; or a path
    keep_checkpoints: int = 2  # committed checkpoints kept (older ones are deleted)
    export: bool = False  # write output_dir/model with save_pretrained at the end
    device: str = "auto"  # auto | cpu | cuda
    mixed_precision: str = "auto"  # auto (bf16 on GPU, none on CPU) | no | bf16
    activation_checkpointing: bool | None = None  # None: on GPU only
    replicate_size: int | None = None  # HYBRID_SHARD replicas (default: number of nodes)
    layer_cls_to_wrap: str | None = None  # default: the model's _no_split_modules
    offline: bool = True
    progress: bool = True
    measure_memory: bool = False  # model-state bytes at step 2: after forward, backward, step
    crash_at_step: int | None = None  # fault injection: SIGKILL crash_rank when this step begins
    crash_rank: int = 1
    crash_during_save: bool = False  # ... or while it writes the checkpoint of crash_at_step

    def __post_init__(self):
        if self.strategy is not None:
            self.strategy = check_strategy(self.strategy)
        for name in ("max_length", "batch_size", "grad_accum", "epochs", "eval_batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise ValueError(f"mixed_precision must be 'auto', 'no' or 'bf16', got {self.mixed_precision!r}")

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


# ---------------------------------------------------------------------------------
# the training function


def _find_checkpoint(resume, checkpoint_dir: Path) -> Path | None:
    if resume in (True, "auto"):
        found = latest_checkpoint(checkpoint_dir)
        if found is None and resume is True:
            raise CheckpointError(f"resume=True but {checkpoint_dir} holds no committed checkpoint")
        return found
    return Path(resume) if resume else None


def _step(step, model, optimizer, tokenizer, train_split, config, rank, world_size, device, measure) -> float:
    """One optimizer step on this rank's share of global batch `step`; returns the global mean loss."""
    mine = rank_slice(global_batch_indices(len(train_split), config.batch_size, step, config.seed), rank, world_size)
    torch.manual_seed(config.seed * 1_000_003 + step * 1_009 + rank)  # dropout masks: f(seed, step, rank)
    micro = len(mine) // config.grad_accum
    plain_optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps it on GPUs
    loss_sum = 0.0
    for i in range(config.grad_accum):
        rows = mine[i * micro:(i + 1) * micro]
        batch = tokenize(tokenizer, [train_split.texts[j] for j in rows], config.max_length, device)  # (b, T)
        labels = torch.tensor([train_split.labels[j] for j in rows], device=device)  # (b,)
        with sync_gradients(model, sync=(i == config.grad_accum - 1)):  # reduce on the last micro-batch only
            loss = F.cross_entropy(model(**batch).logits.float(), labels)
            if measure is not None and i == 0:
                measure["after_forward"] = memory_snapshot(model, plain_optimizer)
            (loss / config.grad_accum).backward()
        loss_sum += loss.item()
    if measure is not None:
        measure["after_backward"] = memory_snapshot(model, plain_optimizer)
    if config.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    if measure is not None:
        measure["after_step"] = memory_snapshot(model, plain_optimizer)
    optimizer.zero_grad(set_to_none=True)
    return all_reduce_sum([loss_sum / config.grad_accum], device)[0] / world_size


def train(config: FinetuneConfig) -> dict:
    """Run on every rank. Returns a summary (the same on all ranks but for `rank`, `memory`,
    `shard_check`); rank 0 also writes it to output_dir/summary.json, and each step to log.jsonl."""
    from tqdm import tqdm  # plain text: ranks are processes, they cannot draw notebook widgets

    strategy = resolve_strategy(config.strategy)
    device_type = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.check_world_size(world_size)
    splits, label_names = load_dataset(config.data_dir)  # bad data or model id: fail before joining the group
    resolve_model_path(config.model_id, config.offline)
    if device_type == "cpu":
        set_cpu_threads()
    accelerator = make_accelerator(config, strategy, device_type, world_size)
    rank, device = accelerator.process_index, accelerator.device
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_classifier(config.model_id, label_names, config.seed, config.offline, config.dropout)
    hf_config = model.config
    model, optimizer, units, shard_check = prepare_model(config, strategy, accelerator, model, device_type, world_size)
    plain_optimizer = getattr(optimizer, "optimizer", optimizer)
    fingerprint = model_fingerprint(model, hf_config, config.model_id, label_names)

    train_split = splits["train"]
    per_epoch = steps_per_epoch(len(train_split), config.batch_size)
    if per_epoch < 1:
        raise ValueError(f"batch_size {config.batch_size} is larger than the training split ({len(train_split)})")
    total_steps = config.max_steps or config.epochs * per_epoch
    data_order = {"seed": config.seed, "batch_size": config.batch_size, "total_steps": total_steps,
                  "n_train": len(train_split)}

    start_step = 0
    checkpoint = _find_checkpoint(config.resume, out / "checkpoints")
    if checkpoint is not None:
        meta = load_checkpoint(checkpoint, model, plain_optimizer, fingerprint)
        if meta.get("data_order") != data_order:
            raise CheckpointError(f"{checkpoint} was written with data order {meta.get('data_order')}, this run has "
                                  f"{data_order}: the resumed run would read other batches. Use the same seed, "
                                  "batch_size, epochs/max_steps and data.")
        start_step = meta["step"]
        accelerator.print(f"resumed from {checkpoint} (step {start_step}, written by {meta['world_size']} rank(s) "
                          f"with {meta['strategy']}) on {world_size} rank(s) with {strategy}")

    def save(step, crash=False):
        extra = {"world_size": world_size, "strategy": strategy, "data_order": data_order,
                 "config": dataclasses.asdict(config)}
        die = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if crash and rank == config.crash_rank else None
        path = save_checkpoint(out / "checkpoints", step, model, plain_optimizer, fingerprint, extra, fault=die)
        if rank == 0:
            prune_checkpoints(out / "checkpoints", config.keep_checkpoints)
        return path

    history, evals, step_times, memory = [], [], [], {}
    stop_at = min(total_steps, config.stop_after or total_steps)
    bar = tqdm(total=total_steps, initial=start_step, desc=f"{strategy} N={world_size}", file=sys.stderr,
               disable=not (config.progress and rank == 0), mininterval=1.0, dynamic_ncols=True)
    model.train()
    for step in range(start_step, stop_at):
        done = step + 1
        if config.crash_at_step == done and not config.crash_during_save and rank == config.crash_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: a rank killed mid-training
        started = time.perf_counter()
        lr = learning_rate(step, total_steps, config.lr, config.warmup_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        measure = memory if config.measure_memory and step == start_step + 1 else None
        loss = _step(step, model, optimizer, tokenizer, train_split, config, rank, world_size, device, measure)
        if device_type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - started)
        history.append({"step": done, "epoch": step // per_epoch + 1, "loss": loss, "lr": lr,
                        "world_size": world_size, "strategy": strategy})
        if rank == 0:
            append_jsonl(out / "log.jsonl", history[-1])
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if config.evaluate and (done % per_epoch == 0 or done == total_steps):
            result = evaluate(model, tokenizer, splits["validation"], config, device, rank, world_size)
            evals.append({"step": done, "epoch": math.ceil(done / per_epoch), "val_accuracy": result["accuracy"],
                          "val_loss": result["loss"]})
            if rank == 0:
                append_jsonl(out / "log.jsonl", evals[-1])
            accelerator.print(f"step {done}: validation accuracy {result['accuracy']:.3f}, loss {result['loss']:.4f}")
        if config.checkpoint_every and done % config.checkpoint_every == 0 and done < stop_at:
            save(done, crash=config.crash_during_save and config.crash_at_step == done)
    bar.close()

    finished = stop_at == total_steps
    summary = {"strategy": strategy, "world_size": world_size, "rank": rank, "device": str(device),
               "start_step": start_step, "end_step": stop_at, "total_steps": total_steps, "finished": finished,
               "history": history, "evals": evals, "labels": label_names, "units": units, "shard_check": shard_check,
               "memory": memory, "n_params": sum(p.numel() for p in model.parameters()),
               "step_time_s": typical(step_times),
               "samples_per_s": config.batch_size / typical(step_times) if step_times else None}
    if config.checkpoint_every or config.stop_after:
        summary["checkpoint"] = str(save(stop_at) if stop_at > start_step else step_dir(out / "checkpoints", stop_at))
    if finished and config.evaluate:
        summary["test"] = evaluate(model, tokenizer, splits["test"], config, device, rank, world_size)
        accelerator.print(f"test accuracy {summary['test']['accuracy']:.4f} on {summary['test']['n']} examples")
    if finished and config.export:
        export_pretrained(model, hf_config, tokenizer, out / "model")
        summary["export_dir"] = str(out / "model")
        accelerator.print(f"exported the fine-tuned model to {out / 'model'}")
    if device_type == "cuda":
        summary["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


# ---------------------------------------------------------------------------------
# entry points


def check_before_launch(config: FinetuneConfig, world_size: int) -> None:
    """Bad input fails here, in the caller, before any process starts."""
    config.check_world_size(world_size)
    load_dataset(config.data_dir)
    resolve_model_path(config.model_id, config.offline)


def run_in_notebook(config: FinetuneConfig, num_processes: int) -> dict:
    """accelerate.notebook_launcher on `num_processes` CPU processes; returns rank 0's summary."""
    import socket

    from accelerate import notebook_launcher

    check_before_launch(config, num_processes)
    with socket.socket() as s:  # a free port: other people may share this machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    summary_path = Path(config.output_dir) / "summary.json"
    summary_path.unlink(missing_ok=True)
    notebook_launcher(train, (config,), num_processes=num_processes, use_port=str(port))
    return json.loads(summary_path.read_text())


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    """Command-line flags: one per FinetuneConfig field (--batch-size 32, --no-evaluate, ...)."""
    parser = argparse.ArgumentParser(prog="python -m shardlib.finetune", description=__doc__.split("\n")[0])
    defaults = FinetuneConfig()
    kinds = {"int": int, "float": float, "str": str}
    help_ = {"batch_size": "examples per optimizer step, over all ranks and micro-batches",
             "grad_accum": "micro-batches per optimizer step on each rank",
             "checkpoint_every": "save a sharded checkpoint every this many steps (0: none)",
             "stop_after": "save a checkpoint and stop at this step; resume later with --resume",
             "keep_checkpoints": "committed checkpoints to keep", "device": "auto, cpu or cuda",
             "mixed_precision": "auto (bf16 on GPU), no or bf16",
             "activation_checkpointing": "recompute activations in backward (default: on GPU only)",
             "replicate_size": "HYBRID_SHARD: number of replicas (default: the number of nodes)",
             "layer_cls_to_wrap": "comma-separated block classes, one FSDP unit each (default: the "
                                  "accelerate config's, else the model's _no_split_modules)",
             "dropout": "override the model's dropout probability", "export": "save_pretrained at the end",
             "crash_at_step": "fault injection: SIGKILL --crash-rank when this step begins"}
    for field in dataclasses.fields(FinetuneConfig):
        flag, default = "--" + field.name.replace("_", "-"), getattr(defaults, field.name)
        base = field.type.split(" | ")[0]
        if field.name == "resume":
            parser.add_argument(flag, nargs="?", const=True, default=False,
                                help="resume from the latest checkpoint in --output-dir, or from the one given")
        elif field.name == "strategy":
            parser.add_argument(flag, default=None, help=f"one of {', '.join(STRATEGIES)}; default: the "
                                "accelerate config's, else FULL_SHARD")
        elif base == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_.get(field.name))
        else:
            parser.add_argument(flag, type=kinds[base], default=default, help=help_.get(field.name))
    parser.add_argument("--online", dest="offline", action="store_false", help="allow downloading the model")
    try:
        return FinetuneConfig(**vars(parser.parse_args(argv)))
    except ValueError as error:  # a bad value: argparse's usage line and the message, exit code 2
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    summary = train(config)
    if summary["rank"] == 0 and "test" in summary:
        print(json.dumps({"test_accuracy": summary["test"]["accuracy"], "step_time_s": summary["step_time_s"],
                          "samples_per_s": summary["samples_per_s"],
                          "max_memory_allocated": summary.get("max_memory_allocated")}))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
