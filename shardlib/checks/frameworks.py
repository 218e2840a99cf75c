"""Other frameworks' sharding held against one device and against shardlib (lesson 09).

- `verify_deepspeed` (`python -m shardlib verify --technique deepspeed-zero1|2|3`): DeepSpeed's ZeRO
  on N CPU ranks, the model and batches of shardlib's ZeRO checks (shardlib/checks/zero.py): AdamW
  losses vs one device and vs shardlib's ZeRO at the same stage, and an SGD run's losses and
  parameters vs one device (Adam turns the rounding differences of near-zero gradients, which any
  other summation order makes, into steps of up to lr; SGD does not, so parameters are compared there);
  bytes held, read from DeepSpeed's objects, vs fp32 params 4 (or 4/N at stage 3) + grads 4/N +
  fp32 master, m, v 12/N bytes per parameter (shardlib/lessons/deepspeed_run.py).
- `verify_jax` (`jax-dp`, `jax-fsdp`, `jax-tp`): one jitted training step on 8 CPU devices under each
  layout vs the same step on one device, in a separate process (JAX's device count is fixed at start);
  the collectives in the compiled program vs the layout's formula.
- `verify_megatron` (`megatron-tp`): Megatron-Core's ColumnParallelLinear + RowParallelLinear on N
  ranks vs one nn.Linear pair and vs shardlib's layers, outputs and gradients; the ledger's records.
- `bench_deepspeed` (`python -m shardlib bench deepspeed`): shardlib's ZeRO-1/2/3 beside DeepSpeed's
  at the same stage, same model, ranks and batches, in one job: step-time ratio and bytes-per-rank ratio.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlib.checks.harness import TOLERANCE, relative_loss_difference
from shardlib.checks.zero import BATCH, CHECK_GPT
from shardlib.launch import launch
from shardlib.lessons import deepspeed_run, jax_sharding, megatron_run
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.reference import compare_state, train_reference
from shardlib.timing import interleaved_times

STEPS = 3
LR = {"adamw": 3e-4, "sgd": 0.1}
PADDING = 0.03  # DeepSpeed allocates its gradient partition a little larger than Psi/N (+2.6% at N = 4 here)


# ---------------------------------------------------------------------------------
# DeepSpeed ZeRO


def _reference_on_rank(batches, optimizer: str) -> tuple[dict, list]:
    make = deepspeed_run.OPTIMIZERS[optimizer]
    model, losses = train_reference(lambda: build_gpt(CHECK_GPT, seed=0), batches, lambda p: make(p, lr=LR[optimizer]))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def expected_deepspeed_bytes(n_params: int, world_size: int, stage: int) -> dict:
    """fp32 training, one micro-batch per step: params 4 Psi (stage 3: 4 Psi/N), grads 4 Psi/N
    (stage 1 too: it reduces in backward when every micro-batch is the last), optimizer 12 Psi/N."""
    shard = n_params / world_size
    return {"params": 4 * (shard if stage == 3 else n_params), "grads": 4 * shard, "optimizer": 12 * shard}


def verify_deepspeed(world_size: int, technique: str = "deepspeed-zero1") -> dict:
    stages = {"deepspeed-zero1": 1, "deepspeed-zero2": 2, "deepspeed-zero3": 3}
    if technique not in stages:
        raise ValueError(f"technique must be one of {sorted(stages)}, got {technique!r}")
    stage, n = stages[technique], world_size
    if BATCH % n:
        raise ValueError(f"the check's global batch of {BATCH} does not split over {n} ranks")
    batches = random_token_batches(CHECK_GPT, BATCH, STEPS)
    runs, refs = {}, {}
    for optimizer in ("adamw", "sgd"):
        runs[optimizer] = deepspeed_run.compare_zero(n, stage, config=CHECK_GPT, batches=batches, lr=LR[optimizer],
                                                     optimizer=optimizer)[0]
        refs[optimizer] = launch(_reference_on_rank, 1, args=(batches, optimizer), timeout=300)[0]
    adam, sgd = runs["adamw"], runs["sgd"]
    diffs = {
        "adamw losses vs one device": relative_loss_difference(adam["deepspeed"]["losses"], refs["adamw"][1]),
        "adamw losses vs shardlib": relative_loss_difference(adam["deepspeed"]["losses"], adam["shardlib"]["losses"]),
        "sgd losses vs one device": relative_loss_difference(sgd["deepspeed"]["losses"], refs["sgd"][1]),
        "sgd params vs one device": compare_state(sgd["deepspeed"]["state"], refs["sgd"][0])[1],
    }
    max_abs = compare_state(sgd["deepspeed"]["state"], refs["sgd"][0])[0]
    held, expected = adam["deepspeed"]["held"], expected_deepspeed_bytes(CHECK_GPT.n_params, n, stage)
    bytes_ok = all(expected[k] <= held[k] <= expected[k] * (1 + PADDING) + 64 for k in expected)
    sent = adam["deepspeed"]["sent"][-1]
    traffic = ", ".join(f"{kind} {row['sent_bytes']} B" for kind, row in sorted(sent.items()))
    worst = max(diffs, key=diffs.get)
    detail = (f"worst: {worst} {diffs[worst]:.1e}; held p/g/o {held['params']}/{held['grads']}/{held['optimizer']} B "
              f"vs {expected['params']:.0f}/{expected['grads']:.0f}/{expected['optimizer']:.0f}; sent {traffic}")
    return {"passed": bool(max(diffs.values()) <= TOLERANCE and bytes_ok), "max_abs_diff": max_abs,
            "max_rel_diff": max(diffs.values()), "detail": detail}


# ---------------------------------------------------------------------------------
# JAX: one jitted SGD step per layout on N CPU devices (its own process) vs torch on one device


def expected_jax_collectives(layout: str, n: int) -> dict:
    """Elements per device in the compiled step's collectives that the layout implies (None: not fixed).

    dp: the gradients' all-reduce, Psi elements, plus the loss (1); tp: the row layer's partial
    outputs, B*d, forward only (the input needs no gradient); fsdp: the compiler's choice of
    gathers and re-layouts, so only the parameters held per device are checked (Psi/N)."""
    psi = 2 * jax_sharding.D * jax_sharding.K + jax_sharding.K + jax_sharding.D
    return {"dp": {"all_reduce": psi + 1}, "tp": {"all_reduce": jax_sharding.BATCH * jax_sharding.D},
            "fsdp": None}[layout]


def verify_jax(world_size: int, technique: str = "jax-dp") -> dict:
    layout = technique.removeprefix("jax-")
    if layout not in ("dp", "fsdp", "tp"):
        raise ValueError(f"technique must be jax-dp, jax-fsdp or jax-tp, got {technique!r}")
    if jax_sharding.K % world_size or jax_sharding.D % world_size or jax_sharding.BATCH % world_size:
        raise ValueError(f"{world_size} devices do not divide the check's sizes (d={jax_sharding.D}, "
                         f"k={jax_sharding.K}, batch={jax_sharding.BATCH}): use 2, 4 or 8")
    run = jax_sharding.run_in_subprocess(layout, world_size, STEPS)
    ref = jax_sharding.torch_reference(STEPS)
    state = {k: torch.tensor(v) for k, v in run["params"].items()}
    max_abs, max_rel = compare_state(state, {k: torch.from_numpy(v) for k, v in ref["params"].items()})
    loss_rel = relative_loss_difference(run["losses"], ref["losses"])
    sent = {}
    for c in run["collectives"]:
        sent[c["kind"]] = sent.get(c["kind"], 0) + c["elements"]
    expected = expected_jax_collectives(layout, world_size)
    held = sum(run["params_per_device"].values())
    psi = 2 * jax_sharding.D * jax_sharding.K + jax_sharding.K + jax_sharding.D
    comm_ok = sent == expected if expected is not None else held == psi // world_size
    detail = (f"compiled collectives (elements/device) {sent}, expected {expected}; "
              f"{held} parameters per device of {psi}")
    return {"passed": bool(max(max_rel, loss_rel) <= TOLERANCE and comm_ok), "max_abs_diff": max_abs,
            "max_rel_diff": max(max_rel, loss_rel), "detail": detail}


# ---------------------------------------------------------------------------------
# Megatron-Core: ColumnParallelLinear + RowParallelLinear vs one device and shardlib's


def verify_megatron(world_size: int, technique: str = "megatron-tp") -> dict:
    shape, d = (4, 16), 32
    result = megatron_run.compare_tp_pair(world_size, d=d, k=128, shape=shape)
    expected = [("all_reduce", shape[0] * shape[1] * d * 4)] * 2  # g forward, f backward: b*s*d fp32 each
    records = {lib: [(kind, nbytes) for kind, nbytes, _ in recs] for lib, recs in result["records"].items()}
    comm_ok = records["megatron"] == expected and records["shardlib"] == expected
    worst = max(result["max_rel"], key=result["max_rel"].get)
    return {"passed": bool(max(result["max_rel"].values()) <= TOLERANCE and comm_ok), "max_abs_diff": float("nan"),
            "max_rel_diff": max(result["max_rel"].values()),
            "detail": f"worst: {worst} {result['max_rel'][worst]:.1e}; ledger megatron {records['megatron']}, "
                      f"expected {expected}; weights per rank {result['weights_per_rank']['megatron']} "
                      f"of {result['one_device_weights']}"}


# ---------------------------------------------------------------------------------
# bench: shardlib's ZeRO beside DeepSpeed's


BENCH_GPT = GPTConfig(seq_len=64, n_layer=4, n_head=4, n_embd=128)  # Psi = 0.87M, as bench zero
BENCH_MICRO_BATCHES = 2  # ZeRO-1 differs from ZeRO-2 only when a step has several micro-batches
BENCH_BUCKET = 2**16  # DeepSpeed's reduce/all-gather buckets, elements (its default, 5e8, is 2 GB in fp32)


def _time_both_on_rank(stage: int, batch_per_rank: int, repeats: int) -> dict:
    """bf16 compute, fp32 master weights (the ZeRO paper's setting), 2 micro-batches per step."""
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, BENCH_GPT.vocab_size, (batch_per_rank, BENCH_GPT.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])  # (B/N, T) each
    engine = deepspeed_run.build_deepspeed(BENCH_GPT, stage, 1e-3, batch_per_rank // BENCH_MICRO_BATCHES,
                                           micro_batches=BENCH_MICRO_BATCHES, bf16=True, bucket_numel=BENCH_BUCKET)
    model, optimizer, held = deepspeed_run.build_shardlib(BENCH_GPT, stage, 1e-3, bf16=True)
    deepspeed_run.shardlib_step(model, optimizer, batch, BENCH_MICRO_BATCHES)  # a first step creates Adam's state
    deepspeed_run.deepspeed_step(engine, batch, BENCH_MICRO_BATCHES)
    ours_held, theirs_held = [], []  # bytes at every point of the next step: after each backward, after the step
    deepspeed_run.shardlib_step(model, optimizer, batch, BENCH_MICRO_BATCHES, lambda: ours_held.append(held()))
    ours_held.append(held())
    deepspeed_run.deepspeed_step(engine, batch, BENCH_MICRO_BATCHES, lambda: theirs_held.append(
        deepspeed_run.held_bytes(deepspeed_run.deepspeed_state_tensors(engine))))
    theirs_held.append(deepspeed_run.held_bytes(deepspeed_run.deepspeed_state_tensors(engine)))
    fns = {"ours": lambda: deepspeed_run.shardlib_step(model, optimizer, batch, BENCH_MICRO_BATCHES),
           "deepspeed": lambda: deepspeed_run.deepspeed_step(engine, batch, BENCH_MICRO_BATCHES)}
    seconds = interleaved_times(fns, repeats, warmup=2, sync=dist.barrier)
    peak = lambda snapshots: max(h["total"] for h in snapshots)
    return dict(seconds, ours_bytes=peak(ours_held), deepspeed_bytes=peak(theirs_held),
                deepspeed_buckets=max(h["buckets"] for h in theirs_held))


def bench_deepspeed(quick: bool = False) -> list[dict]:
    """shardlib ZeRO-1/2/3 vs DeepSpeed ZeRO-1/2/3: GPT 0.87M, bf16 + fp32 master, 2 and 4 ranks."""
    rows = []
    for world_size in (2, 4):
        for stage in (1, 2, 3):
            per_rank = launch(_time_both_on_rank, world_size, args=(stage, 4, 3 if quick else 11), timeout=600)
            ours_s, theirs_s = (max(r[k] for r in per_rank) for k in ("ours", "deepspeed"))
            ours_b, theirs_b = (max(r[k] for r in per_rank) for k in ("ours_bytes", "deepspeed_bytes"))
            rows.append({"benchmark": "deepspeed",
                         "case": f"ZeRO-{stage} vs DeepSpeed, GPT {BENCH_GPT.n_params / 1e6:.2f}M bf16, N={world_size}",
                         "ours_s": ours_s, "torch_s": theirs_s, "ratio": ours_s / theirs_s, "target": 1.5,
                         "ours_bytes": ours_b, "deepspeed_bytes": theirs_b,
                         "bytes_ratio": round(ours_b / theirs_b, 3), "bytes_ratio_target": (0.95, 1.05),
                         "deepspeed_bucket_bytes": max(r["deepspeed_buckets"] for r in per_rank)})
    return rows


CHECKS = {**{name: (verify_deepspeed, (2, 4)) for name in ("deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")},
          **{name: (verify_jax, (2, 4, 8)) for name in ("jax-dp", "jax-fsdp", "jax-tp")},
          "megatron-tp": (verify_megatron, (2, 4))}
BENCHMARKS = {"deepspeed": bench_deepspeed}
