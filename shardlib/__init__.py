"""shardlib: model sharding from scratch, one technique per file.

The library behind the sharding course. Each module implements one technique and
states, in its docstring, its per-rank memory and per-step communication in the
course's notation (Psi parameters, N ranks, p stages, m micro-batches, t tensor-
parallel size), with the paper it follows.
"""

from shardlib.launch import LaunchError, LaunchTimeout, RankError, current_device, init_from_env, launch

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankError", "current_device", "init_from_env"]
