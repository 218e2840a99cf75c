"""DeepSpeed's ZeRO stages 0-3 run on CPU ranks beside shardlib's, same model, seed and batches (lesson 09).

DeepSpeed (https://www.deepspeed.ai/docs/config-json/) implements the ZeRO paper (Rajbhandari et
al., arXiv 1910.02054) behind one config key, `zero_optimization.stage`. Here each rank builds a
DeepSpeed engine around the course GPT and torch's AdamW, trains it on its 1/N of the global batches,
and reads what it holds from DeepSpeed's own objects:

    stage 0  engine.module.parameters(), their .grad, the torch optimizer's state
    stage 1, 2  DeepSpeedZeroOptimizer: bit16_groups_flat (the whole model, flat), averaged_gradients
             (this rank's gradient partition), single_partition_of_fp32_groups (fp32 master partition),
             optimizer.state (m, v of that partition)
    stage 3  DeepSpeedZeroOptimizer_Stage3: fp16_partitioned_groups_flat (parameter partition),
             grad_partitions_flat_buffer, fp32_partitioned_groups_flat (master), optimizer.state

Per-rank model states, fp32 training with Adam, as DeepSpeed 0.19 allocates them (Psi parameters,
N ranks; measured in lesson 09):

    stage   params    grads        optimizer                       shardlib (fp32: params are their own master)
    0       4 Psi     4 Psi        8 Psi (m, v)                    4 / 4 (+4 bucket copy) / 8 Psi
    1       4 Psi     4 Psi/N *    12 Psi/N (fp32 master 4 + m, v 8)  4 / 4 / 8 Psi/N
    2       4 Psi     4 Psi/N      12 Psi/N                        4 / 4/N / 8 Psi/N
    3       4 Psi/N   4 Psi/N      12 Psi/N                        4/N / 4/N / 8 Psi/N
    * one micro-batch per step: stage 1 reduces in backward as stage 2 does; with several micro-batches
      it keeps whole gradients until the last one (reduce only at the accumulation boundary).

DeepSpeed keeps an fp32 master partition even when the model is fp32; in mixed precision (bf16
params) both libraries keep K = 12 bytes of fp32 state per parameter, the paper's count.

Communication per rank and step (ring model, recorded by the ledger with record_torch=True):
stages 0-2 with DeepSpeed's defaults on gloo all-reduce the gradient bucket (2(N-1)/N Psi) and stages
1-2 then all-gather the updated parameters ((N-1)/N Psi): 3(N-1)/N Psi, where shardlib's
reduce-scatter + all-gather send the paper's 2(N-1)/N Psi (`use_multi_rank_bucket_allreduce: false`
makes DeepSpeed reduce each slice to its owner instead). Stage 3 all-gathers for forward, keeps the
parameters for backward when they fit under `stage3_max_live_parameters`, and reduce-scatters the
gradients: 2(N-1)/N Psi here, 3(N-1)/N Psi when it must gather again (shardlib reshards after forward).

Runs without a compiler: the shared-memory communication op DeepSpeed would JIT-build is turned off
before DeepSpeed initialises, and `torch_adam`/a torch optimizer avoids FusedAdam's build.
"""

from __future__ import annotations

import json
import logging
import os
import warnings

import torch
import torch.distributed as dist

from shardlib import memory
from shardlib.comm import comm_ledger
from shardlib.launch import current_device, launch
from shardlib.models import GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.ddp import DistributedDataParallel
from shardlib.parallel.zero_stages import (
    apply_zero,
    zero_full_state_dict,
    zero_state_bytes,
)
from shardlib.reference import model_loss, rank_slice
from shardlib.resources import config_path

__all__ = ["GLOBAL_BATCH", "OPTIMIZERS", "ZERO_CHECK_GPT", "build_deepspeed", "build_shardlib", "compare_zero",
           "deepspeed_config", "deepspeed_state_tensors", "deepspeed_step", "disable_shm_comm_op", "held_bytes",
           "import_deepspeed", "shardlib_step", "train_deepspeed", "train_shardlib"]

# The model and batches of shardlib's ZeRO checks (shardlib/checks/zero.py): Psi = 42,304
ZERO_CHECK_GPT = GPTConfig(seq_len=16, n_layer=2, n_head=4, n_embd=32)
GLOBAL_BATCH = 12  # splits over N = 1, 2, 3, 4
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def import_deepspeed():
    """Import DeepSpeed quietly: name the accelerator (no auto-detection warning) before the import.

    Also imports, once, what deepspeed.initialize would import lazily in every rank (its optimizer
    check loads a module that calls torch.compile, which imports the compiler stack: ~10 s per
    process on a busy 2-core machine); forked ranks inherit it.
    """
    from shardlib.devices import visible_gpus  # NVML: counting GPUs this way keeps later forks able to use CUDA

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if visible_gpus() else "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed
        import deepspeed.runtime.engine
        try:
            import deepspeed.runtime.zero.muon.muon_optimizer
        except ImportError:  # another DeepSpeed release: nothing to preload
            pass
    return deepspeed


def disable_shm_comm_op(deepspeed) -> None:
    """Keep DeepSpeed's comm from building its shared-memory op (a JIT compile that needs g++).

    DeepSpeed reads `deepspeed.ops.__compatible_ops__.get("deepspeed_shm_comm", False)`; reading that
    dict the first time probes every op by compiling test programs, so it is set without reading it.
    """
    compatible = vars(deepspeed.ops).get("__compatible_ops__")
    if compatible is None:
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    else:
        compatible["deepspeed_shm_comm"] = False


def _start_deepspeed_on_rank():
    """In a launched rank: join DeepSpeed's comm to the running process group, with no op to compile."""
    deepspeed = import_deepspeed()
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed all-gather/reduce-scatter
    warnings.filterwarnings("ignore", category=UserWarning, module="deepspeed")
    deepspeed.utils.logger.setLevel(logging.ERROR)  # e.g. "untested optimizer": torch's AdamW, on purpose
    disable_shm_comm_op(deepspeed)
    # DeepSpeed keeps references to torch.distributed's all-gather and reduce-scatter from the moment
    # its backend starts: start it while a recording ledger has them wrapped, so the ledger sees them.
    with comm_ledger(record_torch=True):
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


def deepspeed_config(stage: int, micro_batch: int, *, micro_batches: int = 1, bf16: bool = False,
                     bucket_numel: int | None = None, **zero_keys) -> dict:
    """The ds_config of lesson 09 (shardlib/configs/deepspeed/zero<stage>.json) with the batch filled in.

    The file sets gradient_clipping 0.0 (DeepSpeed 0.19 clips at 1.0 by default), accepts torch's
    optimizer, and at stage 3 shards every parameter (stage3_param_persistence_threshold 0; the
    default keeps parameters under 1e5 elements whole, on this small model all of them).
    bucket_numel: reduce/all-gather bucket size in elements; zero_keys: more zero_optimization keys.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    config = json.loads(config_path("deepspeed", f"zero{stage}.json").read_text())
    config.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=micro_batches)
    zero = config["zero_optimization"]
    if bucket_numel is not None:
        zero.update(reduce_bucket_size=bucket_numel, allgather_bucket_size=bucket_numel)
        if stage == 3:
            zero.update(stage3_prefetch_bucket_size=bucket_numel)
    zero.update(zero_keys)
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


# ---------------------------------------------------------------------------------
# what DeepSpeed holds, read from its own objects


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def deepspeed_state_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """The tensors an engine's rank holds now, by kind: params, grads, optimizer (master copy + state),
    buckets (flat buffers that gradients are copied into for communication)."""
    stage, opt, module = engine.zero_optimization_stage(), engine.optimizer, engine.module
    if stage == 0:
        inner = getattr(opt, "optimizer", opt)
        masters = [t for g in getattr(opt, "fp32_groups", []) for t in g]  # bf16 without ZeRO: fp32 copies
        return dict(params=list(module.parameters()),
                    grads=[p.grad for p in module.parameters() if p.grad is not None], buckets=[],
                    optimizer=masters + _optimizer_state(inner))
    buckets = [b for bucket in opt.ipg_buckets.values()
               for b in (bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer])
               if isinstance(b, torch.Tensor)]
    if stage in (1, 2):
        grads = [t for part in opt.averaged_gradients.values() if part for t in part]
        grads += [t for part in getattr(opt, "all_grad_tensors", {}).values() if part for t in part
                  if isinstance(t, torch.Tensor)]  # stage 2 between micro-batches: the partition accumulated so far
        for p in module.parameters():  # stage 1 between micro-batches: whole gradients (bf16: in .grad_accum)
            grads += [g for g in (p.grad, getattr(p, "grad_accum", None)) if g is not None]
        grads += [m.grad for m in opt.single_partition_of_fp32_groups if m.grad is not None]
        if getattr(opt, "grads_in_partition", None) is not None:  # contiguous_gradients' partition buffer
            grads.append(opt.grads_in_partition)
        return dict(params=list(opt.bit16_groups_flat), grads=grads, buckets=buckets,
                    optimizer=list(opt.single_partition_of_fp32_groups) + _optimizer_state(opt.optimizer))
    grads = [opt.grad_partitions_flat_buffer] + [m.grad for m in opt.fp32_partitioned_groups_flat if m.grad is not None]
    gathered = [p.data for p in module.parameters() if p.data.numel() > 0]  # whole parameters alive right now
    return dict(params=list(opt.fp16_partitioned_groups_flat) + gathered, grads=grads, buckets=buckets,
                optimizer=list(opt.fp32_partitioned_groups_flat) + _optimizer_state(opt.optimizer))


def held_bytes(tensors: dict[str, list[torch.Tensor]]) -> dict:
    """Bytes of distinct storages by kind (a storage counts once, under the first kind that lists it).

    total = params + grads + optimizer: the model states of the ZeRO formulas; buckets apart.
    """
    seen, held = set(), {}
    for kind in ("params", "grads", "optimizer", "buckets"):
        fresh = []
        for t in tensors[kind]:
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                fresh.append(t)
        held[kind] = memory.unique_storage_bytes(fresh)
    held["total"] = held["params"] + held["grads"] + held["optimizer"]
    return held


def _peak(snapshots: list[dict]) -> dict:
    return max(snapshots, key=lambda h: h["total"])


def _deepspeed_full_state_dict(engine, deepspeed) -> dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}


# ---------------------------------------------------------------------------------
# one rank's training: DeepSpeed, then shardlib, same batches


def build_deepspeed(config: GPTConfig, stage: int, lr: float, micro_batch: int, *, optimizer: str = "adamw",
                    micro_batches: int = 1, bf16: bool = False, bucket_numel: int | None = None, **zero_keys):
    """In a launched rank: the course GPT (seed 0) in a DeepSpeed engine at ZeRO `stage`; returns the engine."""
    deepspeed = _start_deepspeed_on_rank()
    model = build_gpt(config, seed=0).to(current_device())
    ds_config = deepspeed_config(stage, micro_batch, micro_batches=micro_batches, bf16=bf16,
                                 bucket_numel=bucket_numel, **zero_keys)
    engine, *_ = deepspeed.initialize(model=model, optimizer=OPTIMIZERS[optimizer](model.parameters(), lr=lr),
                                      config=ds_config)
    return engine


def deepspeed_step(engine, batch, micro_batches: int = 1, snapshot=None) -> float:
    """One optimizer step on this rank's batch (B/N, T) in `micro_batches` pieces; returns the mean loss."""
    total = 0.0
    for xm, ym in zip(batch[0].chunk(micro_batches), batch[1].chunk(micro_batches)):  # (B/(N m), T) each
        loss = model_loss(engine, (xm, ym))
        engine.backward(loss)  # scales by 1/micro_batches; reduces now, or at the last micro-batch (stage 1)
        if snapshot:
            snapshot()
        engine.step()  # steps only after the last micro-batch
        total += loss.item() / micro_batches
    return total


def build_shardlib(config: GPTConfig, stage: int, lr: float, *, optimizer: str = "adamw", bf16: bool = False):
    """In a launched rank: the same GPT under shardlib (stage 0: DistributedDataParallel; 1-3: apply_zero).

    Returns (module to call, optimizer, held) where held() reads the bytes this rank holds now.
    """
    model = build_gpt(config, seed=0).to(current_device())
    if stage == 0:
        if bf16:
            raise ValueError("the stage-0 comparison runs in fp32 (shardlib's DistributedDataParallel has no bf16 mode)")
        ddp, opt = DistributedDataParallel(model), OPTIMIZERS[optimizer](model.parameters(), lr=lr)
    else:
        ddp, opt = model, apply_zero(model, stage, OPTIMIZERS[optimizer], lr=lr,
                                     param_dtype=torch.bfloat16 if bf16 else None)

    def held() -> dict:
        if stage == 0:
            measured = memory.model_state_bytes(model, opt)
            out = {k: measured[k] for k in ("params", "grads", "optimizer", "total")}
            return dict(out, buckets=memory.unique_storage_bytes([b.buffer for b in ddp.buckets]))
        return dict(zero_state_bytes(model, opt), buckets=0)

    return ddp, opt, held


def shardlib_step(model, optimizer, batch, micro_batches: int = 1, snapshot=None) -> float:
    """One optimizer step on this rank's batch (B/N, T), gradients accumulated over `micro_batches`."""
    optimizer.zero_grad()
    total = 0.0
    for xm, ym in zip(batch[0].chunk(micro_batches), batch[1].chunk(micro_batches)):  # (B/(N m), T) each
        loss = model_loss(model, (xm, ym)) / micro_batches
        loss.backward()
        if snapshot:
            snapshot()
        total += loss.item()
    optimizer.step()
    return total


def _train(step, batches, snapshot) -> tuple[list, list]:
    rank, n = dist.get_rank(), dist.get_world_size()
    losses, sent = [], []
    for batch in batches:
        mine = tuple(t.to(current_device()) for t in rank_slice(batch, rank, n))  # (B/N, T) each
        with comm_ledger(record_torch=True) as ledger:
            losses.append(step(mine))
        snapshot()
        sent.append(ledger.summary())
    return losses, sent


def train_deepspeed(config: GPTConfig, batches: list, stage: int, lr: float, *, micro_batches: int = 1,
                    **options) -> dict:
    """In a launched rank: train DeepSpeed ZeRO `stage`; return losses, full state, peak bytes, bytes sent per step."""
    micro_batch = batches[0][0].shape[0] // dist.get_world_size() // micro_batches
    engine = build_deepspeed(config, stage, lr, micro_batch, micro_batches=micro_batches, **options)
    snapshots = []
    snapshot = lambda: snapshots.append(held_bytes(deepspeed_state_tensors(engine)))
    losses, sent = _train(lambda b: deepspeed_step(engine, b, micro_batches, snapshot), batches, snapshot)
    return dict(losses=losses, state=_deepspeed_full_state_dict(engine, import_deepspeed()), held=_peak(snapshots),
                sent=sent, optimizer_class=type(engine.optimizer).__name__)


def train_shardlib(config: GPTConfig, batches: list, stage: int, lr: float, *, micro_batches: int = 1,
                   **options) -> dict:
    """In a launched rank: the same training with shardlib; the same record as train_deepspeed."""
    model, optimizer, held = build_shardlib(config, stage, lr, **options)
    snapshots = []
    snapshot = lambda: snapshots.append(held())
    losses, sent = _train(lambda b: shardlib_step(model, optimizer, b, micro_batches, snapshot), batches, snapshot)
    module = model.module if stage == 0 else model
    state = module.state_dict() if stage == 0 else zero_full_state_dict(module, optimizer)
    return dict(losses=losses, state={k: v.detach().float().cpu() for k, v in state.items()}, held=_peak(snapshots),
                sent=sent)


def _both_on_rank(config, batches, stage, lr, options, libraries=("deepspeed", "shardlib")):
    runs = {}
    if "deepspeed" in libraries:
        runs["deepspeed"] = train_deepspeed(config, batches, stage, lr, **options)
    if "shardlib" in libraries:
        runs["shardlib"] = train_shardlib(config, batches, stage, lr,
                                          **{k: v for k, v in options.items() if k != "bucket_numel"})
    for run in runs.values():
        run["losses"] = _mean_over_ranks(run["losses"])
    return runs


def _mean_over_ranks(losses: list[float]) -> list[float]:
    """The global batch's mean loss per step: the mean of the ranks' equal-slice means."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    return [sum(step) / len(step) for step in zip(*every)]


def compare_zero(world_size: int, stage: int, *, config: GPTConfig = ZERO_CHECK_GPT, steps: int = 3,
                 lr: float = 3e-4, optimizer: str = "adamw", micro_batches: int = 1, bf16: bool = False,
                 bucket_numel: int | None = None, batches: list | None = None, timeout: float = 300,
                 device: str = "auto", libraries: tuple[str, ...] = ("deepspeed", "shardlib")) -> list[dict]:
    """DeepSpeed and shardlib at ZeRO `stage` on `world_size` ranks, one job: per rank
    {"deepspeed": run, "shardlib": run}, run = {losses (global mean per step), state (full, fp32),
    held (peak bytes: params, grads, optimizer, buckets, total), sent (ledger summary per step)}.
    libraries: which of the two to run (("deepspeed",): DeepSpeed alone); device: as launch()'s."""
    if not libraries or set(libraries) - {"deepspeed", "shardlib"}:
        raise ValueError(f"libraries must name 'deepspeed', 'shardlib' or both, got {libraries!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    batches = batches or random_token_batches(config, GLOBAL_BATCH, steps)
    if batches[0][0].shape[0] % (world_size * micro_batches):
        raise ValueError(f"a global batch of {batches[0][0].shape[0]} does not split into {world_size} ranks x "
                         f"{micro_batches} micro-batches; pick sizes that divide it")
    options = dict(optimizer=optimizer, micro_batches=micro_batches, bf16=bf16, bucket_numel=bucket_numel)
    return launch(_both_on_rank, world_size, args=(config, batches, stage, lr, options, libraries), timeout=timeout,
                  device=device)
