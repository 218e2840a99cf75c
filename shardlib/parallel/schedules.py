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

Two schedules go further; their actions carry a third element, the chunk (op, i, chunk):

    interleaved    each rank holds v chunks of layers, rank s holding virtual stages s, s+p, ...,
                   s+(v-1)p; 1F1B over the v*m chunk-micro-batches in Megatron-LM's order
                   (Narayanan et al., arXiv 2104.04473, Section 2.2.2). Each chunk takes 1/v of the
                   time, so warm-up and cool-down shrink v-fold: bubble (p-1)/(v m + p - 1), i.e.
                   (p-1)/(v m) of the ideal time, for v times the messages; needs m divisible by p.
                   Stage s stashes min(2(p-s-1) + (v-1)p + 1, v m) chunk-micro-batches, each 1/v of
                   a stage: p + (p-1)/v micro-batches' worth on stage 0 against 1F1B's p. More
                   activation memory, not less.
    zero-bubble    ZB-H1 (Qi et al., arXiv 2401.10241, Section 3.1): backward split into B (the input
                   gradient, which the previous stage waits for) and W (the weight gradient, which
                   nobody waits for); stage s runs 1F1B's F and B and delays each W by s steps, so the
                   W's fill the cool-down. With t_B = t_b + t_w (B then W): a step lasts
                   m(t_f + t_b + t_w) + (p-1)(t_f + t_b - t_w) (for t_w <= t_f), against 1F1B's
                   (m + p - 1)(t_f + t_b + t_w): a third of the bubble when t_f = t_b = t_w. Each
                   stage holds p micro-batches (forward done, W not yet) where 1F1B holds p - s.
"""

from __future__ import annotations

from typing import NamedTuple

Action = tuple  # ("F" | "B" | "W", micro-batch) or ("F" | "B" | "W", micro-batch, chunk)


class Event(NamedTuple):
    """One action as it ran: `rank` ran `op` ("F"/"B"/"W") on `microbatch` (of `chunk`) from `start` to `end` (s)."""

    rank: int
    op: str
    microbatch: int
    start: float
    end: float
    chunk: int = 0


def unpack(action) -> tuple[str, int, int]:
    """(op, micro-batch, chunk) of an action of two or three elements (chunk 0 by default)."""
    return (action[0], action[1], action[2] if len(action) > 2 else 0)


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


def schedule_interleaved_1f1b(num_stages: int, n_microbatches: int, stage_index: int,
                              virtual_stages: int = 2) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., Section 2.2.2), in Megatron-LM's order: the k-th forward of
    a rank runs chunk (k // p) % v on micro-batch (k // (p v)) p + k % p; backwards walk the chunks in
    reverse. Warm-up: 2(p - s - 1) + (v - 1) p forwards, then one forward / one backward."""
    _check(num_stages, n_microbatches, stage_index)
    p, m, v = num_stages, n_microbatches, virtual_stages
    if not isinstance(v, int) or v < 2:
        raise ValueError(f"virtual_stages must be an integer >= 2 (for v = 1 use '1f1b'), got {v!r}")
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches round in groups of p = {p}: n_microbatches must "
                         f"be a multiple of {p}, got {m}")

    def forward(k):
        group, r = divmod(k, p * v)
        return ("F", group * p + r % p, r // p)

    def backward(k):
        _, i, chunk = forward(k)
        return ("B", i, v - 1 - chunk)

    total = m * v
    warmup = min(2 * (p - stage_index - 1) + (v - 1) * p, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    return actions + [backward(k) for k in range(total - warmup, total)]


def schedule_zero_bubble(num_stages: int, n_microbatches: int, stage_index: int) -> list[Action]:
    """ZB-H1 (Qi et al., Section 3.1): 1F1B's forwards and input-gradient backwards B, each weight-gradient
    W run after the B it belongs to, delayed by `stage_index` B's; the remaining W's close the step."""
    _check(num_stages, n_microbatches, stage_index)
    p, m, s = num_stages, n_microbatches, stage_index
    warmup = min(p - s - 1, m)
    actions, b, w = [("F", i) for i in range(warmup)], 0, 0
    for i in range(warmup, m + warmup):
        if i < m:
            actions.append(("F", i))
        actions.append(("B", b))
        b += 1
        if b - w > s:  # W trails B by s micro-batches on stage s
            actions.append(("W", w))
            w += 1
    return actions + [("W", i) for i in range(w, m)]


SCHEDULES = {"naive": schedule_naive, "gpipe": schedule_gpipe, "1f1b": schedule_1f1b,
             "interleaved": schedule_interleaved_1f1b, "zero-bubble": schedule_zero_bubble}


def get_schedule(schedule):
    """A schedule by name ("naive", "gpipe", "1f1b", "interleaved" with v = 2, "zero-bubble") or a
    function (p, m, stage) -> actions (functools.partial(schedule_interleaved_1f1b, virtual_stages=v))."""
    if callable(schedule):
        return schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {sorted(SCHEDULES)} "
                         "or a function (num_stages, n_microbatches, stage_index) -> [(op, i), ...]")
    return SCHEDULES[schedule]


def check_actions(actions: list[Action], n_microbatches: int, stage_index: int = 0) -> None:
    """Raise ValueError unless `actions` runs, for each chunk, F then B (then W, if the schedule splits
    backward) once on each micro-batch, forwards and backwards in micro-batch order (the order
    messages travel in)."""
    where = f"stage {stage_index}'s schedule"
    actions = [unpack(a) for a in actions]
    unknown = sorted({str(o) for o, _, _ in actions} - {"F", "B", "W"})
    if unknown:
        raise ValueError(f"{where} has unknown operations {unknown}: use 'F', 'B' (and 'W')")
    chunks = sorted({c for _, _, c in actions})
    if chunks != list(range(len(chunks))):
        raise ValueError(f"{where} uses chunks {chunks}: number them 0..v-1")
    split = any(o == "W" for o, _, _ in actions)
    for chunk in chunks:
        for op in ("F", "B", "W") if split else ("F", "B"):
            order = [i for o, i, c in actions if o == op and c == chunk]
            if sorted(order) != list(range(n_microbatches)) or (op != "W" and order != sorted(order)):
                raise ValueError(f"{where} runs {op} of chunk {chunk} on micro-batches {order}: it must run {op} "
                                 f"once on each of 0..{n_microbatches - 1}" + ("" if op == "W" else ", in that order"))
    position = {action: k for k, action in enumerate(actions)}
    names = {"F": "forward", "B": "backward", "W": "weight gradient (W)"}
    for first, then in (("F", "B"), ("B", "W")) if split else (("F", "B"),):
        early = [i if len(chunks) == 1 else (i, c) for i in range(n_microbatches) for c in chunks
                 if position[(then, i, c)] < position[(first, i, c)]]
        if early:
            raise ValueError(f"{where} runs the {names[then]} of micro-batches {early} before their {names[first]}")


# ---------------------------------------------------------------------------------
# formulas


def bubble_formula(num_stages: int, n_microbatches: int, schedule: str = "1f1b", *, virtual_stages: int = 2,
                   t_forward: float = 1.0, t_backward: float = 2.0, t_weight: float | None = None) -> float:
    """Idle fraction of a step on every stage, equal work per stage, free communication.

    interleaved: v = virtual_stages chunks per rank. zero-bubble: t_backward is the whole backward
    (B + W), t_weight its W part (default half of it, the paper's t_b = t_w); the formula holds for
    t_weight <= t_forward. The other schedules do not depend on the times.
    """
    p, m = num_stages, n_microbatches
    if schedule == "naive":
        return (p - 1) / p
    if schedule == "interleaved":
        return (p - 1) / (virtual_stages * m + p - 1)
    if schedule == "zero-bubble":
        t_w = t_backward / 2 if t_weight is None else t_weight
        idle = (p - 1) * (t_forward + (t_backward - t_w) - t_w)
        return idle / (m * (t_forward + t_backward) + idle)
    return (p - 1) / (m + p - 1)


def stash_formula(num_stages: int, n_microbatches: int, stage_index: int, schedule: str = "1f1b", *,
                  virtual_stages: int = 2) -> int:
    """Most micro-batches whose activations stage `stage_index` holds at once (interleaved: chunk-micro-batches,
    each 1/v of the stage's activations; zero-bubble: forwarded and not yet through W)."""
    p, m, s, v = num_stages, n_microbatches, stage_index, virtual_stages
    table = {"naive": lambda: 1, "gpipe": lambda: m, "1f1b": lambda: min(p - s, m),
             "interleaved": lambda: min(2 * (p - s - 1) + (v - 1) * p + 1, v * m), "zero-bubble": lambda: min(p, m)}
    return table[schedule]()


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches forwarded and not yet backwarded (through W, when backward is split) at any point."""
    split = any(unpack(a)[0] == "W" for a in actions)
    live, peak = 0, 0
    for action in actions:
        op = unpack(action)[0]
        live += 1 if op == "F" else (-1 if op == ("W" if split else "B") else 0)
        peak = max(peak, live)
    return peak


def message_order_problems(schedule, num_stages: int, n_microbatches: int) -> list[str]:
    """Point-to-point messages between two ranks are matched in the order they are posted (gloo, NCCL):
    for every pair, the sender's order of sends must be the receiver's order of receives. Returns
    what differs (empty when the schedule is safe to run)."""
    p = num_stages
    order = [[unpack(a) for a in get_schedule(schedule)(p, n_microbatches, s)] for s in range(p)]
    v = 1 + max(c for actions in order for _, _, c in actions)
    last = v * p - 1  # the last virtual stage
    sent = {(a, b): [] for a in range(p) for b in range(p)}
    received = {(a, b): [] for a in range(p) for b in range(p)}
    for s, actions in enumerate(order):
        for op, i, c in actions:
            k = c * p + s  # virtual stage
            if op == "F" and k < last:
                sent[s, (s + 1) % p].append(("activation", i, k + 1))
            if op == "F" and k > 0:
                received[(s - 1) % p, s].append(("activation", i, k))
            if op == "B" and k > 0:
                sent[s, (s - 1) % p].append(("gradient", i, k - 1))
            if op == "B" and k < last:
                received[(s + 1) % p, s].append(("gradient", i, k))
    return [f"rank {a} sends {sent[a, b][:4]}... but rank {b} receives {received[a, b][:4]}..."
            for (a, b) in sent if sent[a, b] != received[a, b]]


# ---------------------------------------------------------------------------------
# timelines


def simulate(schedule, num_stages: int, n_microbatches: int, t_forward: float = 1.0,
             t_backward: float = 2.0, t_comm: float = 0.0, t_weight: float | None = None) -> list[Event]:
    """The timeline of ideal devices running `schedule`: each action starts as soon as its
    stage is free and its input has arrived (t_comm after the neighbour finished).

    t_forward, t_backward: one micro-batch through a whole stage; a chunk of an interleaved schedule
    takes 1/v of them. Split backward (W actions): B takes t_backward - t_weight and W t_weight
    (default t_backward / 2). Raises RuntimeError if the lists can never finish (a deadlock).
    """
    p = num_stages
    order = [[unpack(a) for a in get_schedule(schedule)(p, n_microbatches, s)] for s in range(p)]
    v = 1 + max(c for actions in order for _, _, c in actions)
    split = any(op == "W" for actions in order for op, _, _ in actions)
    t_w = (t_backward / 2 if t_weight is None else t_weight) if split else 0.0
    duration = {"F": t_forward / v, "B": (t_backward - t_w) / v, "W": t_w / v}
    done: dict[tuple[int, str, int], float] = {}  # (virtual stage, op, micro-batch) -> end
    free, position, events = [0.0] * p, [0] * p, []
    while any(position[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(order[s]):
                op, i, c = order[s][position[s]]
                k = c * p + s  # virtual stage: chunk c of rank s
                needs = [(k - 1, "F", i)] if op == "F" and k > 0 else []
                needs += [(k + 1, "B", i)] if op == "B" and k < v * p - 1 else []
                needs += [(k, "F", i)] if op == "B" else []
                needs += [(k, "B", i)] if op == "W" else []
                if any(n not in done for n in needs):
                    break
                ready = max([free[s]] + [done[n] + (t_comm if n[0] % p != s else 0.0) for n in needs])
                end = ready + duration[op]
                events.append(Event(s, op, i, ready, end, c))
                done[(k, op, i)], free[s], position[s], progressed = end, end, position[s] + 1, True
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
    backwards in orange (weight gradients W in green), odd chunks of an interleaved schedule
    hatched, each box labelled with its micro-batch; white is idle (the bubble)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * (1 + max(e.rank for e in timeline))))
    origin = min(e.start for e in timeline)
    span = max(e.end for e in timeline) - origin
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    colors = {op: color for op, color in colors.items() if any(e.op == op for e in timeline)}
    for e in timeline:
        ax.barh(e.rank, e.end - e.start, left=e.start - origin, height=0.8, color=colors[e.op],
                edgecolor="white", linewidth=0.5, hatch="///" if e.chunk % 2 else None)
        if label_microbatches and (e.end - e.start) > 0.02 * span:
            ax.text((e.start + e.end) / 2 - origin, e.rank, str(e.microbatch), ha="center", va="center",
                    fontsize=7, color="white", clip_on=True)
    ranks = sorted({e.rank for e in timeline})
    ax.set_yticks(ranks, [f"stage {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_xlim(0, span)
    ax.set_xlabel(xlabel)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
              labels=list(colors), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
