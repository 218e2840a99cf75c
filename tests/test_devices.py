"""shardlib.devices: GPUs counted through NVML without starting CUDA, CUDA_VISIBLE_DEVICES as CUDA reads
it, the device "auto" picks, and the proof that nothing shardlib does in a parent spoils its forks.

The NVML layer is tested against a stand-in libnvidia-ml.so.1 compiled here (two GPUs: an sm_80 and
an sm_75), loaded by a subprocess through LD_LIBRARY_PATH exactly as the real driver's library is.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardlib import devices

REPO_ROOT = Path(__file__).resolve().parent.parent

PHYSICAL = tuple({"name": name, "uuid": uuid, "total_memory": memory, "capability": capability}
                 for name, uuid, memory, capability in [
                     ("GPU A", "GPU-1111aaaa-0000", 80 << 30, (8, 0)),
                     ("GPU B", "GPU-2222bbbb-0000", 16 << 30, (7, 5)),
                     ("GPU C", "GPU-2222cccc-0000", 24 << 30, (8, 9)),
                 ])


def names(gpus):
    return [(g.index, g.name) for g in gpus]


@pytest.mark.parametrize("setting, expected", [
    (None, [(0, "GPU A"), (1, "GPU B"), (2, "GPU C")]),
    ("2,0", [(0, "GPU C"), (1, "GPU A")]),                   # CUDA renumbers from 0 in the listed order
    (" 1 ", [(0, "GPU B")]),
    ("GPU-1111", [(0, "GPU A")]),                            # a unique UUID prefix
    ("GPU-2222,0", []),                                      # an ambiguous prefix ends the list at once
    ("0,7,1", [(0, "GPU A")]),                               # the first invalid entry ends the list
    ("1,-1,0", [(0, "GPU B")]),
    ("", []),
    ("-1", []),
    ("0,0", []),                                             # a GPU named twice: CUDA sees none
])
def test_cuda_visible_devices_is_applied_as_cuda_does(monkeypatch, setting, expected):
    if setting is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", setting)
    gpus, why = devices._visible(PHYSICAL)
    assert names(gpus) == expected, f"CUDA_VISIBLE_DEVICES={setting!r} gave {names(gpus)}"
    assert bool(why) == (not expected), f"the reason for no GPU ({why!r}) must be given exactly when none is left"


def test_a_mig_instance_counts_as_one_device_of_unknown_memory(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0f0f0f0f-1234")
    (gpu,) = devices._visible(PHYSICAL)[0]
    assert gpu.total_memory is None and gpu.uuid == "MIG-0f0f0f0f-1234" and "MIG" in gpu.name, gpu


def test_native_bf16_starts_at_ampere():
    gpus, _ = devices._visible(PHYSICAL[:2])
    assert [(g.sm, g.native_bf16) for g in gpus] == [("sm_80", True), ("sm_75", False)]


# ---------------------------------------------------------------------------------
# the choice


@pytest.fixture
def machine(monkeypatch):
    """Set what this process sees: machine(n_gpus, driver_cuda=(99, 0), built=True)."""

    def configure(count: int, driver_cuda=(99, 0), built: bool = True, poisoned: bool = False):
        physical = tuple({**PHYSICAL[0], "uuid": f"GPU-{i:04d}"} for i in range(count))
        inventory = (physical, {"driver": "999.1", "cuda": driver_cuda}, "" if count else "no GPU (faked)")
        monkeypatch.setattr(devices, "_nvml_inventory", lambda: inventory)
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(devices, "fork_is_poisoned", lambda: poisoned)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return configure


def test_auto_gives_one_gpu_per_rank_only_when_there_are_enough(machine):
    machine(2)
    assert devices.resolve_device("auto", 1).device == "cuda"
    assert devices.resolve_device("auto", 2) == devices.DeviceChoice("cuda", "2 GPUs visible (GPU A)")
    choice = devices.resolve_device("auto", 3)
    assert choice == devices.DeviceChoice("cpu", "3 ranks need 3 GPUs (one per rank) and 2 are visible"), choice
    assert devices.resolve_device("cpu", 1).device == "cpu"


@pytest.mark.parametrize("setup, words", [
    (dict(count=0), "no GPU (faked)"),
    (dict(count=2, built=False), "this PyTorch build has no CUDA"),
    (dict(count=2, driver_cuda=(1, 0)), "runs CUDA up to 1.0 and this PyTorch needs CUDA"),
])
def test_auto_falls_back_to_cpu_with_the_reason_and_cuda_refuses_with_it(machine, setup, words):
    machine(**setup)
    choice = devices.resolve_device("auto", 1)
    assert choice.device == "cpu" and words in choice.reason, choice
    with pytest.raises(devices.DeviceUnavailable, match="world_size=1 but 0 GPUs are usable here") as caught:
        devices.resolve_device("cuda", 1)
    assert words in str(caught.value)


def test_a_poisoned_parent_is_noticed_before_forking(machine):
    machine(2, poisoned=True)
    assert devices.resolve_device("auto", 2).device == "cuda", "not forking: CUDA in the parent does not matter"
    choice = devices.resolve_device("auto", 2, forking=True)
    assert choice.device == "cpu" and "restart the kernel" in choice.reason, choice
    with pytest.raises(devices.DeviceUnavailable, match="start_method='spawn'"):
        devices.resolve_device("cuda", 2, forking=True)


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda', got 'gpu'"):
        devices.resolve_device("gpu", 1)


# ---------------------------------------------------------------------------------
# the NVML layer, against a stand-in driver library

FAKE_NVML = r"""
#include <stdio.h>
#include <stdlib.h>
typedef struct { unsigned long long total, free, used; } memory_t;
static const char *names[] = {"Stand-in A100", "Stand-in T4"};
static const int majors[] = {8, 7}, minors[] = {0, 5};
static const unsigned long long totals[] = {80ULL << 30, 15ULL << 30};
static int count(void) { const char *s = getenv("FAKE_NVML_GPUS"); return s ? atoi(s) : 2; }
static int which(void *h) { return ((int)(size_t)h - 1) % 2; }
int nvmlInit_v2(void) { return getenv("FAKE_NVML_BROKEN") ? 999 : 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *n) { *n = count(); return 0; }
int nvmlSystemGetDriverVersion(char *b, unsigned n) { snprintf(b, n, "555.42.06"); return 0; }
int nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 99050; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { if ((int)i >= count()) return 2; *h = (void *)(size_t)(i + 1); return 0; }
int nvmlDeviceGetCudaComputeCapability(void *h, int *a, int *b) { *a = majors[which(h)]; *b = minors[which(h)]; return 0; }
int nvmlDeviceGetMemoryInfo(void *h, memory_t *m) { m->total = totals[which(h)]; m->used = 0; m->free = m->total; return 0; }
int nvmlDeviceGetName(void *h, char *b, unsigned n) { snprintf(b, n, "%s", names[which(h)]); return 0; }
int nvmlDeviceGetUUID(void *h, char *b, unsigned n) { snprintf(b, n, "GPU-%04d-stand-in", (int)(size_t)h); return 0; }
"""


@pytest.fixture(scope="module")
def fake_nvml_dir(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        pytest.skip("building the stand-in NVML library needs Linux and a C compiler (cc)")
    folder = tmp_path_factory.mktemp("fake_nvml")
    (folder / "nvml.c").write_text(FAKE_NVML)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "libnvidia-ml.so.1"), str(folder / "nvml.c")],
                   check=True, capture_output=True)
    return folder


def run_python(code: str, extra_env: dict | None = None, timeout: float = 300) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object last."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


READ_GPUS = """
    import json, os
    from shardlib import devices
    gpus = devices.visible_gpus()
    print(json.dumps({"gpus": [[g.index, g.name, g.total_memory, g.sm, g.native_bf16, g.uuid] for g in gpus],
                      "driver": devices.nvidia_driver(), "why": devices.why_no_gpu()}))
"""


@pytest.mark.slow
def test_gpus_are_read_from_the_driver_library(fake_nvml_dir):
    seen = run_python(READ_GPUS, {"LD_LIBRARY_PATH": str(fake_nvml_dir)})
    assert seen["gpus"] == [[0, "Stand-in A100", 80 << 30, "sm_80", True, "GPU-0001-stand-in"],
                            [1, "Stand-in T4", 15 << 30, "sm_75", False, "GPU-0002-stand-in"]], seen
    assert seen["driver"] == {"driver": "555.42.06", "cuda": [99, 5]}, seen
    if torch.backends.cuda.is_built():
        assert seen["why"] == "", seen
    seen = run_python(READ_GPUS, {"LD_LIBRARY_PATH": str(fake_nvml_dir), "CUDA_VISIBLE_DEVICES": "GPU-0002"})
    assert [g[1] for g in seen["gpus"]] == ["Stand-in T4"], seen
    seen = run_python(READ_GPUS, {"LD_LIBRARY_PATH": str(fake_nvml_dir), "FAKE_NVML_BROKEN": "1"})
    assert seen["gpus"] == [] and "did not answer (nvmlInit error 999)" in seen["why"], seen
    seen = run_python(READ_GPUS, {"LD_LIBRARY_PATH": str(fake_nvml_dir), "FAKE_NVML_GPUS": "0"})
    assert seen["gpus"] == [] and "lists no GPU" in seen["why"], seen


# ---------------------------------------------------------------------------------
# nothing shardlib does in a parent spoils its forks

FORK_AUDIT = """
    import importlib, json, os, pkgutil, sys
    import torch

    def forked_child_is_in_bad_fork():  # this test's own probe, independent of shardlib.devices
        pid = os.fork()
        if pid == 0:
            os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3

    audit = {}
    import shardlib
    audit["import shardlib"] = forked_child_is_in_bad_fork()
    for module in pkgutil.walk_packages(shardlib.__path__, "shardlib."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    audit["import every shardlib module (lessons/ included)"] = forked_child_is_in_bad_fork()

    from shardlib import devices, launch
    launch_module = sys.modules["shardlib.launch"]

    def rank_state():
        if shardlib.current_device().type == "cuda":  # on a GPU machine: prove the rank can use it
            torch.ones(1, device=shardlib.current_device()).sum().item()
        return torch.cuda._is_in_bad_fork()

    CALLS = [
        ("devices.visible_gpus()", lambda: devices.visible_gpus()),
        ("devices.why_no_gpu()", lambda: devices.why_no_gpu()),
        ("devices.nvidia_driver()", lambda: devices.nvidia_driver()),
        ("devices.fork_is_poisoned()", lambda: devices.fork_is_poisoned()),
    ] + [(f"resolve_device({d!r}, {n}, forking=True)", lambda d=d, n=n: devices.resolve_device(d, n, forking=True))
         for d in ("auto", "cuda", "cpu") for n in (1, 2)] + [
        (f"launch's device choice {d!r} backend={b!r}",
         lambda d=d, b=b: launch_module._device_and_backend(d, b, 2, forking=True, say="audit"))
        for d in ("auto", "cuda", "cpu") for b in (None, "gloo", "nccl")]
    RANKS = [("launch(f, 2)", {}), ("launch(f, 2, device='cpu')", {"device": "cpu"}),
             ("launch(f, 1, device='cuda')", {"device": "cuda"}), ("launch(f, 2, backend='gloo')", {"backend": "gloo"}),
             ("launch(f, 2, backend='nccl')", {"backend": "nccl"}),
             ("launch(f, 2, device='cpu', backend='nccl')", {"device": "cpu", "backend": "nccl"})]
    if os.environ.get("AUDIT_DECISIONS_ONLY"):  # GPUs faked: ranks must not try to use them
        RANKS = [r for r in RANKS if r[1].get("device") == "cpu" or r[1].get("backend") == "gloo"]
    for what, call in CALLS:
        try:
            call()
        except Exception as error:  # refusals are part of the checks: what matters is the fork afterwards
            what += f" (raised {type(error).__name__})"
        audit[what] = forked_child_is_in_bad_fork()
    for what, options in RANKS:
        try:
            ranks_in_bad_fork = any(launch(rank_state, 1 if options.get("device") == "cuda" else 2, **options))
            audit[what + ": a rank"] = ranks_in_bad_fork
        except Exception as error:
            what += f" (raised {type(error).__name__})"
        audit[what] = forked_child_is_in_bad_fork()
    torch.cuda.is_available()  # the control: this call does poison forks (on a CUDA build of torch)
    control = forked_child_is_in_bad_fork()
    print(json.dumps({"audit": audit, "control": control, "cuda_built": torch.backends.cuda.is_built()}))
"""


def check_audit(result: dict, minimum: int) -> None:
    poisoned = [what for what, bad in result["audit"].items() if bad]
    assert not poisoned, f"a forked child was in a bad fork after: {poisoned}"
    assert len(result["audit"]) >= minimum, f"the audit covered too little: {list(result['audit'])}"
    if result["cuda_built"]:
        assert result["control"], "the probe never sees a bad fork, even after torch.cuda.is_available()"


@pytest.mark.slow
def test_no_launch_check_import_or_device_query_spoils_later_forks():
    result = run_python(FORK_AUDIT)
    check_audit(result, minimum=30)
    assert any("a rank" in what for what in result["audit"]), result


@pytest.mark.slow
def test_with_gpus_listed_the_device_choice_still_spoils_no_fork(fake_nvml_dir):
    if not torch.backends.cuda.is_built():
        pytest.skip("a CPU-only torch never takes the GPU path")
    result = run_python(FORK_AUDIT, {"LD_LIBRARY_PATH": str(fake_nvml_dir), "AUDIT_DECISIONS_ONLY": "1"})
    check_audit(result, minimum=26)
    # the GPU branch was taken: the stand-in's two GPUs satisfied device='cuda' (NVML read, fork probed)
    assert "resolve_device('cuda', 2, forking=True)" in result["audit"], list(result["audit"])
    assert "launch's device choice 'cuda' backend=None" in result["audit"], list(result["audit"])


def cuda_queries(source: str) -> list[int]:
    """Line numbers of torch.cuda.is_available() / torch.cuda.device_count() calls (however torch is named)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("is_available", "device_count"):
            owner = node.func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "cuda") or (isinstance(owner, ast.Name) and owner.id == "cuda"):
                lines.append(node.lineno)
    return lines


def test_the_call_finder_finds_calls_and_ignores_prose():
    assert cuda_queries("import torch\nx = torch.cuda.is_available()\nfrom torch import cuda\ncuda.device_count()\n") == [2, 4]
    assert cuda_queries('"""torch.cuda.is_available() in prose"""\n# torch.cuda.device_count()\n') == []


def test_nothing_in_shardlib_asks_cuda_for_availability_or_count():
    """Both start CUDA where NVML is missing (and is_available() always), spoiling every later fork of the
    process that asks: shardlib.devices answers the same questions through NVML."""
    offenders = []
    for path in sorted((REPO_ROOT / "shardlib").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        try:
            offenders += [f"{path.relative_to(REPO_ROOT)}:{n}: {source.splitlines()[n - 1].strip()}"
                          for n in cuda_queries(source)]
        except SyntaxError as error:
            offenders.append(f"{path.relative_to(REPO_ROOT)}: does not parse ({error})")
    assert not offenders, ("use shardlib.devices (visible_gpus(), why_no_gpu(), resolve_device()) or, inside a "
                           "process already computing on CUDA, torch.cuda.is_initialized():\n" + "\n".join(offenders))
