"""`python -m shardlib plan ...`: rank the layouts of a training job, evaluate one layout, or plan
serving (see `--help`).

    python -m shardlib plan --model llama-70b --gpus 16 --gpu-mem 80               # rank every layout
    python -m shardlib plan --model llama-70b --gpus 16 --gpu-mem 80 --tp 8 --max-pp 2 --zero 1 3   # narrowed
    python -m shardlib plan --model llama-70b --gpus 16 --gpu-mem 80 --evaluate --tp 8 --pp 2 --recompute full
    python -m shardlib plan --model llama-70b --inference --batch 8 --context 4096  # 24, 40, 80 GB GPUs
    python -m shardlib plan --model llama3-405b --gpus 8192 --gpu h100 --global-batch 2048 --tp 8 --pp 16
    python -m shardlib plan --validate          # the published runs: error, memory, rank of the published layout
    python -m shardlib plan --validate --fit    # refit the free constants on the training runs
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from shardlib import memory
from shardlib.plan.cost import ATTENTION, DEFAULT_ATTENTION
from shardlib.plan.inference import GPU_SIZES_GIB, format_inference_table, inference_table, predict_inference
from shardlib.plan.inputs import CP_METHODS, GPUS, PRESETS, Cluster, Layout, count_text, load_model
from shardlib.plan.planner import HEADROOM, NoLayoutFits, plan, predict
from shardlib.plan.report import as_dict, breakdown, legend

RECOMPUTE_NAMES = {"none": None, "selective": "selective", "full": "full"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shardlib plan", formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__,
        usage="python -m shardlib plan (--model MODEL (--gpus N [--evaluate] | --inference) | --validate) [options]",
        epilog="Formulas and sources: shardlib/plan/cost.py (training), shardlib/plan/inference.py (serving).")
    parser.add_argument("--model", help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
    parser.add_argument("--gpus", type=int, help="number of GPUs (training)")
    parser.add_argument("--gpu-mem", type=float, help="memory per GPU, GiB (default: the --gpu's, 80); "
                        "--inference: one size instead of 24, 40 and 80")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--evaluate", action="store_true", help="predict the one layout the options below give")
    mode.add_argument("--inference", action="store_true", help="weights + KV cache per GPU when serving")
    mode.add_argument("--validate", action="store_true", help="the planner against the published runs of "
                      "shardlib/plan/published.py (training and held-out sets)")
    parser.add_argument("--fit", action="store_true", help="with --validate: refit the free constants on the "
                        "training runs and print them")
    parser.add_argument("--legend", action="store_true", help="print what each column of the table holds")

    cluster = parser.add_argument_group("cluster (defaults: the --gpu's figures, nodes of 8)")
    cluster.add_argument("--gpu", default="a100", choices=sorted(GPUS), help="DGX A100 or H100 figures (default a100)")
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--intra-bw", type=float, help="GB/s per GPU in a node (a100: NVLink 300)")
    cluster.add_argument("--inter-bw", type=float, help="GB/s per GPU between nodes (a100: 200 Gb/s IB, 25)")
    cluster.add_argument("--peak-tflops", type=float, help="bf16 dense peak per GPU (a100: 312)")
    cluster.add_argument("--hbm-bw", type=float, help="GB/s of GPU memory (a100: 2039)")
    cluster.add_argument("--alpha-us", type=float, default=5.0, help="latency per ring step, microseconds")

    job = parser.add_argument_group("training job")
    job.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    job.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    job.add_argument("--recipe", default="mixed_adam", choices=sorted(memory.TRAINING_RECIPES),
                     help="bytes per parameter of the model states (default: 16, mixed-precision Adam)")
    job.add_argument("--efficiency", type=float, default=None,
                     help="fraction of the GPU's measured matmul ceiling the products reach (default: fitted per "
                          "GPU, shardlib/plan/fitted.py)")
    job.add_argument("--no-overlap", action="store_true", help="expose all data-parallel communication (default: "
                     "overlapped with compute by the rule of shardlib/plan/links.py)")
    job.add_argument("--sync-tp-backward", action="store_true", help="the column-parallel layers' input-gradient "
                     "all-reduces wait on the critical path, as in Megatron-LM before September 2021 and "
                     "Megatron-DeepSpeed (default: each beside its weight-gradient product, Megatron-LM's since)")
    job.add_argument("--checkpoint-early-stop", action="store_true", help="full recomputation stops at each "
                     "layer's last saved tensor, skipping the MLP's down projection, as PyTorch's non-reentrant "
                     "checkpoint does since 2.1 (FSDP, torchtitan; default: the whole layer again, as Megatron-LM)")
    job.add_argument("--attention", default=DEFAULT_ATTENTION, choices=ATTENTION, help="Transformer Engine's fused "
                     "attention (default: cuDNN's kernel on Hopper, FlashAttention-2 elsewhere), FlashAttention-2, "
                     "FlashAttention's Triton kernel (at its fitted speed, shardlib/plan/fitted.py, which "
                     "--efficiency leaves alone), or the scores written out; fused kernels at their published "
                     "speed, shardlib/plan/attention.py")
    job.add_argument("--reserve-gib", type=float, default=0.0, help="GiB per GPU kept free beyond the estimate "
                     "(which counts the CUDA context and NCCL's buffers)")
    job.add_argument("--headroom", type=float, default=HEADROOM, help="share of the rest a recommended layout leaves "
                     f"free (default {HEADROOM}: no out-of-memory error below 80%% of the GPU in arXiv 2411.06465's "
                     "454 runs); layouts that fit only in it are ranked after the others, marked !")

    layout = parser.add_argument_group("layout: fixes these sizes in a search, or gives the layout with --evaluate")
    for name, what in (("dp", "data-parallel"), ("tp", "tensor-parallel"), ("pp", "pipeline stages"),
                       ("cp", "context-parallel"), ("ep", "expert-parallel (inside dp)")):
        layout.add_argument(f"--{name}", type=int, help=f"{what} size")
    layout.add_argument("--zero", type=int, nargs="+", choices=(0, 1, 2, 3), help="ZeRO stage(s) to try")
    layout.add_argument("--zero-in-pipeline", action="store_true", help="also try ZeRO-2 and -3 with pp > 1 (DeepSpeed "
                        "refuses them there; costed once per micro-batch, marked *)")
    layout.add_argument("--micro-batch", type=int, nargs="+", help="micro-batch size(s) to try")
    layout.add_argument("--recompute", nargs="+", choices=sorted(RECOMPUTE_NAMES), help="recomputation mode(s)")
    layout.add_argument("--virtual-stages", type=int, nargs="+", help="interleaved 1F1B: chunks per pipeline rank")
    layout.add_argument("--sequence-parallel", choices=("yes", "no"), help="with tp > 1 (default: try both)")
    layout.add_argument("--tp-overlap", choices=("yes", "no"), help="TP collectives overlapped with the products, with "
                        "sequence parallelism (default: try both)")
    layout.add_argument("--cp-method", nargs="+", choices=CP_METHODS,
                        help="context parallelism: ring, ulysses, allgather (a search tries ring and ulysses)")
    layout.add_argument("--offload", action="store_true", help="optimizer states on the CPU (a search tries both)")
    layout.add_argument("--max-tp", type=int, help="search: largest tensor-parallel size")
    layout.add_argument("--max-pp", type=int, help="search: most pipeline stages")
    layout.add_argument("--max-cp", type=int, default=16, help="search: largest context-parallel size (default 16)")
    layout.add_argument("--tp-within-node", action="store_true", help="search: tensor-parallel groups in one node")
    layout.add_argument("--top", type=int, default=10, help="rows to print")

    serving = parser.add_argument_group("--inference")
    serving.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    serving.add_argument("--context", type=int, help="tokens of context per sequence (default: the model's)")
    serving.add_argument("--weight-dtype", default="bf16", help="bf16, fp16, fp8, int8, int4, fp32")
    serving.add_argument("--kv-dtype", help="KV cache values (default: as the weights)")
    return parser


def _check(parser, args) -> None:
    positive = ["gpus_per_node", "global_batch", "top", "batch"]
    positive += [key for key in ("gpus", "gpu_mem", "seq_len", "context", "dp", "tp", "pp", "cp", "ep", "max_tp",
                                 "max_pp", "max_cp", "intra_bw", "inter_bw", "peak_tflops", "hbm_bw")
                 if getattr(args, key) is not None]
    for key in positive:
        if getattr(args, key) <= 0:
            parser.error(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    for key in ("micro_batch", "virtual_stages"):
        if any(x < 1 for x in getattr(args, key) or []):
            parser.error(f"--{key.replace('_', '-')} values must be >= 1, got {getattr(args, key)}")
    if args.fit and not args.validate:
        parser.error("--fit refits the free constants on the published runs: use it with --validate")
    if args.validate:
        return
    if args.model is None:
        parser.error("--model is needed (a preset or a config.json), or --validate")
    if not args.inference and args.gpus is None:
        parser.error("--gpus is needed to plan training (or use --inference)")
    if args.evaluate:
        several = [key for key in ("zero", "micro_batch", "recompute", "virtual_stages", "cp_method")
                   if len(getattr(args, key) or []) > 1]
        if several:
            parser.error(f"--evaluate predicts one layout: give one value to --{several[0].replace('_', '-')}")


def _hardware(args) -> dict:
    """The --gpu's figures, with the ones given on the command line instead."""
    given = dict(intra_bw_gbps=args.intra_bw, inter_bw_gbps=args.inter_bw, peak_tflops=args.peak_tflops,
                 hbm_bw_gbps=args.hbm_bw)
    return {**GPUS[args.gpu], **{k: v for k, v in given.items() if v is not None}, "alpha_us": args.alpha_us}


def _cluster(args, gpu_mem=None) -> Cluster:
    options = _hardware(args)
    options["gpu_mem_gib"] = gpu_mem or args.gpu_mem or options["gpu_mem_gib"]
    return Cluster.of(args.gpus or 1, args.gpus_per_node, **options)


def _layout(args, n_gpus: int) -> Layout:
    t, p, c = args.tp or 1, args.pp or 1, args.cp or 1
    if args.dp is None and n_gpus % (t * p * c):
        raise ValueError(f"tp*pp*cp = {t * p * c} does not divide the {n_gpus} GPUs: change --tp, --pp or --cp")
    first = lambda values, default: values[0] if values else default  # noqa: E731
    return Layout(dp=args.dp or n_gpus // (t * p * c), tp=t, pp=p, cp=c, ep=args.ep or 1,
                  zero=first(args.zero, 0), micro_batch=first(args.micro_batch, 1),
                  recompute=RECOMPUTE_NAMES[first(args.recompute, "none")], sequence_parallel=args.sequence_parallel
                  == "yes", cp_method=first(args.cp_method, "ring"), virtual_stages=first(args.virtual_stages, 1),
                  offload=args.offload, tp_overlap=args.tp_overlap == "yes")


def _choices(args) -> dict:
    choices = {key: getattr(args, key) for key in ("dp", "tp", "pp", "cp", "ep", "max_tp", "max_pp", "max_cp")}
    choices["tp_within_node"] = args.tp_within_node
    if args.zero:
        choices["zero_stages"] = tuple(args.zero)
    if args.zero_in_pipeline:
        choices["zero_in_pipeline"] = (0, 1, 2, 3)
    if args.micro_batch:
        choices["micro_batches"] = tuple(args.micro_batch)
    if args.recompute:
        choices["recompute"] = tuple(RECOMPUTE_NAMES[x] for x in args.recompute)
    if args.virtual_stages:
        choices["virtual_stages"] = tuple(args.virtual_stages)
    if args.sequence_parallel:
        choices["sequence_parallel"] = (args.sequence_parallel == "yes",)
    if args.tp_overlap:
        choices["tp_overlap"] = (args.tp_overlap == "yes",)
    if args.cp_method:
        choices["cp_methods"] = tuple(args.cp_method)
    if args.offload:
        choices["offload"] = (False, True)
    return choices


def _model_line(spec, args) -> str:
    return (f"{spec.name}: {count_text(spec.psi)} parameters, {spec.n_layer} layers, h={spec.hidden}, "
            f"{spec.n_head} heads ({spec.kv_heads} key/value), V={spec.vocab_size}, s={spec.seq_len}"
            + (f", {spec.n_experts} experts (top {spec.top_k})" if spec.moe else ""))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    if args.validate:
        return _validate(args)
    try:
        spec = load_model(args.model, args.seq_len)
        if args.inference:
            return _inference(args, spec)
        cluster = _cluster(args)
        options = dict(recipe=args.recipe, efficiency=args.efficiency, overlap=not args.no_overlap,
                       attention=args.attention, reserve_gib=args.reserve_gib, headroom=args.headroom,
                       async_tp_backward=not args.sync_tp_backward, checkpoint_early_stop=args.checkpoint_early_stop)
        if args.evaluate:
            estimate = predict(spec, cluster, _layout(args, cluster.n_gpus), args.global_batch, **options)
            print(json.dumps({"model": spec.name, "cluster": asdict(cluster), "global_batch": args.global_batch,
                              **as_dict(estimate)}, indent=1) if args.json else
                  f"{_model_line(spec, args)}; global batch {args.global_batch}\n{breakdown(estimate, cluster)}")
            return 0
        result = plan(spec, cluster, args.global_batch, **options, **_choices(args))
    except NoLayoutFits as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps({"model": spec.name, "cluster": asdict(cluster), "global_batch": args.global_batch,
                          "layouts": len(result.ranked) + len(result.rejected), "fit": len(result.ranked),
                          "leave_headroom": result.n_roomy,
                          "ranked": [as_dict(e) for e in result.ranked[:args.top]]}, indent=1))
        return 0
    print(f"{_model_line(spec, args)}; global batch {args.global_batch} sequences; {cluster.n_nodes} node(s) x "
          f"{cluster.gpus_per_node} GPUs of {cluster.gpu_mem_gib:g} GiB")
    print(result.table(args.top))
    if args.legend:
        print(legend())
    print(result.explain())
    return 0


def _validate(args) -> int:
    from shardlib.plan.validate import fit, fit_attention, report

    if args.fit:
        print("fitted on the training runs:", fit())
        print("FlashAttention's Triton kernel, fitted on MosaicML's runs at other lengths than 2,048 tokens:",
              {gpu: fit_attention(gpu) for gpu in ("a100", "h100")})
        return 0
    print(report())
    return 0


def _inference(args, spec) -> int:
    options = dict(batch=args.batch, context=args.context, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype)
    if args.tp or args.pp:
        rows = [predict_inference(spec, _cluster(args, args.gpu_mem or 80), tp=args.tp or 1, pp=args.pp or 1,
                                  **options)]
    else:
        hardware = _hardware(args)
        rows = inference_table(spec, gpu_sizes=(args.gpu_mem,) if args.gpu_mem else GPU_SIZES_GIB,
                               **{k: hardware[k] for k in ("intra_bw_gbps", "inter_bw_gbps", "peak_tflops",
                                                           "hbm_bw_gbps", "alpha_us")}, **options)
    if args.json:
        print(json.dumps({"model": spec.name, "rows": [{**asdict(e), "total_bytes": e.total_bytes, "fits": e.fits,
                                                        "sent_per_token": e.sent_per_token} for e in rows]}, indent=1))
        return 0
    context = args.context or spec.seq_len
    print(f"{_model_line(spec, args)}; serving {args.batch} sequence(s) of {context} tokens, weights "
          f"{args.weight_dtype}, KV cache {args.kv_dtype or args.weight_dtype}; per GPU (GiB), bytes sent per "
          f"generated token, decode time per token (roofline)")
    print(format_inference_table(rows))
    return 0
