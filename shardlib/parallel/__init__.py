"""Training layouts, one technique per file (lessons 02-06).

    ddp.py          data parallelism: naive, bucketed and overlapped (lesson 02)
    zero.py         ZeRO-1 and ZeRO-2: optimizer state and gradients sharded (lesson 03)
    fsdp.py         ZeRO-3 / FSDP: parameters sharded too, fully_shard (lesson 03)
    tensor.py       tensor parallelism: column and row parallel linear, f and g, sequence parallelism (lesson 04)
    tensor_gpt.py   the course GPT split t ways, Megatron style (lesson 04)
    pipeline.py     pipeline parallelism: stages, micro-batches, one training step (lesson 05)
    schedules.py    naive, GPipe and 1F1B schedules, bubbles and timelines (lesson 05)
    hybrid.py       the techniques composed on a mesh: DP x TP x PP, ZeRO-3 x TP, HSDP (lesson 06)
"""
