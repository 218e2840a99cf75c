"""Reading a plan: the ranked table, why the best layout wins, the command line, the benchmark.

`python -m shardlib plan --model llama-70b --gpus 16 --gpu-mem 80` (see `--help`) prints the
layouts that fit, fastest first, and a few lines on the best: what its step time and memory go
to, and what the runner-up (the fastest layout on another dp x tp x pp mesh) trades. The cost
model and its sources are in shardlib/plan.py.
"""

from __future__ import annotations

import argparse
import sys
import time

from shardlib import memory
from shardlib.plan import (GiB, PRESETS, Cluster, Estimate, Layout, ModelSpec, NoLayoutFits, Plan, count_text,
                           load_model, plan)


def _in_one_node(span: int, gpus_per_node: int) -> bool:
    return span <= gpus_per_node and gpus_per_node % span == 0


def _time_parts(e: Estimate, cluster: Cluster) -> list[tuple[str, float]]:
    lay, g = e.layout, cluster.gpus_per_node
    where = lambda span: "intra-node" if _in_one_node(span, g) else "inter-node"  # noqa: E731
    return [("compute", e.compute_s), (f"TP communication ({where(lay.tp)})", e.tp_s),
            ("pipeline bubble", e.bubble_s), (f"DP communication ({where(lay.tp * lay.dp)})", e.dp_s),
            (f"PP sends ({where(lay.tp * lay.dp * lay.pp)})", e.pp_s)]


def _seconds(x: float) -> str:
    return f"{x:.3g}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def _gib(nbytes: float) -> str:
    x = nbytes / GiB
    return f"{x:.1f}" if x >= 0.95 or x == 0 else f"{x:.2g}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('h') else 's'}"


def _sharding(lay: Layout) -> str:
    """How the model states are divided, in words."""
    parts = []
    if lay.dp > 1:
        parts.append(f"ZeRO-{lay.zero} over {lay.dp} data-parallel GPUs" if lay.zero else
                     f"replicated on {lay.dp} data-parallel GPUs")
    if lay.tp * lay.pp > 1:
        parts.append(f"split {lay.tp * lay.pp} ways by tp x pp")
    return ", ".join(parts) or "one GPU holds them all"


def format_table(estimates: list[Estimate], cluster: Cluster) -> str:
    """One line per estimate: layout, memory per GPU (GiB), seconds per step and their parts, MFU."""
    lines = [f"{'#':>3} {'dp':>4} {'tp':>3} {'pp':>3} {'zero':>4} {'b x m':>8} {'recompute':>9} {'sp':>3} "
             f"{'GiB/GPU':>8} {'states':>7} {'act':>6} {'step s':>8} {'compute':>8} {'tp':>7} {'bubble':>7} "
             f"{'dp':>7} {'pp':>7} {'MFU':>5}"]
    for i, e in enumerate(estimates, 1):
        lay = e.layout
        lines.append(
            f"{i:>3} {lay.dp:>4} {lay.tp:>3} {lay.pp:>3} {lay.zero:>4} {f'{lay.micro_batch}x{e.n_micro}':>8} "
            f"{lay.recompute or '-':>9} {'y' if lay.sequence_parallel else '-':>3} {_gib(e.memory_bytes):>8} "
            f"{_gib(e.model_state_bytes):>7} {_gib(e.activation_bytes):>6} {_seconds(e.step_s):>8} "
            f"{_seconds(e.compute_s):>8} {_seconds(e.tp_s):>7} {_seconds(e.bubble_s):>7} {_seconds(e.dp_s):>7} "
            f"{_seconds(e.pp_s):>7} {e.mfu:>5.0%}")
    return "\n".join(lines)


def explain(result: Plan) -> str:
    """A few lines on why the best layout wins: what its time and memory go to, what the runner-up trades."""
    best, cluster = result.best, result.cluster
    lay, step = best.layout, best.step_s
    parts = _time_parts(best, cluster)
    in_flight = f", {_plural(min(lay.pp, best.n_micro), 'micro-batch')} in flight on stage 0" if lay.pp > 1 else ""
    lines = [f"{len(result.ranked)} of {len(result.ranked) + len(result.rejected)} layouts fit "
             f"{cluster.n_gpus} x {cluster.gpu_mem_gib:g} GiB; ranked by predicted step time.",
             f"Best: {lay} ({_plural(best.n_micro, 'micro-batch')} of {lay.micro_batch} per data-parallel rank): "
             f"{_seconds(step)} s per step, MFU {best.mfu:.0%}.",
             "  time: " + ", ".join(f"{label} {seconds / step:.0%}" for label, seconds in
                                    sorted(parts, key=lambda part: -part[1]) if seconds >= 0.005 * step),
             f"  memory: {_gib(best.memory_bytes)} of {cluster.gpu_mem_gib:g} GiB per GPU: model states "
             f"{_gib(best.model_state_bytes)} ({_sharding(lay)}), activations {_gib(best.activation_bytes)} "
             f"({lay.recompute or 'no'} recomputation{', sequence parallel' if lay.sequence_parallel else ''}"
             f"{in_flight})"
             + (f", gathered layers {_gib(best.buffer_bytes)}" if best.buffer_bytes else "") + "."]
    other = result.runner_up()
    if other is not None:
        deltas = [(label, theirs - ours) for (label, ours), (_, theirs) in zip(parts, _time_parts(other, cluster))]
        costs, gains = max(deltas, key=lambda x: x[1]), min(deltas, key=lambda x: x[1])
        trade = f"+{_seconds(costs[1])} s of {costs[0]}" if costs[1] > 1e-9 * step else "no slower part"
        if gains[1] < -1e-9 * step:
            trade += f", saves {_seconds(-gains[1])} s of {gains[0]}"
        change = other.memory_bytes - best.memory_bytes
        lines.append(f"Runner-up: {other.layout}: {other.step_s / step - 1:+.1%} step time ({trade}); "
                     f"{'needs' if change >= 0 else 'saves'} {_gib(abs(change))} GiB per GPU"
                     f"{' more' if change >= 0 else ''}.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------
# command line and benchmark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlib plan",
                                     description="Rank dp x tp x pp x ZeRO layouts for training a model on a "
                                                 "cluster, by predicted step time (formulas: shardlib/plan.py).")
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


def bench_plan(quick: bool = False) -> list[dict]:
    """Seconds to enumerate, predict and rank 10,000 layouts. No PyTorch counterpart exists:
    torch_s is the 1 s target itself, so ratio <= 1 means the target is met."""
    spec, cluster = ModelSpec.preset("gpt3-175b"), Cluster.of(1536)
    runs = []
    for _ in range(1 if quick else 3):
        start = time.perf_counter()
        result = plan(spec, cluster, global_batch=1536)
        runs.append(time.perf_counter() - start)
    n = len(result.ranked) + len(result.rejected)
    per_10k = min(runs) * 10_000 / n
    return [{"benchmark": "plan", "case": f"gpt3-175b on 1536 GPUs: {n} layouts; s per 10k vs 1 s target",
             "ours_s": per_10k, "torch_s": 1.0, "ratio": per_10k, "target": 1.0, "layouts": n,
             "total_s": round(min(runs), 4)}]
