"""Accelerate's big-model inference: a model larger than one device's budget, placed layer by layer (lesson 09).

https://huggingface.co/docs/accelerate/usage_guides/big_modeling. The model is created on the meta
device (`init_empty_weights`: shapes, no bytes), a `device_map` is computed under a `max_memory`
budget (`infer_auto_device_map`: whole blocks, in order, onto the first place with room: GPUs, then
"cpu", then "disk"), and `load_checkpoint_and_dispatch` loads each weight where the map says, with
hooks that move a block's weights (or its inputs) to where it computes, just in time.

It is lesson 05's naive model parallelism for inference: the layers are cut into consecutive stages,
one request runs through them in sequence and one place works at a time. Per place the bytes are
those of its layers (Psi_place * bytes per element); per token every offloaded weight is read
again (from CPU memory to the GPU, or from disk), so time per token grows with the bytes offloaded.
On this machine the places are "cpu" (memory) and "disk" (memory-mapped files in an offload folder);
with a GPU, "0" comes first.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

from shardlib.models import GPT, GPTConfig, build_gpt

__all__ = ["BIG_GPT", "pipeline_time_per_token", "place_model", "placement_table", "save_checkpoint", "time_per_token"]

BIG_GPT = GPTConfig(seq_len=64, n_layer=8, n_head=4, n_embd=128)  # Psi = 1.65M, 6.6 MB in fp32


def save_checkpoint(config: GPTConfig, folder: Path, seed: int = 0) -> Path:
    """The GPT's weights (from `seed`) as one safetensors file: what a downloaded checkpoint would be."""
    from safetensors.torch import save_file

    path = Path(folder) / "model.safetensors"
    save_file({k: v.contiguous() for k, v in build_gpt(config, seed=seed).state_dict().items()}, str(path),
              metadata={"format": "pt"})
    return path


def place_model(config: GPTConfig, checkpoint: Path, max_memory: dict, offload_folder: Path):
    """An empty model (meta device), a device_map under `max_memory`, the weights loaded where it says.

    Returns (model, device_map). max_memory: e.g. {"cpu": "3MB"}, or {0: "2GiB", "cpu": "8GiB"} with a GPU;
    what does not fit goes to "disk" (offload_folder).
    """
    from accelerate import (
        infer_auto_device_map,
        init_empty_weights,
        load_checkpoint_and_dispatch,
    )

    with init_empty_weights():
        model = GPT(config)  # every parameter on the meta device: no bytes yet
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=["Block"])
    # offloading is the point here, not a surprise: Accelerate's notice and progress bar are kept quiet
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        model = load_checkpoint_and_dispatch(model, str(checkpoint), device_map=device_map,
                                             offload_folder=str(offload_folder), offload_state_dict=False)
    return model.eval(), device_map


@contextlib.contextmanager
def _quiet():
    logger = logging.getLogger("accelerate")
    level, logger.level = logger.level, logging.ERROR
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def placement_table(model: torch.nn.Module, device_map: dict) -> dict:
    """{place: {"modules": [...], "bytes": n}}: where each module of the map landed and its weight bytes."""
    table = defaultdict(lambda: {"modules": [], "bytes": 0})
    for name, place in device_map.items():
        module = model.get_submodule(name) if name else model
        n = sum(p.numel() * p.element_size() for p in module.parameters())
        table[str(place)]["modules"].append(name or "(whole model)")
        table[str(place)]["bytes"] += n
    return dict(table)


@torch.no_grad()
def time_per_token(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int = 8, repeats: int = 3) -> tuple:
    """(seconds per generated token, the tokens): greedy GPT.generate, best of `repeats` runs after a
    one-token warm-up (the first call pays one-time costs: allocations, the hooks' first moves).

    Timed on one CPU thread, as each of lesson 05's pipeline ranks computes (and as a busy 2-core
    machine times most steadily)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.generate(prompt, 1)
        best, out = float("inf"), None
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(prompt, new_tokens)  # (b, T0 + new_tokens)
            best = min(best, (time.perf_counter() - start) / new_tokens)
    finally:
        torch.set_num_threads(threads)
    return best, out


def _pipeline_on_rank(config: GPTConfig, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    import torch.distributed as dist

    from shardlib.inference.generate import generate_pipelined
    from shardlib.launch import current_device
    from shardlib.parallel.pipeline import gpt_stage

    stage = gpt_stage(build_gpt(config, seed=0).eval(), dist.get_rank(), dist.get_world_size()).to(current_device())
    prompt = prompt.to(current_device())  # (b, T0)
    best, ids = float("inf"), None
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        result = generate_pipelined(stage, prompt, new_tokens)
        best = min(best, (time.perf_counter() - start) / new_tokens)
        ids = result.ids.cpu() if stage.is_last else ids
    return {"seconds": best, "ids": ids}


def pipeline_time_per_token(config: GPTConfig, prompt: torch.Tensor, stages: int, new_tokens: int = 8,
                            repeats: int = 3) -> tuple:
    """Lesson 05's pipeline for generation: p stages on p ranks, one group of requests (naive, m = 1).

    shardlib's generate_pipelined keeps a KV cache, GPT.generate does not: compare the ratio
    (p stages / one stage), not the absolute times, with the ratio of the placements above.
    """
    from shardlib.launch import launch

    results = launch(_pipeline_on_rank, stages, args=(config, prompt, new_tokens, repeats), timeout=180,
                     device="cpu")  # beside the placements, which compute on the CPU: the same kind of rank
    return results[-1]["seconds"], results[-1]["ids"]


def new_offload_folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="offload-")
