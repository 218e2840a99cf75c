"""Which device the ranks compute on, decided without starting CUDA in the calling process.

A process that forks ranks must not start CUDA first: PyTorch then marks every later fork as bad,
and a forked rank that touches CUDA fails with "Cannot re-initialize CUDA in forked subprocess"
(https://pytorch.org/docs/stable/notes/multiprocessing.html#poison-fork-in-multiprocessing).
`torch.cuda.is_available()` starts it (it calls cudaGetDeviceCount), and so does
`torch.cuda.device_count()` wherever NVML is missing, on a laptop without an NVIDIA driver too.

NVML, the NVIDIA driver's management library (the one `nvidia-smi` reads), counts and describes
the GPUs without creating a CUDA context, which is why PyTorch itself asks it when
PYTORCH_NVML_BASED_CUDA_CHECK=1. This module reads it through ctypes and applies
CUDA_VISIBLE_DEVICES the way the CUDA runtime documents it
(https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#env-vars):

    visible_gpus()          the GPUs a CUDA process started here would see: name, memory, sm_XY
    resolve_device(d, N)    "auto" | "cpu" | "cuda" for N ranks -> DeviceChoice(device, reason)
    fork_is_poisoned()      would a child forked now find CUDA unusable? (a forked child answers)

It only reads the machine: no memory per rank, no communication. NVIDIA GPUs only: a ROCm build
of PyTorch is treated as having no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import warnings
from dataclasses import dataclass

import torch

__all__ = ["GPU", "DeviceChoice", "DeviceUnavailable", "visible_gpus", "why_no_gpu", "nvidia_driver",
           "resolve_device", "fork_is_poisoned"]

DEVICES = ("auto", "cpu", "cuda")


class DeviceUnavailable(RuntimeError):
    """device="cuda" was asked for and this process cannot give it (too few GPUs, no driver...)."""


@dataclass(frozen=True)
class GPU:
    """One GPU as a CUDA process started here would number it."""

    index: int  # cuda:<index> in a process started here (CUDA_VISIBLE_DEVICES applied)
    name: str
    total_memory: int | None  # bytes; None for a MIG instance (NVML describes it through its parent)
    capability: tuple[int, int]  # compute capability (major, minor): sm_80 is (8, 0)
    uuid: str

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware: Ampere (sm_80) and newer. Older GPUs (T4 sm_75, V100 sm_70)
        emulate it slowly; their mixed precision is fp16 with loss scaling."""
        return self.capability >= (8, 0)

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # "cpu" or "cuda"
    reason: str  # one sentence a learner can act on


# ---------------------------------------------------------------------------------
# NVML, read once per process (the hardware does not change under a running kernel)

_NVML_LIBRARIES = {"win32": ("nvml.dll",), "linux": ("libnvidia-ml.so.1",)}


class _Memory(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _text(call, *args) -> str:
    buffer = ctypes.create_string_buffer(96)
    return buffer.value.decode(errors="replace") if call(*args, buffer, ctypes.c_uint(96)) == 0 else "?"


def _describe(nvml, index: int) -> dict:
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
        raise OSError(f"NVML could not open GPU {index}")
    major, minor, memory = ctypes.c_int(0), ctypes.c_int(0), _Memory()
    nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor))
    has_memory = nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0
    return {"name": _text(nvml.nvmlDeviceGetName, handle), "uuid": _text(nvml.nvmlDeviceGetUUID, handle),
            "total_memory": memory.total if has_memory else None, "capability": (major.value, minor.value)}


@functools.lru_cache(maxsize=1)
def _nvml_inventory() -> tuple[tuple[dict, ...], dict, str]:
    """(every GPU NVML lists, driver facts, why there is none when the tuple is empty)."""
    names = _NVML_LIBRARIES.get(sys.platform, ())
    nvml = None
    for name in names:
        try:
            nvml = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if nvml is None:
        return (), {}, "no NVIDIA driver here (its NVML library is not installed)"
    status = nvml.nvmlInit_v2()
    if status != 0:
        return (), {}, f"the NVIDIA driver is installed but did not answer (nvmlInit error {status})"
    try:
        count, cuda_version = ctypes.c_uint(0), ctypes.c_int(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return (), {}, "the NVIDIA driver could not count its GPUs"
        driver = {"driver": _text(nvml.nvmlSystemGetDriverVersion)}
        if nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda_version)) == 0:
            driver["cuda"] = (cuda_version.value // 1000, cuda_version.value % 1000 // 10)  # 12040 -> (12, 4)
        gpus = tuple(_describe(nvml, i) for i in range(count.value))
        return gpus, driver, "" if gpus else "the NVIDIA driver lists no GPU"
    except (OSError, AttributeError) as error:  # an old driver without one of the calls above
        return (), {}, f"the NVIDIA driver's NVML did not answer as expected ({error})"
    finally:
        nvml.nvmlShutdown()


def nvidia_driver() -> dict:
    """{"driver": "550.54.15", "cuda": (12, 4)}: the driver's version and the newest CUDA it runs; {} without one."""
    return dict(_nvml_inventory()[1])


# ---------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES, as the CUDA runtime reads it


def _visible(physical: tuple[dict, ...]) -> tuple[list[GPU], str]:
    """Apply CUDA_VISIBLE_DEVICES to NVML's list: (GPUs in CUDA's numbering, why none if empty)."""
    setting = os.environ.get("CUDA_VISIBLE_DEVICES")
    if setting is None:
        chosen = list(physical)
    else:
        chosen = []
        for entry in (e.strip() for e in setting.split(",")):
            if entry.startswith("MIG-") and physical:  # one slice of a GPU: described by its parent
                parent = max(physical, key=lambda g: g["capability"])
                found = {**parent, "name": f"{parent['name']} (MIG instance)", "uuid": entry, "total_memory": None}
            elif entry.isdigit() and int(entry) < len(physical):
                found = physical[int(entry)]
            else:
                matches = [g for g in physical if entry and g["uuid"].startswith(entry)]
                found = matches[0] if len(matches) == 1 else None
            if found is None:  # CUDA stops at the first entry it cannot use
                break
            if found in chosen:  # CUDA sees no device at all when one is named twice
                return [], f"CUDA_VISIBLE_DEVICES={setting!r} names a GPU twice, so CUDA sees none"
            chosen.append(found)
        if physical and not chosen:
            return [], f"CUDA_VISIBLE_DEVICES={setting!r} hides every GPU"
    return [GPU(index=i, **g) for i, g in enumerate(chosen)], ""


def visible_gpus() -> list[GPU]:
    """The GPUs cuda:0, cuda:1, ... of a process started here, without starting CUDA."""
    physical, _, _ = _nvml_inventory()
    return _visible(physical)[0]


def why_no_gpu() -> str:
    """Why visible_gpus() is empty, or why this PyTorch cannot use the GPUs it lists; "" when it can."""
    if torch.version.hip:
        return "this is a ROCm build of PyTorch; the course's automatic device choice covers NVIDIA GPUs"
    if not torch.backends.cuda.is_built():
        return "this PyTorch build has no CUDA (a CPU-only wheel)"
    physical, driver, why = _nvml_inventory()
    if not physical:
        return why
    gpus, why = _visible(physical)
    if not gpus:
        return why
    built = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    if "cuda" in driver and driver["cuda"][0] < built[0]:
        have, need = ".".join(map(str, driver["cuda"])), ".".join(map(str, built))
        return (f"the NVIDIA driver {driver['driver']} runs CUDA up to {have} and this PyTorch needs CUDA {need}: "
                "update the driver, or install a PyTorch wheel built for the driver's CUDA")
    return ""


# ---------------------------------------------------------------------------------
# fork safety and the choice


def fork_is_poisoned() -> bool:
    """True when a child forked now would find CUDA unusable (PyTorch's "bad fork").

    CUDA started in this process (is_available(), device_count() without NVML, a tensor on the GPU)
    poisons every later fork. Only a forked child can tell, so one is forked and asked.
    """
    if not hasattr(os, "fork") or not torch.backends.cuda.is_built():
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: answer through the exit status, and nothing else
        os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 3


def resolve_device(device: str, world_size: int, *, forking: bool = False) -> DeviceChoice:
    """The device `world_size` ranks compute on: one GPU per rank, or CPU processes.

    device: "cuda" (GPUs or DeviceUnavailable), "cpu", or "auto" (GPUs when there is one per
        rank and they are usable, else CPU, saying why).
    forking: the ranks will be forked from this process, so CUDA must not be started here.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cpu":
        return DeviceChoice("cpu", "device='cpu' was asked for")
    why, gpus = why_no_gpu(), visible_gpus()
    if why and device == "cuda":
        raise DeviceUnavailable(f"device='cuda' needs one GPU per rank: world_size={world_size} but 0 GPUs "
                                f"are usable here: {why}. "
                                "Use device='auto' (CPU ranks when there are no usable GPUs) or device='cpu'.")
    if not why and len(gpus) < world_size:
        if device == "cuda":
            raise DeviceUnavailable(
                f"device='cuda' needs one GPU per rank: world_size={world_size} but {len(gpus)} GPU"
                f"{' is' if len(gpus) == 1 else 's are'} visible. Lower world_size to {len(gpus)}, or use "
                "device='auto' (CPU ranks when the GPUs do not suffice) or device='cpu'.")
        why = (f"{world_size} ranks need {world_size} GPUs (one per rank) and {len(gpus)} "
               f"{'is' if len(gpus) == 1 else 'are'} visible")
    if not why and forking and fork_is_poisoned():
        why = ("CUDA was already started in this process (torch.cuda.is_available(), device_count() or a "
               "CUDA tensor), so forked ranks cannot use it: restart the kernel and launch before any CUDA call")
        if device == "cuda":
            raise DeviceUnavailable(f"device='cuda': {why}, or start the ranks with start_method='spawn' "
                                    "from a function imported from a .py module.")
    if why:
        return DeviceChoice("cpu", why)
    names = sorted({g.name for g in gpus})
    return DeviceChoice("cuda", f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''} visible ({', '.join(names)})")
