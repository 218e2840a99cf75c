"""Training layouts, one technique per file (lessons 02-06, 11-13).

    ddp.py             data parallelism: naive, bucketed and overlapped (lesson 02)
    zero.py            ZeRO-1 and ZeRO-2: optimizer state and gradients sharded (lesson 03)
    fsdp.py            ZeRO-3 / FSDP: parameters sharded too, fully_shard, prefetch (lessons 03, 13)
    zero_stages.py     one interface over the three ZeRO stages (lessons 03, 06)
    tensor.py          tensor parallelism: column and row parallel linear, f and g, sequence parallelism (lesson 04)
    tensor_gpt.py      the course GPT split t ways, Megatron style (lesson 04)
    pipeline.py        pipeline parallelism: stages, micro-batches, one training step (lessons 05, 13)
    schedules.py       naive, GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules; bubbles (lessons 05, 13)
    split_backward.py  backward split into input and weight gradients, for zero-bubble schedules (lesson 13)
    tied_embeddings.py an embedding tied to the output layer across pipeline stages: the two ends' gradients summed
    hybrid.py          the techniques composed on a mesh: DP x TP x PP, ZeRO-3 x TP, HSDP (lesson 06)
    context.py         context parallelism: who holds which tokens (contiguous, zigzag), formulas (lesson 11)
    ring_attention.py  ring attention: K, V blocks around the ring, online-softmax merge (lesson 11)
    ulysses.py         Ulysses: all-to-all from sequence-sharded to head-sharded and back (lesson 11)
    context_gpt.py     the course GPT on a split sequence (lesson 11)
    experts.py         mixture of experts and expert parallelism: router, capacity, all-to-all (lesson 12)
    recompute.py       full and selective activation recomputation (lesson 13)
    precision.py       mixed precision: fp16 with loss scaling, bf16, fp32 master weights (lesson 13)
    offload.py         optimizer state offloaded to CPU memory (lesson 13)
"""
