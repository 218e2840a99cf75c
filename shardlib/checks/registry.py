"""One registry for `python -m shardlib verify` and `python -m shardlib bench`.

Each family module of shardlib.checks declares what it offers:

    CHECKS = {"ddp": (verify_data_parallel, (1, 2, 3, 4)), ...}   technique -> (check, default world sizes)
    BENCHMARKS = {"ddp": bench_ddp}                                 benchmark -> function

A check takes a world size, `technique=` and `device=` ("cpu", "cuda" or "auto"), runs the technique
on that many ranks and on one device from the same seed, and returns a dict with at least `passed`
(bool), `max_abs_diff` and `max_rel_diff` (floats), and may add `detail` (str). A check that raises
counts as failed, and its record carries the whole traceback of the failing rank. A family may declare
`world_size_error(technique, world_size) -> str | None`: why a world size cannot run (verify says so
before launching anything). A benchmark returns rows (dicts) with at
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
FAMILIES = ("collectives", "ddp", "zero", "tensor", "pipeline", "hybrid", "compress", "inference", "plan", "finetune",
            "context", "experts", "frameworks", "time", "precision")


class _BrokenFamily:
    """A family module that does not import: one check and one benchmark, both raising its error,
    so that `verify` and `bench` report it (and fail) while every other family still runs."""

    def __init__(self, name: str, error_traceback: str):
        self.__name__ = f"shardlib.checks.{name}"
        self.CHECKS = {f"{name}-family": (self._raise, (1,))}
        self.BENCHMARKS = {f"{name}-family": self._raise}
        self.error_traceback = error_traceback

    def _raise(self, *args, **kwargs):
        raise ImportError(f"{self.__name__} does not import; its traceback follows.\n\n{self.error_traceback}")


def _families():
    modules = []
    for name in FAMILIES:
        try:
            modules.append(importlib.import_module(f"shardlib.checks.{name}"))
        except Exception:  # noqa: BLE001 - reported as that family's failed check, not as a crash of all
            modules.append(_BrokenFamily(name, traceback.format_exc()))
    return modules


def checks() -> dict:
    """technique -> (check function, default world sizes), over every family."""
    return {name: entry for module in _families() for name, entry in getattr(module, "CHECKS", {}).items()}


def benchmarks() -> dict:
    """benchmark name -> function, over every family."""
    return {name: fn for module in _families() for name, fn in getattr(module, "BENCHMARKS", {}).items()}


def world_size_problems(pairs: list[tuple[str, int]]) -> list[str]:
    """What is wrong with each (technique, world size) to run, said before anything is launched."""
    rules = {technique: getattr(module, "world_size_error", None)
             for module in _families() for technique in getattr(module, "CHECKS", {})}
    problems = []
    for technique, world_size in pairs:
        if world_size < 1:
            problems.append(f"{technique}: world size must be >= 1, got {world_size}")
            continue
        rule = rules.get(technique)
        problem = rule(technique, world_size) if rule else None
        if problem:
            problems.append(problem)
    return problems


def run_check(technique: str, world_size: int, registry: dict | None = None, device: str = "cpu") -> dict:
    registry = registry or checks()
    if technique not in registry:
        raise ValueError(f"unknown technique {technique!r}; known: {', '.join(registry)}")
    fn, _ = registry[technique]
    started = time.perf_counter()
    try:
        # a check of a family that does not take device= yet still runs on the CPU
        record = dict(fn(world_size, technique=technique, **({} if device == "cpu" else {"device": device})))
    except Exception as error:  # noqa: BLE001 - a crash is a failed check, reported with its whole traceback
        remote = getattr(error, "remote_traceback", None)
        record = {"passed": False, "max_abs_diff": float("nan"), "max_rel_diff": float("nan"),
                  "detail": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                  "traceback": remote or traceback.format_exc()}
    record.update(technique=technique, world_size=world_size, device=device,
                  seconds=round(time.perf_counter() - started, 2))
    return record


def verify_main(techniques: list[str] | None, world_sizes: list[int] | None, as_json: bool,
                device: str = "cpu") -> int:
    registry = checks()
    unknown = [t for t in techniques or [] if t not in registry]
    if unknown:
        print(f"unknown technique(s) {unknown}; known: {', '.join(registry)}", file=sys.stderr)
        return 2
    pairs = [(t, n) for t in techniques or list(registry) for n in world_sizes or registry[t][1]]
    problems = world_size_problems(pairs)
    if problems:
        print("nothing was run:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    records = []
    for technique, world_size in pairs:
        record = run_check(technique, world_size, registry, device=device)
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
    missed = [f"raised {row['error']}"] if "error" in row else []
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
        try:
            new_rows = registry[name](quick=quick)
        except Exception as error:  # noqa: BLE001 - a crashed benchmark is a missed one, with its traceback
            tb = getattr(error, "remote_traceback", None) or traceback.format_exc()
            new_rows = [{"benchmark": name, "case": "raised", "ours_s": float("nan"), "torch_s": float("nan"),
                         "ratio": float("nan"), "target": None, "error": f"{type(error).__name__}", "traceback": tb}]
        for row in new_rows:
            row["missed"] = missed_targets(row)
        rows.extend(new_rows)
        if not as_json:
            for row in new_rows:
                verdict = "" if row.get("target") is None else \
                    f"  (target <= {row['target']:.2f}: {'MISSED' if row['missed'] else 'met'})"
                extra = "  ".join(f"{k}={v}" for k, v in row.items() if k not in
                                  ("benchmark", "case", "ours_s", "torch_s", "ratio", "target", "missed", "traceback"))
                print(f"{row['benchmark']:<12} {row['case']:<28} ours {row['ours_s'] * 1e3:9.2f} ms  "
                      f"torch {row['torch_s'] * 1e3:9.2f} ms  ratio {row['ratio']:5.2f}{verdict}  {extra}", flush=True)
                if "traceback" in row:
                    print("     " + row["traceback"].rstrip().replace("\n", "\n     "), flush=True)
    missed = [r for r in rows if r["missed"]]
    if as_json:
        print(json.dumps(rows, indent=1, default=str))
    elif missed:
        print(f"{len(missed)} of {len(rows)} rows missed a target: "
              + "; ".join(f"{r['benchmark']} {r['case']}: {', '.join(r['missed'])}" for r in missed))
    return 1 if missed else 0
