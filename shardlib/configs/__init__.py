"""Launch configs: Accelerate FSDP2 configs per layout (accelerate/) and a Slurm script for 2 nodes.

Find them with shardlib.resources.config_path (they ship inside the package).
"""
