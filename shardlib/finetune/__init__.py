"""Fine-tune a Hugging Face classifier with Accelerate + FSDP2 on N ranks (lesson 08).

    config.py      FinetuneConfig (checked before launch), the mixed precision a device gets
    train.py       train(config) on every rank: start_rank, resume, run_steps, summarise
    rank.py        one rank's Accelerator, its replicated or sharded model, the pieces of a step
    model.py       loading the model, strategies, how each maps to FSDP2, the shard check
    data.py        the topic data set, batches as a function of (seed, step)
    checkpoint.py  sharded checkpoints (torch.distributed.checkpoint), resume, export
    measure.py     bytes per rank and step time of each strategy, against the ZeRO formulas
    notebook.py    run_in_notebook (CPU ranks, one GPU, or a GPU per rank), launch_failure
    faults.py      fault injection for tests and the lesson (KillRank)
    cli.py         `python -m shardlib.finetune --help` lists the command-line flags

Per-rank memory and communication of each strategy: shardlib/finetune/model.py.
"""

from shardlib.finetune.config import FinetuneConfig
from shardlib.finetune.notebook import check_before_launch, launch_failure, run_in_notebook
from shardlib.finetune.train import train

__all__ = ["FinetuneConfig", "train", "run_in_notebook", "check_before_launch", "launch_failure"]
