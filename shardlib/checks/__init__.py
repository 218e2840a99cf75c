"""Each technique held against an independent reference: `python -m shardlib verify` and `bench`.

registry.py lists the families; each family module (collectives, ddp, zero, tensor, pipeline,
hybrid, compress, inference, plan, finetune) declares its CHECKS and BENCHMARKS; harness.py holds
what they share. Checks import techniques; techniques never import checks.
"""
