"""The layout planner: which data, tensor and pipeline parallel sizes, ZeRO stage, micro-batch and
recomputation to use for a job, with memory and step time predicted from the course's formulas.

    inputs.py    what the planner reads: ModelSpec (presets, Hugging Face configs), Cluster, Layout
    planner.py   the cost model (memory, step time), the search, Plan
    report.py    the ranked table, and why the best layout wins
    cli.py       the command line (`python -m shardlib plan`)
"""

from shardlib.plan.cli import main
from shardlib.plan.inputs import PRESETS, Cluster, GiB, Layout, ModelSpec, count_text, load_model
from shardlib.plan.planner import Estimate, NoLayoutFits, Plan, candidate_layouts, check_layout, evaluate, plan, predict
from shardlib.plan.report import explain, format_table

__all__ = ["PRESETS", "Cluster", "GiB", "Layout", "ModelSpec", "load_model", "Estimate", "NoLayoutFits", "Plan",
           "candidate_layouts", "check_layout", "count_text", "evaluate", "plan", "predict", "explain",
           "format_table", "main"]
