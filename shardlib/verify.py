"""`python -m shardlib verify`: every technique against its single-device reference.

Each entry of CHECKS names a technique (the same names the lessons and `bench` use)
and the function that checks it. A check takes a world size, runs the technique on
that many ranks and on one device from the same seed, and returns a dict with at
least `passed` (bool) and `max_abs_diff` / `max_rel_diff` (floats) and may add
`detail` (str). A check that raises counts as failed.
"""

from __future__ import annotations

import importlib
import json
import sys
import time

# technique -> ("module:function", world sizes checked by default)
CHECKS: dict[str, tuple[str, tuple[int, ...]]] = {
    "allreduce": ("shardlib.comm:verify_collective", (1, 2, 3, 4)),
    "allgather": ("shardlib.comm:verify_collective", (1, 2, 3, 4)),
    "reducescatter": ("shardlib.comm:verify_collective", (1, 2, 3, 4)),
    "broadcast": ("shardlib.comm:verify_collective", (1, 2, 3, 4)),
    "dp": ("shardlib.data_parallel_checks:verify_data_parallel", (1, 2, 3, 4)),
    "ddp": ("shardlib.data_parallel_checks:verify_data_parallel", (1, 2, 3, 4)),
    "pp-naive": ("shardlib.pipeline_checks:verify_pipeline", (2, 4)),
    "pp-gpipe": ("shardlib.pipeline_checks:verify_pipeline", (2, 4)),
    "pp-1f1b": ("shardlib.pipeline_checks:verify_pipeline", (2, 4)),
    "zero1": ("shardlib.zero_checks:verify_zero", (1, 2, 3, 4)),
    "zero2": ("shardlib.zero_checks:verify_zero", (1, 2, 3, 4)),
    "zero3": ("shardlib.zero_checks:verify_zero", (1, 2, 3, 4)),
    "tp": ("shardlib.tp_check:verify_tp", (1, 2, 4)),
    "tp-sp": ("shardlib.tp_check:verify_tp", (1, 2, 4)),
    "quant_shard": ("shardlib.quant_shard:verify_quant_shard", (1, 2, 3, 4)),
    "dp-tp": ("shardlib.hybrid_checks:verify_hybrid", (4,)),
    "zero3-tp": ("shardlib.hybrid_checks:verify_hybrid", (4,)),
    "dp-pp": ("shardlib.hybrid_checks:verify_hybrid", (4,)),
    "pp-tp": ("shardlib.hybrid_checks:verify_hybrid", (4,)),
    "dp-pp-tp": ("shardlib.hybrid_checks:verify_hybrid", (8,)),
    "hsdp": ("shardlib.hybrid_checks:verify_hybrid", (4,)),
}


def _resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def run_check(technique: str, world_size: int) -> dict:
    target, _ = CHECKS[technique]
    started = time.perf_counter()
    try:
        fn = _resolve(target)
        record = dict(fn(world_size, technique=technique))
    except Exception as error:  # noqa: BLE001 - a crash is a failed check, reported as such
        record = {"passed": False, "max_abs_diff": float("nan"), "max_rel_diff": float("nan"),
                  "detail": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    record.update(technique=technique, world_size=world_size, seconds=round(time.perf_counter() - started, 2))
    return record


def main(techniques: list[str] | None, world_sizes: list[int] | None, as_json: bool) -> int:
    unknown = [t for t in techniques or [] if t not in CHECKS]
    if unknown:
        print(f"unknown technique(s) {unknown}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    records = []
    for technique in techniques or list(CHECKS):
        for world_size in world_sizes or CHECKS[technique][1]:
            record = run_check(technique, world_size)
            records.append(record)
            if not as_json:
                mark = "ok  " if record["passed"] else "FAIL"
                print(f"{mark} {technique:<16} N={world_size:<2} max|diff|={record['max_abs_diff']:.2e} "
                      f"max rel={record['max_rel_diff']:.2e}  {record['seconds']:6.2f}s  {record.get('detail', '')}",
                      flush=True)
    if as_json:
        print(json.dumps(records, indent=1))
    else:
        failed = sum(not r["passed"] for r in records)
        print(f"{len(records) - failed} passed, {failed} failed")
    return 0 if all(r["passed"] for r in records) else 1
