"""The layout planner: which data, context, tensor, pipeline and expert parallel sizes, ZeRO stage,
micro-batch, interleaving, recomputation, overlap and offload to use for a job, with memory and step
time predicted from the course's formulas; and, for inference, weights and KV cache per GPU.

    model.py      ModelSpec (a transformer by its sizes: presets, Hugging Face configs)
    inputs.py     Cluster (and the GPUS it can be), Layout
    gemm.py       how long one GPU takes for a matrix product of a given shape
    compute.py    one layer of one micro-batch: products, attention, memory-bound kernels, activations
    links.py      ring collectives over the links, and what overlap with compute really hides
    cost_comm.py  every collective of a pipeline stage and the seconds it adds
    cost.py       the cost model: memory, bytes sent, step time of layouts (named dataclasses)
    fitted.py     its free constants, fitted on published runs
    rules.py      what can run: check_layout and the options
    planner.py    the search: candidate layouts, predict one, plan (rank what fits)
    ledger.py     per_gpu: one GPU's memory and collectives item by item, to hold against a measurement
    published.py  published training runs, a training set and a held-out set
    mosaic.py     MosaicML's FSDP benchmarks: another engine, held out apart, and its attention kernel's fit
    validate.py   the planner against them: error, memory, rank of the published layout; the fit
    inference.py  serving: weights + KV cache per GPU, bytes per token under TP and PP
    report.py     the ranked table and its legend, why the best layout wins, one layout's breakdown
    cli.py        the command line (`python -m shardlib plan`)
"""

from shardlib.plan.cli import main
from shardlib.plan.cost import Costs, Memory, StepTime, Traffic
from shardlib.plan.inference import InferenceEstimate, inference_table, predict_inference
from shardlib.plan.inputs import GPUS, PRESETS, Cluster, GiB, Layout, ModelSpec, count_text, load_model
from shardlib.plan.ledger import per_gpu
from shardlib.plan.planner import HEADROOM, Estimate, NoLayoutFits, Plan, candidate_layouts, check_layout, plan, predict
from shardlib.plan.report import LEGEND, breakdown, explain, format_table, legend

__all__ = ["HEADROOM", "GPUS", "PRESETS", "Cluster", "GiB", "Layout", "ModelSpec", "load_model", "Estimate", "NoLayoutFits",
           "Plan", "Costs", "Memory", "StepTime", "Traffic", "candidate_layouts", "check_layout", "count_text", "plan",
           "predict", "per_gpu", "breakdown", "explain", "format_table", "legend", "LEGEND", "main",
           "InferenceEstimate", "inference_table", "predict_inference"]
