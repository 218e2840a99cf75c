"""At full scale by simulation: shardlib's own code run as one rank of a large job.

    world.py     this process as rank r of N on torch.distributed's fake backend; the rank's groups
    meta.py      meta tensors: attention as FlashAttention, shape results remembered (speed)
    model.py     the rank's pipeline chunk(s) of a ModelSpec at its true shape, from the course's techniques
    optim.py     ZeRO 0-3 with mixed-precision AdamW over the rank's parameters
    timeline.py  bytes of parameters, gradients, optimizer state, buffers and saved activations through the step
    run.py       simulate(): one training step of one rank, the ledger's records and the timeline
    compare.py   the planner's prediction of the same rank, side by side with the ratios
    report.py    tables, JSON, the timeline plot
    cli.py       `python -m shardlib simulate`
"""

from shardlib.simulate.run import Simulation, representative_ranks, simulate

__all__ = ["Simulation", "simulate", "representative_ranks"]
