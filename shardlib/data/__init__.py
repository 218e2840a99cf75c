"""The small data the course ships (provenance and licence: data/README.md in the repository, CC BY 4.0).

Read it through shardlib.resources.data_path, never through a path relative to this file.
"""
