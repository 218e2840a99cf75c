"""The layout planner: which data, context, tensor, pipeline and expert parallel sizes, ZeRO stage,
micro-batch, interleaving, recomputation and offload to use for a job, with memory and step time
predicted from the course's formulas; and, for inference, weights and KV cache per GPU.

    model.py      ModelSpec (a transformer by its sizes: presets, Hugging Face configs)
    inputs.py     Cluster, Layout
    cost.py       the cost model: memory, bytes sent, step time of layouts (named dataclasses)
    planner.py    the search: candidate layouts, predict one, plan (rank what fits)
    inference.py  serving: weights + KV cache per GPU, bytes per token under TP and PP
    report.py     the ranked table, why the best layout wins, one layout's breakdown
    cli.py        the command line (`python -m shardlib plan`)
"""

from shardlib.plan.cli import main
from shardlib.plan.cost import Costs, Memory, StepTime, Traffic
from shardlib.plan.inference import InferenceEstimate, inference_table, predict_inference
from shardlib.plan.inputs import PRESETS, Cluster, GiB, Layout, ModelSpec, count_text, load_model
from shardlib.plan.planner import Estimate, NoLayoutFits, Plan, candidate_layouts, check_layout, plan, predict
from shardlib.plan.report import breakdown, explain, format_table

__all__ = ["PRESETS", "Cluster", "GiB", "Layout", "ModelSpec", "load_model", "Estimate", "NoLayoutFits", "Plan",
           "Costs", "Memory", "StepTime", "Traffic", "candidate_layouts", "check_layout", "count_text", "plan",
           "predict", "breakdown", "explain", "format_table", "main", "InferenceEstimate", "inference_table",
           "predict_inference"]
