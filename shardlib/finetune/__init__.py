"""Fine-tune a Hugging Face classifier with Accelerate + FSDP2 on N ranks (lesson 08).

    train.py       FinetuneConfig, train(config) (runs on every rank), run_in_notebook, the command line
    rank.py        one rank's Accelerator, its replicated or sharded model, the pieces of a step
    model.py       loading the model, strategies, how each maps to FSDP2, the shard check
    data.py        the topic data set, batches as a function of (seed, step)
    checkpoint.py  sharded checkpoints (torch.distributed.checkpoint), resume, export
    measure.py     bytes per rank and step time of each strategy, against the ZeRO formulas

`python -m shardlib.finetune --help` lists the command-line flags.
"""

from shardlib.finetune.train import FinetuneConfig, check_before_launch, main, parse_args, run_in_notebook, train

__all__ = ["FinetuneConfig", "train", "run_in_notebook", "check_before_launch", "parse_args", "main"]
