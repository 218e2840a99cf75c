"""`python -m shardlib doctor [--json]`: what this machine gives the course, as text for a bug report.

Versions (Python, torch, accelerate, transformers, CUDA, NCCL), the GPUs and their memory, bf16 and
fp16 per GPU, what `launch(fn, N)` will pick here, whether a process may still fork ranks that use
CUDA, and for each lesson the device and ranks it will use (read from its `parameters` cell: DEVICE
and WORLD_SIZES). Everything is read without starting CUDA (shardlib/devices.py): running the doctor
never spoils later forks, in a notebook either.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardlib import devices

LESSON_KNOBS = ("DEVICE", "WORLD_SIZES", "WORLD_SIZE", "MODEL_ID")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict:
    driver = devices.nvidia_driver()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "torch": torch.__version__,
        "accelerate": _version("accelerate"),
        "transformers": _version("transformers"),
        "cuda_build": torch.version.cuda,  # the CUDA this torch was built for; None: a CPU-only build
        "nvidia_driver": driver.get("driver"),
        "driver_cuda": ".".join(map(str, driver["cuda"])) if "cuda" in driver else None,
        "nccl": nccl,
    }


def gpus() -> list[dict]:
    return [{"index": g.index, "name": g.name, "total_memory": g.total_memory, "sm": g.sm,
             "native_bf16": g.native_bf16, "mixed_precision": "bf16" if g.native_bf16 else "fp16 (loss scaling)"}
            for g in devices.visible_gpus()]


def _describe(choice: devices.DeviceChoice) -> str:
    return "cuda (NCCL)" if choice.device == "cuda" else "cpu (gloo)"


def plan(device: str, world_size: int) -> str:
    """What launch(fn, world_size, device=device) does here, in a few words."""
    try:
        choice = devices.resolve_device(device, world_size)
    except (devices.DeviceUnavailable, ValueError) as error:
        return f"fails: {error}"
    return _describe(choice)


# ---------------------------------------------------------------------------------
# lessons


def _parameters_source(notebook: Path) -> str | None:
    cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
    for cell in cells:
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            source = cell.get("source", "")
            return "".join(source) if isinstance(source, list) else source
    return None


def lesson_parameters(notebook: Path) -> dict | None:
    """The knobs of a lesson's `parameters` cell as {name: value or its source text}; None without one."""
    source = _parameters_source(notebook)
    if source is None:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    knobs = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in LESSON_KNOBS:
                try:
                    knobs[name] = ast.literal_eval(node.value)
                except ValueError:  # computed when the lesson runs: keep the expression's text
                    knobs[name] = _Expression(ast.get_source_segment(source, node.value))
    return knobs


class _Expression(str):
    """A knob's value that only running the lesson gives: shown as code, not as a string."""

    def __repr__(self) -> str:
        return str(self)


def lesson_plan(notebook: Path) -> dict:
    knobs = lesson_parameters(notebook)
    entry = {"notebook": notebook.name, "parameterised": knobs is not None}
    if knobs is None:
        return {**entry, "note": "not parameterised"}
    device = knobs.get("DEVICE")
    sizes = knobs.get("WORLD_SIZES", knobs.get("WORLD_SIZE"))
    sizes = [sizes] if isinstance(sizes, int) else sizes
    entry.update(device=device, world_sizes=sizes)
    literal = not isinstance(device, _Expression) and not isinstance(sizes, _Expression)
    if not (literal and isinstance(device, str) and isinstance(sizes, (list, tuple))
            and all(isinstance(n, int) for n in sizes)):
        found = ", ".join(f"{k}={v!r}" for k, v in knobs.items()) or "nothing the doctor reads"
        return {**entry, "note": f"parameters cell without literal DEVICE and WORLD_SIZES ({found})"}
    entry["plan"] = {str(n): plan(device, n) for n in sizes}
    return entry


def find_lessons(folder: str | None) -> Path | None:
    if folder is not None:
        return Path(folder)
    for candidate in (Path("notebooks"), Path(__file__).resolve().parents[2] / "notebooks"):
        if candidate.is_dir() and any(candidate.glob("[0-9][0-9]_*.ipynb")):
            return candidate
    return None


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------
# the report


def collect(lessons: str | None = None) -> dict:
    folder = find_lessons(lessons)
    notebooks = sorted(folder.glob("[0-9][0-9]_*.ipynb")) if folder and folder.is_dir() else []
    gpu_list = gpus()
    largest = max(len(gpu_list), 1)
    return {
        "versions": versions(),
        "gpus": gpu_list,
        "why_no_gpu": devices.why_no_gpu(),
        "auto": {str(n): plan("auto", n) for n in sorted({1, 2, largest, largest + 1})},
        "fork_safe": not devices.fork_is_poisoned(),
        "cpu_cores": os.cpu_count(),
        "lessons_folder": _shown(folder) if folder else None,
        "lessons": [lesson_plan(nb) for nb in notebooks],
    }


def _gib(nbytes: int | None) -> str:
    return "memory unknown" if nbytes is None else f"{nbytes / 2**30:6.1f} GiB"


def format_report(facts: dict) -> str:
    v = facts["versions"]
    cuda = (f"built for CUDA {v['cuda_build']}" if v["cuda_build"] else "CPU-only build") + (
        f"; NVIDIA driver {v['nvidia_driver']} runs CUDA up to {v['driver_cuda']}" if v["nvidia_driver"] else
        "; no NVIDIA driver")
    lines = ["shardlib doctor", "",
             f"  python        {v['python']} ({v['platform']}), {facts['cpu_cores']} CPU cores",
             f"  torch         {v['torch']} ({cuda})",
             f"  NCCL          {v['nccl'] or 'not in this torch build'}",
             f"  accelerate    {v['accelerate']}",
             f"  transformers  {v['transformers']}", "",
             "GPUs (read through NVML; CUDA not started)"]
    for g in facts["gpus"]:
        lines.append(f"  cuda:{g['index']}  {g['name']:<28} {_gib(g['total_memory'])}  {g['sm']}  "
                     f"bf16 {'native' if g['native_bf16'] else 'emulated (slow)'}, fp16 yes: "
                     f"mixed precision {g['mixed_precision']}")
    if facts["why_no_gpu"]:
        lines.append(f"  {'none usable' if facts['gpus'] else 'none'}: {facts['why_no_gpu']}")
    lines += ["", "launch(fn, N) here, with device='auto' (the default)"]
    lines += [f"  N={n}: {what}" for n, what in facts["auto"].items()]
    lines += ["", "forking: " + ("safe: ranks forked from this process may use CUDA" if facts["fork_safe"] else
                                 "NOT safe: CUDA was started in this process, so forked ranks cannot use it; "
                                 "restart the kernel and launch before any CUDA call")]
    lines += ["", f"lessons ({facts['lessons_folder'] or 'no lesson folder found: pass --lessons DIR'})"]
    for lesson in facts["lessons"]:
        if "plan" in lesson:
            planned = ", ".join(f"N={n}: {what}" for n, what in lesson["plan"].items())
            lines.append(f"  {lesson['notebook']:<38} DEVICE={lesson['device']!r}  {planned}")
        else:
            lines.append(f"  {lesson['notebook']:<38} {lesson['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlib doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    parser.add_argument("--lessons", help="folder of the lesson notebooks (default: ./notebooks, else the course's)")
    args = parser.parse_args(argv)
    facts = collect(args.lessons)
    print(json.dumps(facts, indent=1) if args.json else format_report(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
