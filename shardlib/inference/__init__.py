"""Inference under each layout (lessons 06 and 10).

    generate.py            greedy generation with a KV cache, on one device, TP ranks, DP replicas or PP stages
    kv_cache.py            the KV cache, contiguous or paged, its bytes measured and its formula
    batching.py            requests, the scheduler (static or continuous, under a KV budget), the serving loop
    pipelined_batching.py  continuous batching through pipeline stages, m batches in flight
    load.py                Poisson and day-shaped arrivals; TTFT, TPOT, end-to-end latency, SLO attainment
    queueing.py            the M/G/c formulas a batched server's latency is held against
    under_load.py          one stream of requests served by one device, replicas, TP or PP, on CPU ranks
    autoscale.py           replicas added and removed from measured p99 through a day, and their cost
    serving.py             measured serving of one batch: tokens per second and latency per layout
"""
