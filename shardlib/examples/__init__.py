"""Runnable scripts: each works under `torchrun` (PyTorch's launcher) and directly (shardlib.launch)."""
