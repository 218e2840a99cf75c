"""shardlib: model sharding from scratch, one technique per file, one folder per part of the course.

    launch, mesh, models, reference, memory    the foundations every lesson uses
    devices      GPUs counted without starting CUDA; the device "auto" picks (`python -m shardlib doctor`)
    comm/        collectives from scratch, the ledger of bytes sent, the alpha-beta cost (lesson 01)
    parallel/    data, ZeRO/FSDP, tensor, pipeline and hybrid parallelism (lessons 02-06)
    inference/   generation and serving under each layout (lessons 06, 10)
    compress/    quantization and pruning (lesson 07)
    plan/        the layout planner and its command line (lesson 06)
    simulate/    one rank of a large job run by the techniques on meta tensors, against the planner (lesson 14)
    finetune/    fine-tuning a real model with Accelerate + FSDP (lesson 08)
    checks/      every technique against a single-device reference: `python -m shardlib verify`, `bench`
    profile/     torch.profiler traces of every rank, merged for Perfetto, read back (`shardlib.trace`, lesson 13)
    lessons/     measurements and plots only the notebooks use
    course/      the course's own tooling (lab generation, doctor)

Each technique's docstring states, in the course's notation (Psi parameters, N ranks, p stages,
m micro-batches, t tensor-parallel size), its per-rank memory and per-step communication, with the
paper it follows.
"""

from shardlib.comm.ledger import comm_ledger
from shardlib.launch import (LaunchError, LaunchTimeout, RankError, announce_in_notebook, current_device,
                             init_from_env, launch)
from shardlib.profile.record import trace

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankError", "current_device", "init_from_env", "comm_ledger",
           "trace", "verify"]

announce_in_notebook()  # in a notebook: where the ranks will run, said in the set-up cell, before anything else


def verify(technique: str, world_size: int, *, device: str = "cpu") -> dict:
    """Run one check of `python -m shardlib verify` (the technique against one device); return its record.

    device: "cpu" (processes over gloo), "cuda" (one GPU per rank, NCCL) or "auto".
    """
    from shardlib.checks.registry import run_check

    return run_check(technique, world_size, device=device)
