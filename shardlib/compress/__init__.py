"""Making the model smaller instead of (or as well as) splitting it (lesson 07).

    quant.py        int8 and int4 weight quantization: per tensor, per channel, in groups
    prune.py        unstructured and 2:4 pruning, with compressed storage
    quant_shard.py  quantized weights sharded over ranks (both together)
    quality.py      what compression costs: cosine to the original, probe accuracy, perplexity
"""
