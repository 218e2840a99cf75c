"""Ring all-reduce from scratch against torch.distributed.all_reduce, with the bytes each sends.

One function, `compare`, runs on every rank; two launchers can start it:

    torchrun --nproc-per-node 2 -m shardlib.examples.ring_allreduce      # PyTorch's launcher
    python -m shardlib.examples.ring_allreduce --world-size 3            # shardlib.launch

Under torchrun the ranks join the group from torchrun's environment (several nodes
work the same way: add --nnodes and --rdzv-endpoint); run directly, `shardlib.launch`
forks the ranks on this machine. Both choose the device the same way (`--device auto`:
one GPU per rank over NCCL when the machine has enough, else CPU ranks over gloo), and
every tensor lives on `current_device()`. Each rank sends 2(N-1)/N * S bytes in the ring
all-reduce of a tensor of S bytes, S rounded up so that N divides it (padding).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from shardlib.comm import comm_ledger, ring_all_reduce, ring_sent_bytes
from shardlib.launch import current_device, init_from_env, launch


def compare(numel: int = 1001, seed: int = 0) -> dict:
    """On each rank: sum a random tensor over the ranks both ways; return what each sent."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank))  # (numel,) same values anywhere
    x = x.to(current_device())
    with comm_ledger() as ours_ledger:
        ours = ring_all_reduce(x.clone())  # (numel,) summed over ranks
    with comm_ledger(record_torch=True) as torch_ledger:  # PyTorch's own call is recorded only when asked
        theirs = x.clone()
        dist.all_reduce(theirs)  # (numel,)
    return {
        "rank": rank,
        "world_size": world_size,
        "device": str(x.device),
        "max_abs_diff": (ours - theirs).abs().max().item(),
        "sent_bytes": ours_ledger.sent_bytes(),
        "ring_formula_bytes": ring_sent_bytes("all_reduce", numel, world_size, x.element_size()),
        "ours_ledger": repr(ours_ledger),
        "torch_ledger": repr(torch_ledger),
    }


def agrees(result: dict) -> bool:
    """Same sum as torch (fp32 tolerance) and exactly the ring's bytes sent."""
    return result["max_abs_diff"] <= 1e-5 and result["sent_bytes"] == result["ring_formula_bytes"]


def report(results: list[dict], numel: int) -> bool:
    """Print one line per rank and rank 0's ledgers; return True when everything agrees."""
    n = results[0]["world_size"]
    device = results[0]["device"].split(":")[0]
    print(f"ring all-reduce of {numel} fp32 values ({4 * numel:,} bytes) on {n} ranks ({device}), "
          "against torch.distributed")
    ok = True
    for r in results:
        good = agrees(r)
        ok &= good
        print(f"  rank {r['rank']}: max|ours - torch| = {r['max_abs_diff']:.1e}   sent {r['sent_bytes']:,} bytes, "
              f"ring formula 2(N-1)*ceil(numel/N)*4 = {r['ring_formula_bytes']:,}   {'ok' if good else 'MISMATCH'}")
    print("\nrank 0, ours (every isend/recv of the ring):")
    print(results[0]["ours_ledger"])
    print("\nrank 0, torch.distributed.all_reduce (charged at the ring formula):")
    print(results[0]["torch_ledger"])
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlib.examples.ring_allreduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start when run without torchrun")
    parser.add_argument("--numel", type=int, default=1001, help="elements in the tensor (need not divide by N)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: one GPU per rank when there are enough, else CPU ranks (default)")
    args = parser.parse_args(argv)
    if args.numel < 1:
        parser.error(f"--numel must be >= 1, got {args.numel}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        init_from_env(device=args.device)
        try:
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, compare(args.numel))  # every rank's dict, on every rank
            rank = dist.get_rank()
        finally:
            dist.destroy_process_group()
        if rank != 0:  # rank 0 prints the report; the exit status of every rank tells the truth
            return 0 if all(agrees(r) for r in results) else 1
    else:
        if args.world_size < 1:
            parser.error(f"--world-size must be >= 1, got {args.world_size}")
        results = launch(compare, args.world_size, args=(args.numel,), device=args.device, timeout=120)
    return 0 if report(results, args.numel) else 1


if __name__ == "__main__":
    sys.exit(main())
