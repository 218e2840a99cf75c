"""Pipeline schedules: the order in which each stage runs forwards and backwards, and what it costs.

A schedule gives each stage s of p a list of actions ("F", i) / ("B", i) over the m
micro-batches i = 0 .. m-1; shardlib/parallel/pipeline.py runs these lists on real ranks. Here are
the lists, the formulas they are held against, and the tools to read a timeline:

    naive  F0 B0 F1 B1 ...      one micro-batch in the whole pipeline at a time
    gpipe  F0 .. Fm-1 B0 .. Bm-1   all forwards, then all backwards (Huang et al., arXiv 1811.06965)
    1f1b   p-s-1 forwards of warm-up, then one forward and one backward in turn, then the
           last backwards (PipeDream-Flush; Narayanan et al., arXiv 2104.04473, Section 2.2)

With a forward taking t_f and a backward t_b on every stage, and no time for communication,
a step lasts (m + p - 1)(t_f + t_b) for GPipe and 1F1B, of which each stage works m(t_f + t_b):

    bubble fraction (idle / total)   naive (p-1)/p      gpipe, 1f1b (p-1)/(m+p-1)
    micro-batches stashed at once    naive 1            gpipe m     1f1b min(p - s, m) <= p

GPipe and 1F1B have the same bubble; 1F1B stashes the activations of at most p micro-batches
(stage 0 holds p, the last stage 1) where GPipe holds all m, so m can grow, and the bubble
shrink, without the activation memory growing with it.
"""

from __future__ import annotations

from typing import NamedTuple

Action = tuple[str, int]  # ("F", micro-batch) or ("B", micro-batch)


class Event(NamedTuple):
    """One action as it ran: `rank` ran `op` ("F"/"B") on `microbatch` from `start` to `end` (s)."""

    rank: int
    op: str
    microbatch: int
    start: float
    end: float


# ---------------------------------------------------------------------------------
# the schedules


def _check(num_stages: int, n_microbatches: int, stage_index: int) -> None:
    if num_stages < 1 or n_microbatches < 1:
        raise ValueError(f"need num_stages >= 1 and n_microbatches >= 1, got {num_stages} and {n_microbatches}")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in 0..{num_stages - 1}, got {stage_index}")


def schedule_naive(num_stages: int, n_microbatches: int, stage_index: int) -> list[Action]:
    """Naive model parallelism: each micro-batch goes forward and back through every stage
    before the next one starts, so only one stage is ever busy."""
    _check(num_stages, n_microbatches, stage_index)
    return [action for i in range(n_microbatches) for action in (("F", i), ("B", i))]


def schedule_gpipe(num_stages: int, n_microbatches: int, stage_index: int) -> list[Action]:
    """GPipe: every forward, then every backward (same micro-batch order on every stage)."""
    _check(num_stages, n_microbatches, stage_index)
    return [("F", i) for i in range(n_microbatches)] + [("B", i) for i in range(n_microbatches)]


def schedule_1f1b(num_stages: int, n_microbatches: int, stage_index: int) -> list[Action]:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward / one backward, then cool-down.

    Stage s runs min(p - s - 1, m) forwards before its first backward, so that the backward
    of micro-batch 0 comes back from the last stage just as it is needed; from then on each
    forward is followed by the backward of the oldest micro-batch still stashed.
    """
    _check(num_stages, n_microbatches, stage_index)
    warmup = min(num_stages - stage_index - 1, n_microbatches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(n_microbatches - warmup):  # steady state
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(n_microbatches - warmup, n_microbatches)]  # cool-down
    return actions


SCHEDULES = {"naive": schedule_naive, "gpipe": schedule_gpipe, "1f1b": schedule_1f1b}


def get_schedule(schedule):
    """A schedule by name ("naive", "gpipe", "1f1b") or a function (p, m, stage) -> actions."""
    if callable(schedule):
        return schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {sorted(SCHEDULES)} "
                         "or a function (num_stages, n_microbatches, stage_index) -> [(op, i), ...]")
    return SCHEDULES[schedule]


def check_actions(actions: list[Action], n_microbatches: int, stage_index: int = 0) -> None:
    """Raise ValueError unless `actions` runs F then B once for each micro-batch, forwards in
    micro-batch order and backwards in micro-batch order (the order messages travel in)."""
    where = f"stage {stage_index}'s schedule"
    unknown = sorted({str(o) for o, _ in actions} - {"F", "B"})
    if unknown:
        raise ValueError(f"{where} has unknown operations {unknown}: use 'F' and 'B'")
    for op in ("F", "B"):
        order = [i for o, i in actions if o == op]
        if order != list(range(n_microbatches)):
            raise ValueError(f"{where} runs {op} on micro-batches {order}: it must run {op} once on each of "
                             f"0..{n_microbatches - 1}, in that order")
    position = {action: k for k, action in enumerate(actions)}
    early = [i for i in range(n_microbatches) if position[("B", i)] < position[("F", i)]]
    if early:
        raise ValueError(f"{where} runs the backward of micro-batches {early} before their forward")


# ---------------------------------------------------------------------------------
# formulas


def bubble_formula(num_stages: int, n_microbatches: int, schedule: str = "1f1b") -> float:
    """Idle fraction of a step on every stage, equal work per stage, free communication."""
    p, m = num_stages, n_microbatches
    if schedule == "naive":
        return (p - 1) / p
    return (p - 1) / (m + p - 1)


def stash_formula(num_stages: int, n_microbatches: int, stage_index: int, schedule: str = "1f1b") -> int:
    """Most micro-batches whose activations stage `stage_index` holds at once."""
    p, m, s = num_stages, n_microbatches, stage_index
    return {"naive": 1, "gpipe": m, "1f1b": min(p - s, m)}[schedule]


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches forwarded and not yet backwarded at any point of an action list."""
    live, peak = 0, 0
    for op, _ in actions:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------------------------
# timelines


def simulate(schedule, num_stages: int, n_microbatches: int, t_forward: float = 1.0,
             t_backward: float = 2.0, t_comm: float = 0.0) -> list[Event]:
    """The timeline of ideal devices running `schedule`: each action starts as soon as its
    stage is free and its input has arrived (t_comm after the neighbour finished).

    Raises RuntimeError if the lists can never finish (a deadlock: every stage waits).
    """
    order = [get_schedule(schedule)(num_stages, n_microbatches, s) for s in range(num_stages)]
    done: dict[tuple[int, str, int], float] = {}
    free, position, events = [0.0] * num_stages, [0] * num_stages, []
    while any(position[s] < len(order[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            while position[s] < len(order[s]):
                op, i = order[s][position[s]]
                needs = [(s - 1, "F", i)] if op == "F" and s > 0 else []
                needs += [(s + 1, "B", i)] if op == "B" and s < num_stages - 1 else []
                needs += [(s, "F", i)] if op == "B" else []
                if any(n not in done for n in needs):
                    break
                ready = max([free[s]] + [done[n] + (t_comm if n[0] != s else 0.0) for n in needs])
                end = ready + (t_forward if op == "F" else t_backward)
                events.append(Event(s, op, i, ready, end))
                done[(s, op, i)], free[s], position[s], progressed = end, end, position[s] + 1, True
        if not progressed:
            stuck = {s: order[s][position[s]] for s in range(num_stages) if position[s] < len(order[s])}
            raise RuntimeError(f"the schedule deadlocks: each stage waits for another; next actions {stuck}")
    return events


def measured_bubble(timeline: list[Event]) -> dict[int, float]:
    """Idle fraction of each rank: 1 - (its busy time) / (first start to last end, all ranks)."""
    start, end = min(e.start for e in timeline), max(e.end for e in timeline)
    busy: dict[int, float] = {}
    for e in timeline:
        busy[e.rank] = busy.get(e.rank, 0.0) + (e.end - e.start)
    return {rank: 1.0 - b / (end - start) for rank, b in sorted(busy.items())}


def plot_timeline(timeline: list[Event], ax=None, title: str | None = None, label_microbatches: bool = True,
                  xlabel: str = "seconds"):
    """Draw a timeline as a Gantt chart: one row per rank (rank 0 on top), forwards in blue,
    backwards in orange, each box labelled with its micro-batch; white is idle (the bubble)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * (1 + max(e.rank for e in timeline))))
    origin = min(e.start for e in timeline)
    span = max(e.end for e in timeline) - origin
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for e in timeline:
        ax.barh(e.rank, e.end - e.start, left=e.start - origin, height=0.8, color=colors[e.op],
                edgecolor="white", linewidth=0.5)
        if label_microbatches and (e.end - e.start) > 0.02 * span:
            ax.text((e.start + e.end) / 2 - origin, e.rank, str(e.microbatch), ha="center", va="center",
                    fontsize=7, color="white", clip_on=True)
    ranks = sorted({e.rank for e in timeline})
    ax.set_yticks(ranks, [f"stage {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_xlim(0, span)
    ax.set_xlabel(xlabel)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
              labels=["F", "B"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
