"""One registry for `python -m shardlib verify` and `python -m shardlib bench`.

Each family module of shardlib.checks declares what it offers:

    CHECKS = {"ddp": (verify_data_parallel, (1, 2, 3, 4)), ...}   technique -> (check, default world sizes)
    BENCHMARKS = {"ddp": bench_ddp}                                 benchmark -> function

A check takes a world size and `technique=`, runs the technique on that many ranks and on one
device from the same seed, and returns a dict with at least `passed` (bool), `max_abs_diff` and
`max_rel_diff` (floats), and may add `detail` (str). A check that raises counts as failed, and its
record carries the whole traceback of the failing rank. A benchmark returns rows (dicts) with at
least `benchmark`, `case`, `ours_s`, `torch_s`, `ratio` (ours_s / torch_s) and `target` (the
largest acceptable ratio, or None); a row may add `<name>_target` = (low, high) for its column
`<name>`. `bench` exits non-zero when any row misses a target. Ratios are the result: absolute
times depend on the machine.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback

# the families, in the course's order; each is a module of shardlib.checks
FAMILIES = ("collectives", "ddp", "zero", "tensor", "pipeline", "hybrid", "compress", "inference", "plan", "finetune")


def _families():
    return [importlib.import_module(f"shardlib.checks.{name}") for name in FAMILIES]


def checks() -> dict:
    """technique -> (check function, default world sizes), over every family."""
    return {name: entry for module in _families() for name, entry in getattr(module, "CHECKS", {}).items()}


def benchmarks() -> dict:
    """benchmark name -> function, over every family."""
    return {name: fn for module in _families() for name, fn in getattr(module, "BENCHMARKS", {}).items()}


def run_check(technique: str, world_size: int, registry: dict | None = None) -> dict:
    fn, _ = (registry or checks())[technique]
    started = time.perf_counter()
    try:
        record = dict(fn(world_size, technique=technique))
    except Exception as error:  # noqa: BLE001 - a crash is a failed check, reported with its whole traceback
        remote = getattr(error, "remote_traceback", None)
        record = {"passed": False, "max_abs_diff": float("nan"), "max_rel_diff": float("nan"),
                  "detail": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                  "traceback": remote or traceback.format_exc()}
    record.update(technique=technique, world_size=world_size, seconds=round(time.perf_counter() - started, 2))
    return record


def verify_main(techniques: list[str] | None, world_sizes: list[int] | None, as_json: bool) -> int:
    registry = checks()
    unknown = [t for t in techniques or [] if t not in registry]
    if unknown:
        print(f"unknown technique(s) {unknown}; known: {', '.join(registry)}", file=sys.stderr)
        return 2
    records = []
    for technique in techniques or list(registry):
        for world_size in world_sizes or registry[technique][1]:
            record = run_check(technique, world_size, registry)
            records.append(record)
            if not as_json:
                mark = "ok  " if record["passed"] else "FAIL"
                print(f"{mark} {technique:<16} N={world_size:<2} max|diff|={record['max_abs_diff']:.2e} "
                      f"max rel={record['max_rel_diff']:.2e}  {record['seconds']:6.2f}s  {record.get('detail', '')}",
                      flush=True)
                if "traceback" in record:
                    print("     " + record["traceback"].rstrip().replace("\n", "\n     "), flush=True)
    failed = sum(not r["passed"] for r in records)
    if as_json:
        print(json.dumps(records, indent=1, default=str))
    else:
        print(f"{len(records) - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1


def missed_targets(row: dict) -> list[str]:
    """The targets a benchmark row misses: `ratio` against `target`, `<name>` against `<name>_target`."""
    missed = []
    if row.get("target") is not None and not row["ratio"] <= row["target"]:
        missed.append(f"ratio {row['ratio']:.2f} > {row['target']:.2f}")
    for key, target in row.items():
        name = key[: -len("_target")]
        if key.endswith("_target") and key != "target" and name in row and isinstance(target, (list, tuple)):
            low, high = target
            if not low <= row[name] <= high:
                missed.append(f"{name} {row[name]} outside [{low}, {high}]")
    return missed


def bench_main(names: list[str] | None, as_json: bool, quick: bool = False) -> int:
    registry = benchmarks()
    unknown = [n for n in names or [] if n not in registry]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; known: {', '.join(registry)}", file=sys.stderr)
        return 2
    rows = []
    for name in names or list(registry):
        new_rows = registry[name](quick=quick)
        for row in new_rows:
            row["missed"] = missed_targets(row)
        rows.extend(new_rows)
        if not as_json:
            for row in new_rows:
                verdict = "" if row.get("target") is None else \
                    f"  (target <= {row['target']:.2f}: {'MISSED' if row['missed'] else 'met'})"
                extra = "  ".join(f"{k}={v}" for k, v in row.items()
                                  if k not in ("benchmark", "case", "ours_s", "torch_s", "ratio", "target", "missed"))
                print(f"{row['benchmark']:<12} {row['case']:<28} ours {row['ours_s'] * 1e3:9.2f} ms  "
                      f"torch {row['torch_s'] * 1e3:9.2f} ms  ratio {row['ratio']:5.2f}{verdict}  {extra}", flush=True)
    missed = [r for r in rows if r["missed"]]
    if as_json:
        print(json.dumps(rows, indent=1, default=str))
    elif missed:
        print(f"{len(missed)} of {len(rows)} rows missed a target: "
              + "; ".join(f"{r['benchmark']} {r['case']}: {', '.join(r['missed'])}" for r in missed))
    return 1 if missed else 0
