"""Tensor and sequence parallelism checked and timed: `python -m shardlib verify --technique tp|tp-sp`
and `python -m shardlib bench tp|tp-sp`.

verify: the small GPT split t ways (shardlib/parallel/tensor_gpt.py) against one device on the same seed
and batches; the communication ledger against the formulas of shardlib/parallel/tensor.py and
shardlib/parallel/sequence.py; the bytes one bf16 block saves for backward against
shardlib.memory.course_gpt_activation_terms (on CPU ranks: CUDA kernels keep other bookkeeping). At t = 3
the check's sequence of 64 tokens is padded to 66.
bench: shardlib's Megatron block beside PyTorch's own tensor parallelism (torch.distributed.tensor.parallel:
Colwise/RowwiseParallel, and for tp-sp SequenceParallel with PrepareModuleInput) on the same block and ranks.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from shardlib.checks.harness import (DTYPE, ELEMENT_SIZE, STEPS, TOLERANCE, adamw, compare_run, cpu_state,
                                     launch_on, reference_run, train_steps, verdict)
from shardlib.comm import comm_ledger
from shardlib.launch import current_device, launch
from shardlib.memory import course_gpt_activation_terms, saved_activation_bytes
from shardlib.models import Block, GPTConfig, build_gpt, random_token_batches
from shardlib.parallel.sequence import sequence_parallel_collectives
from shardlib.parallel.tensor import gather_full_state_dict
from shardlib.parallel.tensor_gpt import (
    check_tp_config,
    parallelize_block,
    parallelize_gpt,
    sync_sequence_parallel_grads,
)
from shardlib.reference import compare_state, model_loss
from shardlib.timing import interleaved_times, machine_load

# the course's small GPT (T=64, L=2) with 12 heads of 4 and V=264, so that t = 1, 2, 3 and 4 all divide
# the heads, the MLP and the vocabulary; t = 3 does not divide the 64 tokens: sequence parallelism pads
CHECK_GPT = GPTConfig(vocab_size=264, n_head=12, n_embd=48)
BATCH = 4


def global_batches(steps: int = STEPS) -> list:
    return random_token_batches(CHECK_GPT, BATCH, steps)


def build_check_gpt():
    return build_gpt(CHECK_GPT, seed=0).to(DTYPE)


def world_size_error(technique: str, world_size: int) -> str | None:
    """Why the check cannot run on `world_size` ranks (None: it can)."""
    try:
        check_tp_config(CHECK_GPT, world_size)
    except ValueError as error:
        return f"{technique} splits the check's GPT t = world size ways: {error}"
    return None


def expected_collectives(config: GPTConfig, b: int, s: int, t: int, sequence_parallel: bool = False,
                         keep_gathered_input: bool = False):
    """(forward, backward) lists of (kind, elements) one rank makes in one training step, from
    the formulas in the module docstrings: per layer 2 all-reduces of b*s*h each way; the
    embedding's, the output head's and the loss's. Under sequence parallelism (the sequence padded
    to s' = a multiple of t) each all-reduce of b*s'*h becomes a reduce-scatter plus an all-gather,
    each column input kept as a shard is all-gathered again in backward (sequence_parallel_collectives;
    the output head's too), and one all-reduce sums the gradients of the weights that saw a sequence
    shard (6h per layer, 2h for ln_f, T*h position embedding)."""
    if t == 1:
        return [], []
    L, h = config.n_layer, config.n_embd
    loss = [("all_reduce", b * s)] * 3  # max, target logit, sum of exponentials
    if not sequence_parallel:
        bsh = b * s * h
        return [("all_reduce", bsh)] * (1 + 2 * L) + loss, [("all_reduce", bsh)] * (2 * L + 1)
    padded = s + -s % t
    bsh = b * padded * h
    layer_forward, layer_backward = sequence_parallel_collectives(b, padded, h, keep_gathered_input=keep_gathered_input)
    head_backward = ([] if keep_gathered_input else [("all_gather", bsh)]) + [("reduce_scatter", bsh)]
    forward = [("reduce_scatter", bsh)] + layer_forward * L + [("all_gather", bsh)] + loss
    backward = head_backward + layer_backward * L + [("all_gather", bsh)] \
        + [("all_reduce", L * 6 * h + 2 * h + config.seq_len * h)]
    return forward, backward


def block_saved_bytes(config: GPTConfig, b: int, *, group=None, dtype=torch.bfloat16, **options) -> int:
    """Bytes one block of `config` (ParallelBlock with `options`) saves for backward on this rank, in
    `dtype`, for a batch of b sequences of config.seq_len tokens (padded to a multiple of t under
    sequence parallelism), measured with saved-tensor hooks (shardlib.memory.saved_activations)."""
    t = dist.get_world_size(group)
    torch.manual_seed(0)
    block = parallelize_block(Block(config).to(current_device(), dtype), config, group=group, **options)
    s = config.seq_len + -config.seq_len % t if options.get("sequence_parallel") else config.seq_len
    x = torch.randn(b, s // t if options.get("sequence_parallel") else s, config.n_embd,
                    device=current_device(), dtype=dtype, requires_grad=True)  # (B, T/t or T, C)
    return saved_activation_bytes(block, x)


def block_saved_bytes_formula(config: GPTConfig, b: int, t: int, dtype=torch.bfloat16, **options) -> int:
    """What block_saved_bytes should measure on CPU ranks: the sum of course_gpt_activation_terms."""
    s = config.seq_len + -config.seq_len % t if options.get("sequence_parallel") else config.seq_len
    terms = course_gpt_activation_terms(s, b, config.n_embd, config.n_head, options.pop("recompute", None), tp=t,
                                        element_size=torch.empty((), dtype=dtype).element_size(), **options)
    return sum(row["course"] for row in terms)


def _records(ledger) -> list[tuple[str, int]]:
    return [(r.kind, r.nbytes // ELEMENT_SIZE) for r in ledger.records]  # (kind, elements)


def _train_on_rank(sequence_parallel: bool, steps: int) -> dict:
    """Losses, full gradients of step 1, full parameters after the last step; the ledger of step 1;
    the bytes one bf16 block saves."""
    saved = block_saved_bytes(CHECK_GPT, BATCH, sequence_parallel=sequence_parallel)
    model = parallelize_gpt(build_check_gpt().to(current_device()), sequence_parallel=sequence_parallel)
    first = {}

    def forward_backward(batch):
        with comm_ledger() as forward:  # nested in the step's ledger: both record the forward
            loss = model_loss(model, batch)
        with comm_ledger() as backward:
            loss.backward()
            sync_sequence_parallel_grads(model)
        if not first:
            first.update(ledger=(_records(forward), _records(backward)),
                         grads=cpu_state(gather_full_state_dict(model, grads=True)))
        return loss

    losses, _ = train_steps(adamw(model.parameters()), global_batches(steps), forward_backward)
    return dict(first, losses=losses, state=cpu_state(gather_full_state_dict(model)), saved=saved,
                device=current_device().type)


def verify_tp(world_size: int, technique: str = "tp", steps: int = STEPS, device: str = "cpu") -> dict:
    """t ranks vs one device: `steps` AdamW steps of the small GPT, parameters and losses with the
    harness's policy, and the first step's gradients; the ledger against expected_collectives."""
    if technique not in ("tp", "tp-sp"):
        raise ValueError(f"technique must be 'tp' or 'tp-sp', got {technique!r}")
    if world_size_error(technique, world_size):  # before any process starts
        raise ValueError(world_size_error(technique, world_size))
    sequence_parallel = technique == "tp-sp"
    per_rank = launch_on(_train_on_rank, world_size, args=(sequence_parallel, steps), device=device, timeout=300)
    reference = reference_run(build_check_gpt, global_batches(steps), first_grads=True, device=device)
    result = compare_run(per_rank[0]["state"], per_rank[0]["losses"], reference["state"], reference["losses"])
    grad_abs, grad_rel = compare_state(per_rank[0]["grads"], reference["grads"])
    same_on_ranks = all(r["losses"] == per_rank[0]["losses"] and r["state"].keys() == per_rank[0]["state"].keys()
                        for r in per_rank)  # every rank saw one loss
    expected = expected_collectives(CHECK_GPT, BATCH, CHECK_GPT.seq_len, world_size, sequence_parallel)
    ledger_ok = all(r["ledger"][0] == expected[0] and sorted(r["ledger"][1]) == sorted(expected[1]) for r in per_rank)
    forward, backward = per_rank[0]["ledger"]
    saved_formula = block_saved_bytes_formula(CHECK_GPT, BATCH, world_size, sequence_parallel=sequence_parallel)
    on_cpu = per_rank[0]["device"] == "cpu"  # the formula has the CPU kernels' bookkeeping (see its docstring)
    saved_ok = all(r["saved"] == saved_formula for r in per_rank) or not on_cpu
    grads = {"max_abs_diff": grad_abs, "max_rel_diff": grad_rel, "passed": grad_rel <= TOLERANCE}
    notes = [f"loss rel {result['loss_rel_diff']:.1e}, step-1 grads rel {grad_rel:.1e}; {len(forward)} collectives "
             f"forward, {len(backward)} backward" + (" = formula" if ledger_ok else "")
             + f"; bf16 block saves {per_rank[0]['saved']:,} B"
             + ((" = formula" if saved_ok else "") if on_cpu else f" (formula {saved_formula:,} B, for CPU kernels)")]
    problems = ([] if ledger_ok else ["LEDGER DIFFERS from the formula"]) + \
        ([] if same_on_ranks else ["RANKS DISAGREE on the loss"]) + \
        ([] if saved_ok else [f"SAVED ACTIVATIONS {[r['saved'] for r in per_rank]} B, formula {saved_formula:,} B"])
    return verdict([result, grads], notes, problems)


_BENCH_GPT = GPTConfig(seq_len=128, n_head=8, n_embd=256)


def torch_parallel_block(block: Block, sequence_parallel: bool):
    """The same block through torch.distributed.tensor.parallel: q, k, v, fc column-wise, o_proj and proj
    row-wise; with sequence parallelism (as torchtitan's plan does) the LayerNorms SequenceParallel, the
    attention and MLP inputs gathered by PrepareModuleInput, the row outputs reduce-scattered (Shard(1))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    row = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": row, "mlp.fc": ColwiseParallel(), "mlp.proj": row}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln_1": SequenceParallel(), "attn": gather, "ln_2": SequenceParallel(), "mlp": gather})
    mesh = init_device_mesh(current_device().type, (dist.get_world_size(),))
    return parallelize_module(copy.deepcopy(block), mesh, plan)


def _time_block_steps(batch_size: int, repeats: int, sequence_parallel: bool) -> dict:
    """Median step time (forward, backward, the partial gradients summed under SP, AdamW) of one GPT
    block: ours vs torch's parallelize_module, steps interleaved; the output and gradient differences."""
    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    block = Block(_BENCH_GPT).to(current_device())
    ours = parallelize_block(block, _BENCH_GPT, sequence_parallel=sequence_parallel)
    theirs = torch_parallel_block(block, sequence_parallel)
    x = torch.randn(batch_size, _BENCH_GPT.seq_len, _BENCH_GPT.n_embd,
                    generator=torch.Generator().manual_seed(0)).to(current_device())  # (B, T, C)
    if sequence_parallel:
        x = x.chunk(t, dim=1)[rank]  # (B, T/t, C): both take this rank's sequence shard
    with torch.no_grad():
        out_diff = (ours(x) - theirs(x)).abs().max().item()  # the same function
    for module in (ours, theirs):
        module(x).square().mean().backward()
    sync_sequence_parallel_grads(ours)
    mine = gather_full_state_dict(ours, grads=True)
    full = {name: getattr(p.grad, "full_tensor", lambda grad=p.grad: grad)() for name, p in theirs.named_parameters()}
    grad_diff = max((full[name] - mine[name]).abs().max().item() for name in full)  # (DTensors gathered)
    saved = {"saved_ours_B": saved_activation_bytes(ours, x), "saved_torch_B": saved_activation_bytes(theirs, x)}

    def step(module, optimizer, sync):
        optimizer.zero_grad(set_to_none=True)
        module(x).square().mean().backward()
        sync(module)
        optimizer.step()

    runs = {"ours": (ours, adamw(ours.parameters()), sync_sequence_parallel_grads),
            "torch": (theirs, adamw(theirs.parameters()), lambda module: None)}
    medians = interleaved_times({name: (lambda run=run: step(*run)) for name, run in runs.items()}, repeats,
                                warmup=2, sync=dist.barrier)
    return dict(medians, out_diff=out_diff, grad_diff=grad_diff, **saved)


def _bench_block(technique: str, quick: bool, world_size: int) -> list[dict]:
    batch_size, sequence_parallel = 8, technique == "tp-sp"
    per_rank = launch(_time_block_steps, world_size, args=(batch_size, 3 if quick else 15, sequence_parallel),
                      timeout=600)
    ours, theirs = max(r["ours"] for r in per_rank), max(r["torch"] for r in per_rank)  # slowest rank
    c = _BENCH_GPT
    return [{"benchmark": technique, "ratio": ours / theirs, "target": 1.3, "ours_s": ours, "torch_s": theirs,
             "case": f"GPT block h={c.n_embd} T={c.seq_len} B={batch_size}, t={world_size} gloo"
                     + (", sequence parallel" if sequence_parallel else ""),
             "max_out_diff": f"{max(r['out_diff'] for r in per_rank):.1e}",
             "max_grad_diff": f"{max(r['grad_diff'] for r in per_rank):.1e}",
             "saved_per_rank": f"ours {per_rank[0]['saved_ours_B']:,} B, torch {per_rank[0]['saved_torch_B']:,} B",
             "load": machine_load()}]


def bench_tp(quick: bool = False, world_size: int = 2) -> list[dict]:
    """shardlib's Megatron block vs torch.distributed.tensor.parallel on the same block, t=2 gloo."""
    return _bench_block("tp", quick, world_size)


def bench_tp_sp(quick: bool = False, world_size: int = 2) -> list[dict]:
    """shardlib's sequence-parallel block (shards kept, gathered again in backward) vs torch's
    SequenceParallel plan on the same block, t=2 gloo."""
    return _bench_block("tp-sp", quick, world_size)


CHECKS = {"tp": (verify_tp, (1, 2, 3, 4)), "tp-sp": (verify_tp, (1, 2, 3, 4))}
BENCHMARKS = {"tp": bench_tp, "tp-sp": bench_tp_sp}
