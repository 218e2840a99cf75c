"""`python -m shardlib plan ...`: rank the layouts of a training job from the command line (see `--help`)."""

from __future__ import annotations

import argparse
import sys

from shardlib import memory
from shardlib.plan.inputs import PRESETS, Cluster, count_text, load_model
from shardlib.plan.planner import NoLayoutFits, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlib plan",
                                     description="Rank dp x tp x pp x ZeRO layouts for training a model on a "
                                                 "cluster, by predicted step time (formulas: shardlib/plan/planner.py).")
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU, GiB (an '80 GB' A100: 80)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra-bw", type=float, default=300.0, help="GB/s per GPU in a node (default: A100 NVLink)")
    parser.add_argument("--inter-bw", type=float, default=25.0, help="GB/s per GPU between nodes (default 200 Gb/s IB)")
    parser.add_argument("--peak-tflops", type=float, default=312.0, help="bf16 dense peak per GPU (default A100)")
    parser.add_argument("--alpha-us", type=float, default=5.0, help="latency per message, microseconds")
    parser.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    parser.add_argument("--recipe", default="mixed_adam", choices=sorted(memory.TRAINING_RECIPES),
                        help="bytes per parameter of the model states (default: 16, mixed-precision Adam)")
    parser.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak the matmuls reach")
    parser.add_argument("--overlap", type=float, default=0.0, help="fraction of DP communication hidden by backward")
    parser.add_argument("--reserve-gib", type=float, default=0.0, help="GiB per GPU kept free (context, fragmentation)")
    parser.add_argument("--tp-within-node", action="store_true", help="only tensor-parallel groups inside one node")
    parser.add_argument("--top", type=int, default=10, help="rows to print")
    args = parser.parse_args(argv)
    for name in ("gpus", "gpu_mem", "gpus_per_node", "intra_bw", "inter_bw", "peak_tflops", "global_batch", "top"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.seq_len is not None and args.seq_len <= 0:
        parser.error(f"--seq-len must be positive, got {args.seq_len}")
    try:
        spec = load_model(args.model, args.seq_len)
        cluster = Cluster.of(args.gpus, args.gpus_per_node, gpu_mem_gib=args.gpu_mem, intra_bw_gbps=args.intra_bw,
                             inter_bw_gbps=args.inter_bw, peak_tflops=args.peak_tflops, alpha_us=args.alpha_us)
        result = plan(spec, cluster, args.global_batch, recipe=args.recipe, efficiency=args.efficiency,
                      overlap=args.overlap, reserve_gib=args.reserve_gib, tp_within_node=args.tp_within_node)
    except NoLayoutFits as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    print(f"{spec.name}: {count_text(spec.psi)} parameters, {spec.n_layer} layers, h={spec.hidden}, "
          f"{spec.n_head} heads, V={spec.vocab_size}, s={spec.seq_len}; global batch {args.global_batch} "
          f"sequences; {cluster.n_nodes} node(s) x {cluster.gpus_per_node} GPUs of {cluster.gpu_mem_gib:g} GiB")
    print(result.table(args.top))
    print(result.explain())
    return 0
