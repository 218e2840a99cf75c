"""Files that ship inside the package: the course's data and the launch configs.

They are read through importlib.resources, so they are found wherever shardlib is installed
(a checkout, a wheel, `pip install git+URL` on a cloud notebook), from any working folder:

    data_path("course_text.txt")            shardlib/data/course_text.txt   (lessons 02-07)
    data_path("sentences.txt")              shardlib/data/sentences.txt     (lesson 07)
    data_path("topics")                     shardlib/data/topics/           (lessons 07, 08)
    config_path("accelerate", "fsdp2_1node_8gpu.yaml")                      (lesson 08, README)
    config_path("slurm_2node.sbatch")

Provenance and licence of the data: data/README.md in the repository (CC BY 4.0).
From a shell: `python -c "import shardlib.resources as r; print(r.config_path('slurm_2node.sbatch'))"`.
"""

from __future__ import annotations

import atexit
import contextlib
from importlib import resources
from pathlib import Path

__all__ = ["data_path", "config_path", "config_names"]

_extracted = contextlib.ExitStack()  # files copied out of a zipped install, deleted at exit
atexit.register(_extracted.close)


def _on_disk(package: str, parts: tuple[str, ...]) -> Path:
    """A real path for a packaged file or folder; a clear error naming what exists when it is missing."""
    resource = resources.files(package).joinpath(*parts)
    if not resource.is_file() and not resource.is_dir():
        present = sorted(entry.name for entry in resources.files(package).iterdir()
                         if not entry.name.startswith(("_", ".")))
        raise FileNotFoundError(f"{'/'.join(parts)!r} is not among the files {package} ships ({', '.join(present)}); "
                                "a partial install? Reinstall shardlib")
    if isinstance(resource, Path):  # an ordinary install: the file itself
        return resource
    return _extracted.enter_context(resources.as_file(resource))  # zipped: a temporary copy


def data_path(*parts: str) -> Path:
    """A file or folder of shardlib/data, e.g. data_path("topics", "train.jsonl")."""
    return _on_disk("shardlib.data", parts)


def config_path(*parts: str) -> Path:
    """A launch config of shardlib/configs, e.g. config_path("accelerate", "fsdp2_1node_2gpu.yaml")."""
    return _on_disk("shardlib.configs", parts)


def config_names() -> list[str]:
    """Every shipped config file, relative to shardlib/configs ("accelerate/fsdp2_1node_1gpu.yaml", ...)."""
    root = config_path()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and not p.name.startswith(("_", ".")) and p.suffix not in (".py", ".pyc"))
