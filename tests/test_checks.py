"""The command line of the checks (`python -m shardlib verify | bench | labs`): one registry, errors that
say what to change before anything is launched, the failing rank's whole traceback, exit codes."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

import shardlib.checks.harness as harness
import shardlib.checks.registry as registry
from shardlib import launch
from shardlib.__main__ import main as cli


@pytest.fixture
def no_launch(monkeypatch):
    """Any launch fails the test: what is checked must happen before a process starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process was launched")

    monkeypatch.setattr(harness, "launch", refuse)


def test_bad_world_size_names_the_sizes_before_launching(no_launch, capsys):
    assert cli(["verify", "--technique", "dp-tp", "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "dp-tp runs on world size 4 only (mesh dp=2 x tp=2), not 3" in err
    assert cli(["verify", "--technique", "ddp", "--technique", "tp", "--world-size", "5"]) == 2
    err = capsys.readouterr().err
    assert "use a world size in (1, 2, 3, 4, 6, 12), not 5" in err  # ddp's global batch of 12
    assert "n_head=12 is not divisible by the tensor-parallel size t=5" in err
    assert cli(["verify", "--technique", "pp-1f1b", "--world-size", "8"]) == 2
    assert "cannot cut 4 transformer blocks into 8 stages" in capsys.readouterr().err


def test_unknown_technique_lists_the_known_ones(no_launch, capsys):
    assert cli(["verify", "--technique", "zero4"]) == 2
    err = capsys.readouterr().err
    assert "unknown technique(s) ['zero4']" in err and "zero3" in err


def _fails_on_rank_1():
    if dist.get_rank() == 1:
        def deep_inside():
            raise RuntimeError("simulated failure three frames down")
        deep_inside()
    dist.barrier()


def _check_that_launches_a_failure(world_size, technique, **kwargs):
    launch(_fails_on_rank_1, world_size, timeout=60)


def test_a_failing_rank_is_reported_with_its_whole_traceback(monkeypatch, capsys):
    monkeypatch.setattr(registry, "checks", lambda: {"failing": (_check_that_launches_a_failure, (2,))})
    assert registry.verify_main(["failing"], None, as_json=False) == 1
    out = capsys.readouterr().out
    assert "FAIL failing" in out and "RankError: rank 1 failed" in out
    assert "in deep_inside" in out and "in _fails_on_rank_1" in out  # the rank's frames, not only its last line
    assert "0 passed, 1 failed" in out


def test_verify_json_is_one_list_of_records(monkeypatch, capsys):
    passing = lambda world_size, technique, **kw: {"passed": True, "max_abs_diff": 0.0, "max_rel_diff": 0.0}  # noqa: E731
    monkeypatch.setattr(registry, "checks", lambda: {"fine": (passing, (1, 2))})
    assert registry.verify_main(None, None, as_json=True) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["technique"], r["world_size"], r["passed"]) for r in records] == [("fine", 1, True), ("fine", 2, True)]


def _row(ratio, target, **extra):
    return dict({"benchmark": "b", "case": f"ratio {ratio}", "ours_s": ratio, "torch_s": 1.0, "ratio": ratio,
                 "target": target}, **extra)


def test_bench_exits_non_zero_when_a_target_is_missed(monkeypatch, capsys):
    monkeypatch.setattr(registry, "benchmarks", lambda: {"met": lambda quick: [_row(1.1, 1.2)],
                                                         "missed": lambda quick: [_row(1.5, 1.2)],
                                                         "band": lambda quick: [_row(1.0, None, bytes_ratio=1.3,
                                                                                     bytes_ratio_target=(0.9, 1.1))]})
    assert registry.bench_main(["met"], as_json=False) == 0
    assert registry.bench_main(["missed"], as_json=False) == 1
    assert "ratio 1.50 > 1.20" in capsys.readouterr().out
    assert registry.bench_main(["band"], as_json=True) == 1
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["missed"] == ["bytes_ratio 1.3 outside [0.9, 1.1]"]


def test_a_benchmark_that_raises_is_a_missed_row_with_its_traceback(monkeypatch, capsys):
    def crashes(quick):
        raise ValueError("no such model")

    monkeypatch.setattr(registry, "benchmarks", lambda: {"crash": crashes})
    assert registry.bench_main(None, as_json=False) == 1
    out = capsys.readouterr().out
    assert "raised ValueError" in out and "no such model" in out


def test_a_family_that_does_not_import_fails_alone(monkeypatch, capsys):
    monkeypatch.setattr(registry, "FAMILIES", ("collectives", "no_such_family"))
    known = registry.checks()
    assert "allreduce" in known and "no_such_family-family" in known
    assert registry.verify_main(["no_such_family-family"], None, as_json=False) == 1
    assert "ModuleNotFoundError" in capsys.readouterr().out


def test_labs_json(capsys):
    code = cli(["labs", "--check", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"labs", "written", "stale", "orphans", "error", "ok"}
    assert report["ok"] == (code == 0) and report["labs"] >= 1


def test_interleaved_times_alternate_turns_and_skip_the_warmup():
    from shardlib.timing import interleaved_times

    calls, syncs = [], []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    seconds = interleaved_times(fns, repeats=3, warmup=1, statistic=len, sync=lambda: syncs.append(1))
    assert calls == ["b", "a", "a", "b", "b", "a", "a", "b"]  # each turn in the other order
    assert seconds == {"a": 3, "b": 3}  # warm-up turns are not counted
    assert len(syncs) == len(calls)
    with pytest.raises(ValueError, match="repeats"):
        interleaved_times(fns, repeats=0)


def test_a_device_without_gpus_is_refused_before_any_process_starts(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    from shardlib.launch import LaunchError

    with pytest.raises((LaunchError, ValueError), match="GPU|CUDA|cuda"):
        harness.launch_on(_fails_on_rank_1, 2, device="cuda")
