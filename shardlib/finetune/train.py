"""Fine-tune a Hugging Face classifier with Accelerate + FSDP2 on N ranks, with sharded checkpoints.

One function, `train(config)`, runs on every rank however the ranks were started:

    notebook / script   run_in_notebook(config, N)   (shardlib.finetune.notebook: notebook_launcher,
                        or shardlib.launch(train, N, args=(config,)), which returns each rank's result)
    GPUs, one node      accelerate launch --config_file <fsdp2_1node_4gpu.yaml> -m shardlib.finetune --epochs 3
    anywhere            torchrun --nproc-per-node N -m shardlib.finetune --strategy FULL_SHARD

Per-rank model states (Psi parameters, N ranks, S ranks per shard group; mixed-precision
Adam, ZeRO arXiv 1910.02054): DDP 16 Psi, SHARD_GRAD_OP 2 Psi + 14 Psi/N, FULL_SHARD
16 Psi/N, HYBRID_SHARD 16 Psi/S. Bytes sent per rank and step: 2 Psi (DDP,
SHARD_GRAD_OP), 3 Psi (FULL_SHARD). See shardlib.finetune.model for how each maps to FSDP2.

A run is four parts, each a function below: `start_rank` (Accelerator, model, shards, data),
`resume` (from a checkpoint, if asked), `run_steps` (the loop: steps, evaluation, checkpoints)
and `summarise`. The data order is a function of (seed, step) and dropout masks of (seed, step,
rank), so a run stopped after k steps and resumed from its checkpoint computes the same losses
as the uninterrupted run. Faults are injected from outside through `fault=`
(shardlib.finetune.faults); nothing in a run's configuration asks for one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
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
from shardlib.finetune.config import FinetuneConfig
from shardlib.finetune.data import global_batch_indices, load_dataset, rank_share, steps_per_epoch, tokenize
from shardlib.finetune.model import load_classifier, resolve_model_path
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
from shardlib.launch import current_device


@dataclasses.dataclass
class RankRun:
    """What one rank holds for the whole run (built by start_rank)."""

    config: FinetuneConfig
    strategy: str
    accelerator: object
    device: torch.device
    world_size: int
    out: Path
    model: torch.nn.Module
    optimizer: object  # Accelerate's wrapper on GPUs (it applies fp16's gradient scaling)
    tokenizer: object
    hf_config: object
    splits: dict
    label_names: list[str]
    fingerprint: dict
    units: list[str]
    shard_check: dict | None
    per_epoch: int
    total_steps: int

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def plain_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    @property
    def data_order(self) -> dict:
        return {"seed": self.config.seed, "batch_size": self.config.batch_size, "total_steps": self.total_steps,
                "n_train": len(self.splits["train"])}


def start_rank(config: FinetuneConfig) -> RankRun:
    """Join the job, load data and model, replicate or shard it. Bad input fails before any collective."""
    strategy = resolve_strategy(config.strategy)
    device_type = _device_type(config.device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.check_world_size(world_size)
    splits, label_names = load_dataset(config.data_dir)
    resolve_model_path(config.model_id, config.offline)
    if device_type == "cpu":
        set_cpu_threads()
    accelerator = make_accelerator(config, strategy, device_type, world_size)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_classifier(config.model_id, label_names, config.seed, config.offline, config.dropout)
    hf_config = model.config
    model, optimizer, units, shard_check = prepare_model(config, strategy, accelerator, model, device_type, world_size)
    per_epoch = steps_per_epoch(len(splits["train"]), config.batch_size)
    if per_epoch < 1:
        raise ValueError(f"batch_size {config.batch_size} is larger than the training split ({len(splits['train'])})")
    return RankRun(config=config, strategy=strategy, accelerator=accelerator, device=accelerator.device,
                   world_size=world_size, out=out, model=model, optimizer=optimizer, tokenizer=tokenizer,
                   hf_config=hf_config, splits=splits, label_names=label_names,
                   fingerprint=model_fingerprint(model, hf_config, config.model_id, label_names), units=units,
                   shard_check=shard_check, per_epoch=per_epoch,
                   total_steps=config.max_steps or config.epochs * per_epoch)


def _device_type(asked: str) -> str:
    """cpu or cuda: as asked; for "auto", the device of a group already joined (shardlib.launch),
    else CPU when `accelerate launch --cpu` says so, else CUDA when there is a GPU."""
    if asked != "auto":
        return asked
    if dist.is_initialized():
        return current_device().type
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return "cpu"
    from shardlib.devices import visible_gpus  # NVML: asking torch.cuda would spoil later forks

    return "cuda" if visible_gpus() else "cpu"


def resume(run: RankRun) -> int:
    """Load the checkpoint the config asks for, if any (resharding it onto these ranks); return its step."""
    asked, checkpoints = run.config.resume, run.out / "checkpoints"
    if asked in (True, "auto"):
        checkpoint = latest_checkpoint(checkpoints)
        if checkpoint is None and asked is True:
            raise CheckpointError(f"resume=True but {checkpoints} holds no committed checkpoint")
    else:
        checkpoint = Path(asked) if asked else None
    if checkpoint is None:
        return 0
    meta = load_checkpoint(checkpoint, run.model, run.plain_optimizer, run.fingerprint)
    if meta.get("data_order") != run.data_order:
        raise CheckpointError(f"{checkpoint} was written with data order {meta.get('data_order')}, this run has "
                              f"{run.data_order}: the resumed run would read other batches. Use the same seed, "
                              "batch_size, epochs/max_steps and data.")
    run.accelerator.print(f"resumed from {checkpoint} (step {meta['step']}, written by {meta['world_size']} rank(s) "
                          f"with {meta['strategy']}) on {run.world_size} rank(s) with {run.strategy}")
    return meta["step"]


def save(run: RankRun, step: int, fault=None) -> Path:
    """Every rank writes its shards of the step-`step` checkpoint; rank 0 commits it and prunes old ones."""
    extra = {"world_size": run.world_size, "strategy": run.strategy, "data_order": run.data_order,
             "config": dataclasses.asdict(run.config)}
    hook = (lambda: fault("save", step, run.rank)) if fault is not None else None
    path = save_checkpoint(run.out / "checkpoints", step, run.model, run.plain_optimizer, run.fingerprint, extra,
                           fault=hook)
    if run.rank == 0:
        prune_checkpoints(run.out / "checkpoints", run.config.keep_checkpoints)
    return path


def _step(run: RankRun, step: int, measure: dict | None) -> tuple[float, bool]:
    """One optimizer step on this rank's share of global batch `step`: (global mean loss, stop asked)."""
    config, accelerator, split = run.config, run.accelerator, run.splits["train"]
    mine = rank_share(global_batch_indices(len(split), config.batch_size, step, config.seed), run.rank, run.world_size)
    torch.manual_seed(config.seed * 1_000_003 + step * 1_009 + run.rank)  # dropout masks: f(seed, step, rank)
    micro = len(mine) // config.grad_accum
    loss_sum = 0.0
    for i in range(config.grad_accum):
        rows = mine[i * micro:(i + 1) * micro]
        batch = tokenize(run.tokenizer, [split.texts[j] for j in rows], config.max_length, run.device)  # (b, T)
        labels = torch.tensor([split.labels[j] for j in rows], device=run.device)  # (b,)
        with sync_gradients(run.model, sync=(i == config.grad_accum - 1)):  # reduce on the last micro-batch only
            loss = F.cross_entropy(run.model(**batch).logits.float(), labels)
            if measure is not None and i == 0:
                measure["after_forward"] = memory_snapshot(run.model, run.plain_optimizer)
            accelerator.backward(loss / config.grad_accum)  # fp16: scales the loss (gradient scaling)
        loss_sum += loss.item()
    if measure is not None:
        measure["after_backward"] = memory_snapshot(run.model, run.plain_optimizer)
    if config.max_grad_norm is not None:
        accelerator.clip_grad_norm_(run.model.parameters(), config.max_grad_norm)  # unscales fp16 gradients first
    run.optimizer.step()  # fp16: skipped when the scaled gradients overflowed
    if measure is not None:
        measure["after_step"] = memory_snapshot(run.model, run.plain_optimizer)
    run.optimizer.zero_grad(set_to_none=True)
    stop = run.rank == 0 and config.stop_file is not None and os.path.exists(config.stop_file)  # rank 0 looks,
    loss, stops = all_reduce_sum([loss_sum / config.grad_accum, float(stop)], run.device)  # every rank learns
    return loss / run.world_size, stops > 0


def run_steps(run: RankRun, start_step: int, fault=None) -> dict:
    """Steps start_step+1 .. the stop step, with evaluation at epoch ends and periodic checkpoints."""
    from tqdm import tqdm  # plain text: ranks are processes, they cannot draw notebook widgets

    config = run.config
    stop_at = min(run.total_steps, config.stop_after or run.total_steps)
    record = {"history": [], "evals": [], "step_times": [], "memory": {}, "stop_at": stop_at}
    show = run.rank == 0 and config.progress != "none"
    label = f"{run.strategy} N={run.world_size}"  # the bar counts this run's steps; a resumed run says which
    if start_step or stop_at < run.total_steps:
        label += f", steps {start_step + 1}-{stop_at} of {run.total_steps}"
    planned = stop_at
    bar = tqdm(total=planned - start_step, desc=label, file=sys.stderr,
               disable=not (show and config.progress == "bar"), mininterval=1.0, dynamic_ncols=True)
    started_run, loss = time.perf_counter(), float("nan")
    run.model.train()
    for step in range(start_step, stop_at):
        done = step + 1
        if fault is not None:
            fault("step", done, run.rank)
        started = time.perf_counter()
        lr = learning_rate(step, run.total_steps, config.lr, config.warmup_ratio)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        measure_at = start_step + 2 if config.measure_memory is True else config.measure_memory
        measure = record["memory"] if measure_at and done == measure_at else None
        loss, stop = _step(run, step, measure)
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        record["step_times"].append(time.perf_counter() - started)
        record["history"].append({"step": done, "epoch": step // run.per_epoch + 1, "loss": loss, "lr": lr,
                                  "world_size": run.world_size, "strategy": run.strategy})
        if run.rank == 0:
            append_jsonl(run.out / "log.jsonl", record["history"][-1])
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if config.evaluate and (done % run.per_epoch == 0 or done == run.total_steps):
            result = evaluate(run.model, run.tokenizer, run.splits["validation"], config, run.device, run.rank,
                              run.world_size)
            record["evals"].append({"step": done, "epoch": math.ceil(done / run.per_epoch),
                                    "val_accuracy": result["accuracy"], "val_loss": result["loss"]})
            if run.rank == 0:
                append_jsonl(run.out / "log.jsonl", record["evals"][-1])
            if config.progress != "final":
                _print_eval(run, record["evals"][-1])
        if stop and done < stop_at:  # summarise saves this step's checkpoint
            run.accelerator.print(f"step {done}: {config.stop_file} appeared, stopping after a checkpoint")
            stop_at = record["stop_at"] = done
            break
        if config.checkpoint_every and done % config.checkpoint_every == 0 and done < stop_at:
            save(run, done, fault)
    bar.close()
    if show and config.progress == "final" and stop_at > start_step:  # one line: the bar as it ended
        sys.stderr.write(tqdm.format_meter(stop_at - start_step, planned - start_step, time.perf_counter() - started_run,
                                           prefix=label, postfix=f"loss={loss:.4f}") + "\n")  # fewer: a stop file
        sys.stderr.flush()
        for result in record["evals"]:  # after the bar's one line, not between its frames
            _print_eval(run, result)
    return record


def _print_eval(run: RankRun, result: dict) -> None:
    run.accelerator.print(f"step {result['step']}: validation accuracy {result['val_accuracy']:.3f}, "
                          f"loss {result['val_loss']:.4f}")


def summarise(run: RankRun, start_step: int, record: dict) -> dict:
    """The run's summary (the same on all ranks but for rank, memory, shard_check, max_memory_allocated);
    the final checkpoint, test evaluation and export happen here. Rank 0 writes output_dir/summary.json."""
    config, stop_at, times = run.config, record["stop_at"], record["step_times"]
    finished = stop_at == run.total_steps
    summary = {"strategy": run.strategy, "world_size": run.world_size, "rank": run.rank, "device": str(run.device),
               "start_step": start_step, "end_step": stop_at, "total_steps": run.total_steps, "finished": finished,
               "history": record["history"], "evals": record["evals"], "labels": run.label_names,
               "units": run.units, "shard_check": run.shard_check, "memory": record["memory"],
               "n_params": sum(p.numel() for p in run.model.parameters()),
               "mixed_precision": run.accelerator.mixed_precision, "step_time_s": typical(times),
               "samples_per_s": config.batch_size / typical(times) if times else None}
    if config.checkpoint_every or config.stop_after or not finished:  # not finished: the stop file
        summary["checkpoint"] = str(save(run, stop_at) if stop_at > start_step else step_dir(run.out / "checkpoints",
                                                                                              stop_at))
    if finished and config.evaluate:
        summary["test"] = evaluate(run.model, run.tokenizer, run.splits["test"], config, run.device, run.rank,
                                   run.world_size)
        run.accelerator.print(f"test accuracy {summary['test']['accuracy']:.4f} on {summary['test']['n']} examples")
    if finished and config.export:
        export_pretrained(run.model, run.hf_config, run.tokenizer, run.out / "model")
        summary["export_dir"] = str(run.out / "model")
        run.accelerator.print(f"exported the fine-tuned model to {run.out / 'model'}")
    if run.device.type == "cuda":
        summary["max_memory_allocated"] = torch.cuda.max_memory_allocated(run.device)
    if run.rank == 0:
        (run.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def train(config: FinetuneConfig, fault=None) -> dict:
    """Run on every rank. Returns the summary (see `summarise`); `fault` is a test hook
    (shardlib.finetune.faults.KillRank) called when each step begins and while checkpoints are written."""
    run = start_rank(config)
    start_step = resume(run)
    record = run_steps(run, start_step, fault)
    return summarise(run, start_step, record)
