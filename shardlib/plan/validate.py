"""The planner against the published runs of shardlib/plan/published.py: step-time error, memory, and
where each published layout ranks in the planner's own search; and the fit of the free constants.

    python -m shardlib plan --validate          # both sets: error, fits, rank and gap to the best
    python -m shardlib plan --validate --fit    # refit fitted.py's constants on their runs (prints; edit fitted.py)

validate(run) predicts the published layout (its free knobs chosen by the planner among those the source allows: the
fastest that fits, leaving the headroom free where one does), then ranks it among every layout of the default search
on the same GPUs, model, batch and software (recipe, overlap, attention): rank 1 is the planner's own pick (the
fastest that leaves planner.HEADROOM of the GPU free), and `gap` says how much faster the pick is predicted
(negative: a published layout that fits only in the headroom, faster than the pick). explain() names the single
assumption the pick rests on when it is not the published layout. side_by_side() holds the ranking itself against
layouts of one model timed on one cluster (BLOOM's, before its training): predicted and measured step time, each
over the fastest measured; checkpointing_pairs() holds the planner's most frequent claim on the FSDP runs (drop
activation checkpointing where it fits) against the models MosaicML ran with and without it on the same GPUs of one
table; lean_lines() says which way a set's error leans, per recomputation, where a mean says only how far. fit()
fits fitted.FITTED on the training set, fit_attention() the speed of FlashAttention's Triton kernel
(fitted.ATTENTION_TRITON) on MosaicML's runs at other lengths than 2,048 tokens (mosaic.fsdp_training_runs), never
on a held-out run. sweeps() holds the planner against Megatron-LM's sweeps of Figures 13-15: the order of the predicted
throughputs against the order the paper reports. report() prints the two sets, then the held-out runs of another
engine (mosaic.fsdp_runs(): PyTorch FSDP, as MosaicML ran it) apart, with their own figures.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from shardlib.plan.fitted import FITTED
from shardlib.plan.mosaic import fsdp_runs, fsdp_training_runs
from shardlib.plan.planner import NoLayoutFits, plan, predict
from shardlib.plan.published import (PublishedRun, bloom_layout_search, held_out_runs, megatron_flops, megatron_sweeps,
                                     training_runs)


def _options(run: PublishedRun, constants: dict) -> dict:
    fitted = {**FITTED, **constants}
    return dict(recipe=run.recipe, overlap=run.overlap, attention=run.attention, efficiency=fitted[run.gpu],
                link_efficiency=(fitted["nvlink"], fitted["network"]), hbm_efficiency=fitted["hbm"],
                scatter_gather=run.scatter_gather, overlap_with_pipeline=run.overlap_with_pipeline,
                async_tp_backward=run.async_tp_backward, checkpoint_early_stop=run.checkpoint_early_stop)


def published_estimate(run: PublishedRun, **constants):
    """The published layout's estimate; its free knobs (run.free) set to the fastest choice that fits."""
    lay, options = run.layout, _options(run, constants)
    if not run.free:
        return predict(run.spec, run.cluster, lay, run.global_batch, **options)
    free = run.free
    choices = dict(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, zero_stages=(lay.zero,),
                   sequence_parallel=(lay.sequence_parallel,), cp_methods=(lay.cp_method,),
                   micro_batches=free.get("micro_batch", (lay.micro_batch,)),
                   virtual_stages=free["virtual_stages"] if "virtual_stages" in free else (lay.virtual_stages,),
                   recompute=free.get("recompute", (lay.recompute,)),
                   tp_overlap=free.get("tp_overlap", (lay.tp_overlap,)))
    try:
        return plan(run.spec, run.cluster, run.global_batch, **options, **choices).best
    except NoLayoutFits as error:
        return error.smallest


def validate(run: PublishedRun, rank: bool = True, **constants) -> dict:
    """One row: published and predicted step time, error, memory, whether it fits, its rank in the search."""
    e = published_estimate(run, **constants)
    row = dict(run=run.name, source=run.source, gpus=run.cluster.n_gpus, model=run.spec.name, layout=str(e.layout),
               published=run.published, published_step_s=run.step_s, predicted_step_s=e.step_s,
               error=e.step_s / run.step_s - 1 if run.step_s else None, memory_gib=e.memory_bytes / 2**30,
               fits=e.fits, tight=e.tight, assumed=run.assumed, free=", ".join(run.free), rank=None, gap=None,
               best=None, deciding="", known_miss=run.known_miss, recompute=e.layout.recompute or "none")
    if rank and e.fits and run.step_s:  # memory-only runs (FP8 products, or no step time) are not ranked
        result = plan(run.spec, run.cluster, run.global_batch, **_options(run, constants), **run.search)
        place, found = result.find(e.layout)
        gap = found.step_s / result.best.step_s - 1 if found else None
        row.update(rank=place, best=str(result.best.layout), gap=gap)
        if place != 1:
            row["deciding"] = result.explain(against=e.layout).splitlines()[-1].strip()
    return row


def table(runs: list[PublishedRun], rank: bool = True, **constants) -> list[dict]:
    return [validate(run, rank, **constants) for run in runs]


def summary(rows: list[dict]) -> dict:
    """Mean and largest step-time error of the rows that have a published step time, and the layouts that fail.
    Runs with a `known_miss` are left out of the mean and the largest and listed in `misses` (name, error) instead,
    so that what the targets are met on and what they are not both show."""
    errors = [abs(r["error"]) for r in rows if r["error"] is not None and not r["known_miss"]]
    return dict(mean=sum(errors) / len(errors), max=max(errors), n=len(errors),
                misses=[(r["run"], r["error"]) for r in rows if r["known_miss"] and r["error"] is not None],
                not_fitting=[r["run"] for r in rows if not r["fits"]],
                far=[r["run"] for r in rows if r["gap"] is not None and r["gap"] > 0.05],
                outside=[r["run"] for r in rows if r["fits"] and r["rank"] is None and r["best"] is not None])


def _loss(runs, constants) -> float:
    rows = table(runs, rank=False, **constants)
    return sum(math.log(r["predicted_step_s"] / r["published_step_s"]) ** 2 for r in rows)


def fit(runs: list[PublishedRun] | None = None, step: float = 0.02, passes: int = 10) -> dict:
    """The free constants (shardlib/plan/fitted.py) that minimise the squared log error of step time on
    `runs` (default: the training set): coordinate descent from the stored ones, each constant tried 1 and
    2 steps either way within (0.3, 1], the step halved 5 times, repeated until a pass changes nothing."""
    runs = [r for r in (runs or training_runs()) if r.step_s]
    best = dict(FITTED)
    current = _loss(runs, best)
    for _ in range(passes):
        start, size = dict(best), step
        for _ in range(5):
            for key in best:
                for value in (best[key] + size * k for k in (-2, -1, 1, 2)):
                    if 0.3 <= value <= 1.0:
                        trial = {**best, key: round(value, 4)}
                        loss = _loss(runs, trial)
                        if loss < current:
                            best, current = trial, loss
            size /= 2
        if best == start:
            break
    return best


def attention_loss(gpu: str, fraction: float, runs: list[PublishedRun] | None = None) -> float:
    """Squared log step-time error of the runs of `gpu` (default: mosaic.fsdp_training_runs()) with FlashAttention's
    Triton kernel at `fraction` of the GPU's peak."""
    runs = [r for r in (runs if runs is not None else fsdp_training_runs()) if r.gpu == gpu]
    return _loss([replace(r, cluster=replace(r.cluster, triton_attention=fraction)) for r in runs], {})


def fit_attention(gpu: str, runs: list[PublishedRun] | None = None) -> float:
    """The share of `gpu`'s peak FlashAttention's Triton kernel reaches (fitted.ATTENTION_TRITON): the one that
    minimises attention_loss on MosaicML's runs at other lengths than 2,048 tokens, to 0.01 (a search over 0.04 to
    0.98 by 0.02, then the neighbours of the best)."""
    loss = lambda x: attention_loss(gpu, round(x, 2), runs)  # noqa: E731
    best = min((x / 100 for x in range(4, 100, 2)), key=loss)
    return round(min((best - 0.01, best, best + 0.01), key=loss), 2)


def format_table(rows: list[dict]) -> str:
    """The published runs, one line each: published and predicted step time, error, memory, rank and gap."""
    lines = [f"{'run':<42} {'GPUs':>6} {'published':>26} {'step s':>8} {'pred.':>8} {'error':>7} {'GiB':>6} "
             f"{'fits':>4} {'rank':>5} {'gap':>6}"]  # GiB ...!: it fits only in the headroom (planner.HEADROOM)
    for r in rows:
        step = f"{r['published_step_s']:.2f}" if r["published_step_s"] else "-"
        error = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        gap = f"{r['gap']:.1%}" if r["gap"] is not None else "-"
        lines.append(f"{r['run']:<42} {r['gpus']:>6} {r['published']:>26} {step:>8} {r['predicted_step_s']:>8.2f} "
                     f"{error:>7} {r['memory_gib']:>6.1f}{'!' if r['tight'] else ' '}{'yes' if r['fits'] else 'no':>4} "
                     f"{r['rank'] if r['rank'] else '-':>5} {gap:>6}")
    return "\n".join(lines)


def side_by_side(runs: list[tuple[PublishedRun, float]] | None = None) -> list[dict]:
    """Layouts of one model measured on one cluster (default: published.bloom_layout_search()): for each, the
    measured and predicted step time, each as a ratio to the fastest measured one, and memory measured and
    predicted (GB, 1e9 bytes). A planner is for choosing: these ratios test the choice directly."""
    runs = runs if runs is not None else bloom_layout_search()
    rows = []
    for run, gigabytes in runs:
        e = published_estimate(run)
        rows.append(dict(run=run.name, layout=str(e.layout), heads=run.spec.n_head, measured_s=run.step_s,
                         predicted_s=e.step_s, measured_gb=gigabytes, predicted_gb=e.memory_bytes / 1e9))
    fastest = min(rows, key=lambda r: r["measured_s"])
    for r in rows:
        r["measured_ratio"] = r["measured_s"] / fastest["measured_s"]
        r["predicted_ratio"] = r["predicted_s"] / fastest["predicted_s"]
    return rows


def format_side_by_side(rows: list[dict]) -> str:
    lines = [f"{'layout':<38} {'heads':>5} {'measured s':>10} {'pred. s':>8} {'error':>7} {'measured x':>10} "
             f"{'pred. x':>8} {'GB meas.':>8} {'GB pred.':>8}"]
    for r in rows:
        lines.append(f"{r['layout']:<38} {r['heads']:>5} {r['measured_s']:>10.2f} {r['predicted_s']:>8.2f} "
                     f"{r['predicted_s'] / r['measured_s'] - 1:>+7.1%} {r['measured_ratio']:>10.3f} "
                     f"{r['predicted_ratio']:>8.3f} {r['measured_gb']:>8.0f} {r['predicted_gb']:>8.1f}")
    return "\n".join(lines)


def checkpointing_pairs() -> list[dict]:
    """The claim behind most of the planner's disagreements with the FSDP runs (drop activation checkpointing where
    the activations fit) held against the runs in one table that test it: MPT-7B and -13B on the same 8 GPUs, without
    checkpointing at 2,048 tokens (mosaic.fsdp_runs) and with it at 1,024 and 4,096 (mosaic.fsdp_training_runs). The
    sequence lengths differ, so each pair is compared by MFU (the planner's count of model FLOPs, the same for
    measured and predicted: mfu()), measured (from the published step time) and predicted, without over with.
    The pairs differ in micro-batch and gradient accumulation too: each ratio is that of the whole change, measured
    and predicted alike. `alone`: the planner's ratio for checkpointing alone, the run without it predicted again
    with it, all else held (both fit; no run measured that)."""
    key = lambda run: (run.spec.name, run.cluster.n_gpus, run.source)  # noqa: E731 the same model, GPUs and table
    without = {}
    for run in fsdp_runs():
        if run.layout.recompute is None:
            without.setdefault(key(run), []).append(run)
    rows = []
    for run in fsdp_training_runs():
        if run.layout.recompute != "full" or run.spec.seq_len not in (1024, 4096) or key(run) not in without:
            continue
        assert len(without[key(run)]) == 1, f"more than one run without checkpointing to pair {run.name} with"
        other = without[key(run)][0]
        measured, predicted = [], []
        for r in (other, run):
            e = published_estimate(r)
            measured.append(e.mfu * e.step_s / r.step_s)
            predicted.append(e.mfu)
        added = published_estimate(replace(other, layout=replace(other.layout, recompute="full")))
        rows.append(dict(without=other.name, with_=run.name, mfu_measured=measured, mfu_predicted=predicted,
                         measured=measured[0] / measured[1], predicted=predicted[0] / predicted[1],
                         alone=predicted[0] / added.mfu))
    return rows


def format_checkpointing_pairs(rows: list[dict]) -> str:
    """The pairs as a table: MFU measured and predicted (without checkpointing, with it), and their ratios."""
    w1 = max([36] + [len(r["without"]) for r in rows])
    w2 = max([7] + [len(r["with_"]) for r in rows])
    lines = [f"{'without checkpointing (2,048 tokens)':<{w1}} {'with it':<{w2}} {'MFU measured':>13} "
             f"{'MFU predicted':>13} {'ratio meas.':>11} {'ratio pred.':>11} {'pred. alone':>11}"]
    for r in rows:
        (a, b), (c, d) = r["mfu_measured"], r["mfu_predicted"]
        lines.append(f"{r['without']:<{w1}} {r['with_']:<{w2}} {a:>6.1%} {b:>6.1%} {c:>6.1%} {d:>6.1%} "
                     f"{r['measured']:>11.2f} {r['predicted']:>11.2f} {r['alone']:>11.2f}")
    lines.append("MFU: without checkpointing, then with it; ratio: MFU without over MFU with (the whole change: "
                 "length, micro-batch, accumulation); alone: the planner's ratio for checkpointing alone, the run "
                 "without it predicted again with it")
    return "\n".join(lines)


def sweeps() -> list[dict]:
    """Megatron-LM's sweeps of Figures 13-15 (published.megatron_sweeps()): per figure and batch, the planner's
    TFLOP/s per GPU for each layout (counted as the paper counts them, eq. 3) and whether their order is the one
    the paper reports: the fastest at the claimed layout ("peak"), or each slower than the one before ("falling"),
    and by how much at the closest ("margin": the claimed layout over the fastest other, or the smallest step down)."""
    rows = []
    for figure, batch, order, index, words, runs in megatron_sweeps():
        spec = runs[0].spec
        flops = megatron_flops(batch, spec.seq_len, spec.n_layer, spec.hidden, spec.vocab_size)
        tflops = [flops / (run.cluster.n_gpus * published_estimate(run).step_s) / 1e12 for run in runs]
        if order == "peak":  # the claimed layout against the fastest of the others
            margin = tflops[index] / max(x for i, x in enumerate(tflops) if i != index) - 1
        else:  # each layout against the next
            margin = min(a / b - 1 for a, b in zip(tflops, tflops[1:]))
        rows.append(dict(figure=figure, batch=batch, layouts=[f"dp{r.layout.dp} tp{r.layout.tp} pp{r.layout.pp}" for r in runs],
                         tflops=tflops, claim=words, holds=margin > 0, margin=margin))
    return rows


def format_sweeps(rows: list[dict]) -> str:
    lines = ["predicted TFLOP/s per GPU, counted as the paper counts them (eq. 3), layout by layout:"]
    for r in rows:
        cells = "  ".join(f"{name} {x:.0f}" for name, x in zip(r["layouts"], r["tflops"]))
        verdict = f"holds, by {r['margin']:.1%} at the closest" if r["holds"] else f"does not hold ({r['margin']:+.1%})"
        lines.append(f"Figure {r['figure']}, batch {r['batch']:>3}: {cells}  {verdict}")
    claims = {r["figure"]: r["claim"] for r in rows}
    return "\n".join(lines + [f"  Figure {k}: \"{v}\"" for k, v in claims.items()])


def slot_split(runs: list[PublishedRun]) -> dict:
    """Where the time of one pipeline's step goes, over runs of one model and stage count that differ in the number
    of micro-batches m: least squares of step = per_slot (m + (p - 1) / v) + per_step, for the published and the
    predicted step times. A 1F1B step is m + (p - 1) / v slots of one micro-batch's forward and backward (the bubble
    included); what does not grow with m (the gradient reduction after the drain, the optimizer) is per step. So a
    miss in per_slot is a cost of every micro-batch, a miss in per_step one of every step."""
    slots, published, predicted = [], [], []
    for run in runs:
        estimate = published_estimate(run)
        lay = estimate.layout
        slots.append(run.global_batch / (lay.dp * lay.micro_batch) + (lay.pp - 1) / lay.virtual_stages)
        published.append(run.step_s)
        predicted.append(estimate.step_s)
    if len(set(slots)) < 2:
        raise ValueError("slot_split needs runs with at least two different numbers of micro-batches")

    def line(steps):
        fit = statistics.linear_regression(slots, steps)
        return dict(per_slot=fit.slope, per_step=fit.intercept)

    return dict(slots=slots, published=line(published), predicted=line(predicted))


def per_sequence(run: PublishedRun) -> float:
    """Published seconds per sequence through one pipeline, everything in the step included (the bubble, the
    reduction, the optimizer): step / (global batch / dp). An upper bound on what one sequence's pass costs there."""
    return run.step_s * run.layout.dp / run.global_batch


def same_shape_runs(group: list[PublishedRun]) -> list[PublishedRun]:
    """Published runs of both sets, outside `group` and missed by none, of the group's model shape (layers, hidden,
    heads, sequence), tensor- and pipeline-parallel sizes, recomputation and GPU: the same work per sequence on
    each stage, run by another engine (the micro-batch is left out: not every source publishes it). What they took
    per sequence is measured, not predicted."""
    key = lambda run: (run.spec.n_layer, run.spec.hidden, run.spec.n_head, run.spec.seq_len, run.layout.tp,  # noqa
                       run.layout.pp, run.layout.recompute, run.gpu, run.cluster.gpu_mem_gib)
    keys, names = {key(run) for run in group}, {run.name for run in group}
    return [run for run in training_runs() + held_out_runs()
            if key(run) in keys and run.name not in names and not run.known_miss]


def misses_lines(rows: list[dict], runs: list[PublishedRun] | None = None) -> list[str]:
    """The runs left out of the error figures (known_miss), each with its error, and why once per reason; with the
    runs (`runs`, the same as the rows'), a reason shared by pipelines of one model at several sizes is followed by
    its slot_split: which part of the step the miss is in."""
    reasons, missed = {}, {}
    by_name = {run.name: run for run in runs or []}
    for r in rows:
        if r["known_miss"] and r["error"] is not None:
            reasons.setdefault(r["known_miss"], []).append(f"{r['run']} ({r['error']:+.1%})")
            if r["run"] in by_name:
                missed.setdefault(r["known_miss"], []).append(by_name[r["run"]])
    lines = []
    for why, names in reasons.items():
        lines.append(f"  missed, outside these figures: {', '.join(names)}: {why}")
        group = missed.get(why, [])
        if len({run.spec.name for run in group}) == 1 and len({run.global_batch / run.layout.dp for run in group}) > 1:
            split = slot_split(group)
            lines.append(f"    step = s (m + (p - 1) / v) + r over these {len(group)} runs (least squares; m "
                         f"micro-batches): published s = {split['published']['per_slot']:.3f} s, r = "
                         f"{split['published']['per_step']:.1f} s; predicted s = {split['predicted']['per_slot']:.3f}"
                         f" s, r = {split['predicted']['per_step']:.1f} s")
            others = same_shape_runs(group)
            if others:
                mine = [per_sequence(run) for run in group]
                lines.append(f"    published seconds per sequence through one pipeline, bubble and step included "
                             f"(step x dp / batch), the same shape, t, p and recomputation on the same GPUs: "
                             + ", ".join(f"{run.name} {per_sequence(run):.3f} s" for run in others)
                             + f"; these runs {min(mine):.3f} to {max(mine):.3f} s")
    return lines


def lean_lines(rows: list[dict]) -> list[str]:
    """Which way the error leans, by how much each layout recomputes: the signed step-time error (negative:
    predicted faster than published) of the runs in the figures, per recomputation. A mean near zero with a wide
    spread is noise; a group all on one side is something the model does not count for that group."""
    groups = {}
    for r in rows:
        if r["error"] is not None and not r["known_miss"]:
            groups.setdefault(r["recompute"], []).append(r["error"])
    return [f"  recomputation {name}: {len(errors)} runs, error mean {sum(errors) / len(errors):+.1%}, from "
            f"{min(errors):+.1%} to {max(errors):+.1%}" for name, errors in sorted(groups.items())]


def ranking_line(rows: list[dict]) -> str:
    """How many published layouts are predicted within 5% of the planner's pick, and which are further (gap)."""
    ranked = [r for r in rows if r["gap"] is not None]
    far = [f"{r['run']} ({r['gap']:+.1%})" for r in ranked if r["gap"] > 0.05]
    return (f"published layouts within 5% of the planner's pick: {len(ranked) - len(far)} of {len(ranked)}"
            + (f"; further: {', '.join(far)}" if far else ""))


def report(rank: bool = True) -> str:
    """Each set, its summary, and for every run whose layout is not the planner's pick, what decides it."""
    out = []
    groups = (("training set (fits shardlib/plan/fitted.py)", training_runs()), ("held-out set", held_out_runs()),
              ("held-out set, another engine: PyTorch FSDP in MosaicML's Composer (llm-foundry's benchmark tables, "
               "its attention kernel fitted on their other sequence lengths)", fsdp_runs()))
    for title, runs in groups:
        rows = table(runs, rank)
        s = summary(rows)
        out += [title, format_table(rows),
                f"step-time error over {s['n']} runs: mean {s['mean']:.1%}, max {s['max']:.1%}; published layouts "
                f"predicted not to fit: {s['not_fitting'] or 'none'}",
                ranking_line(rows)]
        out += lean_lines(rows) + misses_lines(rows, runs)
        out += [f"  {r['run']}: {r['layout']}; the planner's pick {r['best']}; {r['deciding']}" for r in rows
                if r["deciding"]]
        free = sorted({r["free"] for r in rows if r["free"]})
        out += [f"  chosen by the planner where not published: {f}" for f in free] + [""]
    out += ["BLOOM's layouts timed side by side on its cluster, held out (x: step time over the fastest measured; "
            "GB: the most a GPU used, as its chronicle reports it, and the planner's memory)",
            format_side_by_side(side_by_side()), "",
            "The FSDP runs' activation checkpointing: one model on the same 8 GPUs of one table without it "
            "(2,048 tokens) and with it (1,024 and 4,096 tokens), MFU measured and predicted, and without over with",
            format_checkpointing_pairs(checkpointing_pairs()), "",
            "Megatron-LM's sweeps on 64 A100 of the training set's cluster (predicted TFLOP/s per GPU; the paper's "
            "plots are held by the order its text reports, quoted)",
            format_sweeps(sweeps())]
    return "\n".join(out)

