"""The command line: `python -m shardlib.finetune [flags]`, also under torchrun and accelerate launch.

One flag per FinetuneConfig field (--batch-size 32, --no-evaluate, ...); `--help` lists them.
Each rank runs train(config); rank 0 prints one JSON line with the test accuracy, step time
and, on GPUs, the peak memory. Sends nothing itself (see shardlib.finetune.train).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch.distributed as dist

from shardlib.finetune.config import MIXED_PRECISION, PROGRESS, FinetuneConfig
from shardlib.finetune.model import STRATEGY_SUMMARIES

HELP = {"data_dir": "a folder with train/validation/test .jsonl or .csv (default: the course's topic data)",
        "batch_size": "examples per optimizer step, over all ranks and micro-batches",
        "grad_accum": "micro-batches per optimizer step on each rank",
        "checkpoint_every": "save a sharded checkpoint every this many steps (0: none)",
        "stop_after": "save a checkpoint and stop at this step; resume later with --resume",
        "stop_file": "when this file appears (a scheduler's warning before a time limit), finish the step, "
                     "save a checkpoint and stop; resume later with --resume",
        "keep_checkpoints": "committed checkpoints to keep", "device": "auto, cpu or cuda",
        "mixed_precision": f"{', '.join(MIXED_PRECISION)}: auto is bf16 on GPUs with native bf16 (sm_80+), "
                           "fp16 with gradient scaling on older GPUs (T4, V100), no on CPU",
        "activation_checkpointing": "recompute activations in backward (default: on GPU only)",
        "replicate_size": "HYBRID_SHARD: number of replicas (default: the number of nodes)",
        "layer_cls_to_wrap": "comma-separated block classes, one FSDP unit each (default: the "
                             "accelerate config's, else the model's _no_split_modules)",
        "dropout": "override the model's dropout probability", "export": "save_pretrained at the end",
        "progress": f"{', '.join(PROGRESS)}: a live bar, one line at the end, or nothing"}


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    """Flags to a FinetuneConfig; a bad value exits with argparse's usage line and the reason (code 2)."""
    parser = argparse.ArgumentParser(prog="python -m shardlib.finetune",
                                     description="Fine-tune a Hugging Face classifier with Accelerate + FSDP2.")
    defaults = FinetuneConfig()
    kinds = {"int": int, "float": float, "str": str}
    for field in dataclasses.fields(FinetuneConfig):
        flag, default = "--" + field.name.replace("_", "-"), getattr(defaults, field.name)
        base = field.type.split(" | ")[0]
        if field.name == "resume":
            parser.add_argument(flag, nargs="?", const=True, default=False,
                                help="resume from the latest checkpoint in --output-dir, or from the one given")
        elif field.name == "strategy":
            parser.add_argument(flag, default=None, help=f"one of {', '.join(STRATEGY_SUMMARIES)}; default: the "
                                "accelerate config's, else FULL_SHARD")
        elif field.name == "progress":
            parser.add_argument(flag, default=default, help=HELP["progress"])
            parser.add_argument("--no-progress", dest="progress", action="store_const", const="none",
                                help="same as --progress none")
        elif field.name == "data_dir":
            parser.add_argument(flag, default="", help=HELP["data_dir"])
        elif base == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=HELP.get(field.name))
        else:
            parser.add_argument(flag, type=kinds[base], default=default, help=HELP.get(field.name))
    parser.add_argument("--online", dest="offline", action="store_false", help="allow downloading the model")
    try:
        return FinetuneConfig(**vars(parser.parse_args(argv)))
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    from shardlib.finetune.train import train

    summary = train(parse_args(argv))
    if summary["rank"] == 0 and "test" in summary:
        print(json.dumps({"test_accuracy": summary["test"]["accuracy"], "step_time_s": summary["step_time_s"],
                          "samples_per_s": summary["samples_per_s"], "mixed_precision": summary["mixed_precision"],
                          "max_memory_allocated": summary.get("max_memory_allocated")}))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
