"""Inference under each layout (lessons 06 and 10).

    generate.py   greedy generation with a KV cache, on one device, TP ranks, DP replicas or PP stages
    serving.py    measured serving: tokens per second and latency per layout, on CPU ranks or an emulated device
"""
