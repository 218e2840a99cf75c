"""`python -m shardlib simulate ...`: one rank of a large training job, run by shardlib's own code on
meta tensors and a fake process group, held against the planner (see `--help`).

    python -m shardlib simulate --model llama-70b --gpus 64 --tp 8 --pp 2 --dp 4 --zero 1
    python -m shardlib simulate --model llama-70b --gpus 64 --tp 8 --pp 2 --dp 4 --zero 1 --rank 63 --json
    python -m shardlib simulate --model gpt3-175b --gpus 1024 --tp 8 --pp 16 --dp 8 --zero 1 \\
        --virtual-stages 3 --recompute full --attention unfused --global-batch 1536
    python -m shardlib simulate --model mixtral-8x7b --gpus 64 --pp 4 --dp 16 --ep 8 --zero 1 --global-batch 64

Exit code 0 when every quantity is within its target of the planner's (model states 1%, activation
peak 3%, bytes sent exactly), 1 when one is not: the table says which.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardlib.plan.inputs import CP_METHODS, PRESETS, Layout, load_model
from shardlib.simulate.compare import compare
from shardlib.simulate.meta import ATTENTION
from shardlib.simulate.report import as_dict, format_report
from shardlib.simulate.run import simulate

RECOMPUTE = {"none": None, "selective": "selective", "full": "full"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shardlib simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="How it works: shardlib/simulate/ (run.py, model.py, timeline.py).")
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job: dp * cp * tp * pp")
    for name, what in (("tp", "tensor-parallel"), ("pp", "pipeline stages"), ("cp", "context-parallel"),
                       ("ep", "expert-parallel (inside dp)")):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{what} size (default 1)")
    parser.add_argument("--dp", type=int, help="data-parallel size (default: gpus / (tp * pp * cp))")
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage (default 1)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--global-batch", type=int, default=256, help="sequences per step (default 256)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    parser.add_argument("--recompute", choices=sorted(RECOMPUTE), default="none", help="activation recomputation")
    parser.add_argument("--virtual-stages", type=int, default=1, help="interleaved 1F1B: chunks per pipeline rank")
    parser.add_argument("--sequence-parallel", choices=("yes", "no"), default="yes", help="with tp > 1 (default yes)")
    parser.add_argument("--cp-method", choices=CP_METHODS, default="ring")
    parser.add_argument("--attention", choices=ATTENTION, default="flash",
                        help="flash: FlashAttention, no scores kept (default); unfused: scores kept, as before it")
    parser.add_argument("--rank", type=int, action="append", help="the rank to simulate (repeatable; default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for name in ("gpus", "tp", "pp", "cp", "ep", "micro_batch", "global_batch", "virtual_stages"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model_parallel = args.tp * args.pp * args.cp
    dp = args.dp if args.dp is not None else args.gpus // model_parallel
    if dp < 1 or dp * model_parallel != args.gpus:
        parser.error(f"dp * cp * tp * pp must be the {args.gpus} GPUs: tp={args.tp}, pp={args.pp}, cp={args.cp} "
                     f"leave {args.gpus / model_parallel:g} for dp" + (f", not --dp {args.dp}" if args.dp else ""))
    try:
        spec = load_model(args.model, args.seq_len)
        layout = Layout(dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero,
                        micro_batch=args.micro_batch, recompute=RECOMPUTE[args.recompute],
                        sequence_parallel=args.sequence_parallel == "yes" and args.tp > 1,
                        cp_method=args.cp_method, virtual_stages=args.virtual_stages)
        ranks = args.rank or [0]
        results = []
        for rank in ranks:
            sim = simulate(spec, layout, rank=rank, global_batch=args.global_batch, attention=args.attention)
            results.append((sim, compare(sim)))
            if not args.json:
                print(format_report(*results[-1]), flush=True)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps([as_dict(*r) for r in results], indent=1))
    return 0 if all(c.within for _, rows in results for c in rows) else 1
