"""Fine-tuning with Accelerate + FSDP2: strategies, data, sharding, checkpoints, faults, export.

A handful of tiny real runs (all-MiniLM-L6-v2, sequences of 16 tokens, 4 steps) on 2 CPU
ranks are shared by the tests below through module-scoped fixtures. References are
independent of the code under test where they can be: DDP (PyTorch's) for FSDP's losses,
the uninterrupted run for resumed ones, the ZeRO formula for memory, a plain
single-process Hugging Face model for the exported one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlib import LaunchError, launch
from shardlib.finetune import FinetuneConfig, check_before_launch, train
from shardlib.finetune.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, model_fingerprint, read_metadata
from shardlib.finetune.cli import parse_args
from shardlib.finetune.data import DatasetError, default_data_dir, global_batch_indices, load_dataset, rank_share, read_split
from shardlib.finetune.faults import KillRank
from shardlib.finetune.model import (STRATEGY_SUMMARIES, ModelLoadError, check_strategy, load_classifier,
                                     resolve_model_path, strategy_from_launch_env)
from shardlib.memory import zero_model_state_bytes
from shardlib.resources import config_path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = default_data_dir()  # shipped inside the package: shardlib/data/topics
TINY = dict(max_length=16, batch_size=8, max_steps=4, max_eval_examples=48, progress=False)


def run(tmp: Path, world_size: int = 2, fault=None, **overrides) -> list[dict]:
    config = FinetuneConfig(**{**TINY, "output_dir": str(tmp), "device": "cpu", **overrides})
    return launch(train, world_size, args=(config, fault), device="cpu", timeout=600, prefix_output=False)


def losses(result: dict) -> list[float]:
    return [h["loss"] for h in result["history"]]


# ---------------------------------------------------------------------------------
# shared runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """FULL_SHARD on 2 ranks, uninterrupted, evaluated, exported, checkpoint every 2 steps."""
    out = tmp_path_factory.mktemp("reference")
    results = run(out, strategy="FULL_SHARD", checkpoint_every=2, keep_checkpoints=5, export=True,
                  measure_memory=True)
    return out, results


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """The reference run again, with rank 1 killed (SIGKILL) while it writes the step-3 checkpoint."""
    out = tmp_path_factory.mktemp("crashed")
    with pytest.raises(LaunchError) as error:
        run(out, strategy="FULL_SHARD", checkpoint_every=1, keep_checkpoints=5,
            fault=KillRank(rank=1, at_step=3, during_save=True))
    return out, error.value


# ---------------------------------------------------------------------------------
# input checks (no processes)


def test_strategy_names_are_checked_before_launch(capsys):
    assert [check_strategy(s.lower()) for s in STRATEGY_SUMMARIES] == list(STRATEGY_SUMMARIES)
    with pytest.raises(ValueError, match="unknown strategy 'ZERO_4'.*DDP, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD"):
        FinetuneConfig(strategy="ZERO_4")
    with pytest.raises(SystemExit):
        parse_args(["--strategy", "FSDP"])
    assert "unknown strategy 'FSDP'; choose one of: DDP, SHARD_GRAD_OP" in capsys.readouterr().err
    assert parse_args(["--strategy", "shard_grad_op", "--batch-size", "32", "--resume", "auto"]).strategy == "SHARD_GRAD_OP"


def test_bad_configs_fail_before_launch():
    with pytest.raises(ValueError, match="batch_size 10 must divide evenly over 4 ranks"):
        check_before_launch(FinetuneConfig(batch_size=10), 4)
    with pytest.raises(ValueError, match="HYBRID_SHARD needs replicate_size"):
        check_before_launch(FinetuneConfig(strategy="HYBRID_SHARD", batch_size=8), 4)
    with pytest.raises(DatasetError, match="no such dataset directory"):
        check_before_launch(FinetuneConfig(data_dir="/nonexistent/data"), 2)


def test_strategy_follows_the_accelerate_config_environment():
    assert strategy_from_launch_env({}) is None
    assert strategy_from_launch_env({"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "true"}) == "FULL_SHARD"
    assert strategy_from_launch_env({"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false"}) == "SHARD_GRAD_OP"
    assert strategy_from_launch_env({"ACCELERATE_USE_FSDP": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"}) == "HYBRID_SHARD"


def test_bad_rows_name_file_line_and_problem(tmp_path):
    good = '{"text": "a fine sentence", "label": "sport"}\n'
    cases = {
        "broken.jsonl": (good + good + '{"text": "no closing brace"\n', r"broken.jsonl, line 3: not valid JSON"),
        "nolabel.jsonl": (good + '{"text": "where is my label"}\n', r"nolabel.jsonl, line 2: missing field\(s\) \['label'\]"),
        "empty.jsonl": (good + '{"text": "  ", "label": "sport"}\n', r"empty.jsonl, line 2: 'text' must be a non-empty"),
        "list.jsonl": ('["text", "label"]\n', r"list.jsonl, line 1: expected an object"),
        "header.csv": ("sentence,topic\nhello,sport\n", r"header.csv, line 1: the header must name the columns"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(DatasetError, match=message):
            read_split(tmp_path / name)
    (tmp_path / "val.jsonl").write_text(good + '{"text": "an unseen topic", "label": "cooking"}\n')
    with pytest.raises(DatasetError, match=r"val.jsonl, line 2: label 'cooking' does not occur in the training split"):
        read_split(tmp_path / "val.jsonl", ["sport"])
    (tmp_path / "ok.csv").write_text('text,label\n"a, b",sport\nc,food\n')
    split, labels = read_split(tmp_path / "ok.csv")
    assert split.texts == ["a, b", "c"] and labels == ["food", "sport"] and split.labels == [1, 0]


def test_model_that_cannot_load_offline_gives_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load model 'no-such-org/no-such-model' offline.*--online"):
        resolve_model_path("no-such-org/no-such-model", offline=True)
    with pytest.raises(ModelLoadError, match="cannot load model 'no-such-org/no-such-model' offline"):
        check_before_launch(FinetuneConfig(model_id="no-such-org/no-such-model"), 2)
    (tmp_path / "config.json").write_text("{}")  # a directory that is not a model
    with pytest.raises(ModelLoadError, match="as a sequence classifier"):
        load_classifier(str(tmp_path), ["a", "b"], seed=0)


def test_data_order_is_a_function_of_seed_and_step():
    a = [global_batch_indices(1000, 16, step, seed=3) for step in range(130)]
    assert a == [global_batch_indices(1000, 16, step, seed=3) for step in range(130)]
    assert all(len(set(b)) == 16 for b in a)
    epoch0 = [i for b in a[:62] for i in b]
    assert len(set(epoch0)) == 62 * 16  # no example twice within an epoch
    assert a[62] != a[0]  # a new permutation each epoch
    assert rank_share(a[0], 0, 2) + rank_share(a[0], 1, 2) == a[0]


# ---------------------------------------------------------------------------------
# the course data set


def _generator():
    spec = importlib.util.spec_from_file_location("make_topics", REPO_ROOT / "data" / "make_topics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_topic_data_is_big_enough_and_test_shares_no_template_or_filler_with_train():
    splits, labels = load_dataset(DATA)
    assert len(labels) >= 4 and sum(len(s) for s in splits.values()) >= 1000
    assert not set(splits["test"].texts) & set(splits["train"].texts)
    gen = _generator()
    for topic, bank in gen.TOPICS.items():
        assert not set(bank["test_templates"]) & set(bank["train_templates"] + bank["validation_templates"])
        assert not set(bank["test_who"]) & set(bank["train_who"]), topic
        assert not set(bank["test_what"]) & set(bank["train_what"]), topic
        fixed_parts = {part.strip(" .,") for t in bank["train_templates"] for part in t.replace("{what}", "{who}").split("{who}")}
        for text in (t for t, y in zip(splits["test"].texts, splits["test"].labels) if labels[y] == topic):
            assert not any(len(part) > 12 and part in text for part in fixed_parts), text
    for clauses in gen.DISTRACTORS.values():
        assert not set(clauses["test"]) & set(clauses["train"])


def test_committed_data_is_what_the_generator_writes(tmp_path, monkeypatch):
    gen = _generator()
    monkeypatch.setattr(gen, "OUT_DIR", tmp_path)
    gen.main()
    for split in ("train", "validation", "test"):
        assert (tmp_path / f"{split}.jsonl").read_text() == (DATA / f"{split}.jsonl").read_text()


# ---------------------------------------------------------------------------------
# sharded runs


@pytest.mark.slow
def test_each_rank_holds_one_half_of_every_parameter(reference):
    _, results = reference
    plain, _ = load_classifier("sentence-transformers/all-MiniLM-L6-v2", results[0]["labels"], seed=0)
    n_params = sum(p.numel() for p in plain.parameters())
    checks = [r["shard_check"] for r in results]
    assert sum(c["local_numel"] for c in checks) == n_params == checks[0]["full_numel"]
    assert all(abs(c["fraction"] - 0.5) < 1e-3 for c in checks)
    assert results[0]["units"] == [f"bert.encoder.layer.{i}" for i in reversed(range(6))] + ["bert.embeddings", ""]


@pytest.mark.slow
def test_full_shard_model_states_match_the_zero3_formula(reference):
    _, results = reference
    predicted = zero_model_state_bytes(results[0]["n_params"], 2, 3, recipe="fp32_adam")
    for r in results:
        measured = r["memory"]["after_backward"]
        for key in ("params", "grads", "optimizer"):
            assert measured[key] == pytest.approx(predicted[key], rel=0.01), key


def _shard_grad_op_after_forward() -> tuple[int, int]:
    """On a rank: two FSDP2 units that stay gathered after their forward (SHARD_GRAD_OP); the parameter bytes
    memory_snapshot counts, and those the module alone shows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardlib.finetune.rank import memory_snapshot
    from shardlib.memory import model_state_bytes

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for unit in (*model, model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64))  # every unit gathered now, kept until its backward
    return memory_snapshot(model, optimizer)["params"], model_state_bytes(model, optimizer)["params"]


def test_shard_grad_op_holds_the_gathered_parameters_and_the_shards():
    from shardlib.finetune.measure import fsdp2_model_state_bytes

    n_params = 2 * (64 * 64 + 64)
    counted, module_only = launch(_shard_grad_op_after_forward, 2, device="cpu", timeout=120)[0]
    formula = fsdp2_model_state_bytes(n_params, 2, "SHARD_GRAD_OP")["params"]
    assert formula == 4 * n_params + 4 * n_params / 2, f"formula: {formula} B, not gathered fp32 + half in shards"
    assert counted == formula, f"counted {counted} B of parameters, the gathered copies and the shards are {formula} B"
    assert module_only == 4 * n_params, "the module alone shows only the gathered copies, not the optimizer's shards"


@pytest.mark.slow
def test_ddp_and_full_shard_losses_agree(reference, tmp_path):
    _, fsdp = reference
    ddp = run(tmp_path, strategy="DDP", measure_memory=True, stop_after=3)
    assert losses(ddp[0]) == pytest.approx(losses(fsdp[0])[:3], abs=1e-5)
    assert ddp[0]["finished"] is False and read_metadata(tmp_path / "checkpoints" / "step_000003")["strategy"] == "DDP"
    predicted = zero_model_state_bytes(ddp[0]["n_params"], 2, 0, recipe="fp32_adam")
    assert ddp[0]["memory"]["after_backward"]["total"] == pytest.approx(predicted["total"], rel=0.01)


@pytest.mark.slow
def test_killed_rank_ends_the_launch_and_the_last_checkpoint_loads(crashed):
    out, error = crashed
    assert "rank 1" in str(error) and ("exit code -9" in str(error) or "killed" in str(error))
    checkpoints = out / "checkpoints"
    assert (checkpoints / "step_000003.tmp").is_dir()  # the interrupted save, never loaded
    assert latest_checkpoint(checkpoints) == checkpoints / "step_000002"
    assert read_metadata(checkpoints / "step_000002")["step"] == 2


@pytest.mark.slow
def test_resume_after_the_kill_equals_the_uninterrupted_run(reference, crashed):
    out, _ = crashed
    resumed = run(out, strategy="FULL_SHARD", resume=True, activation_checkpointing=True, export=False)
    assert resumed[0]["start_step"] == 2
    assert losses(resumed[0]) == pytest.approx(losses(reference[1][0])[2:], abs=1e-6)
    assert resumed[0]["test"]["accuracy"] == reference[1][0]["test"]["accuracy"]


@pytest.mark.slow
def test_resume_on_another_world_size_is_close(reference, tmp_path):
    """With dropout off, a step does the same arithmetic on any number of ranks (up to sums' order)."""
    ref_out, _ = reference
    start = ref_out / "checkpoints" / "step_000002"
    two = run(tmp_path / "two", strategy="FULL_SHARD", resume=str(start), dropout=0.0, evaluate=False)
    one = run(tmp_path / "one", world_size=1, strategy="FULL_SHARD", resume=str(start), dropout=0.0, grad_accum=2,
              evaluate=False)
    assert one[0]["start_step"] == two[0]["start_step"] == 2
    assert losses(one[0]) == pytest.approx(losses(two[0]), abs=1e-5)  # step 4 uses the resharded Adam state
    assert len(losses(one[0])) == 2


@pytest.mark.slow
def test_exported_model_loads_on_one_device_with_the_same_accuracy(reference):
    out, results = reference
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    splits, labels = load_dataset(DATA)
    assert [model.config.id2label[i] for i in range(len(labels))] == labels
    test = splits["test"]
    n = TINY["max_eval_examples"]
    batch = tokenizer(test.texts[:n], padding="max_length", truncation=True, max_length=TINY["max_length"],
                      return_tensors="pt")
    with torch.no_grad():
        predictions = model(**batch).logits.argmax(-1)
    correct = int((predictions == torch.tensor(test.labels[:n])).sum())
    assert results[0]["test"]["n"] == n
    assert correct == round(results[0]["test"]["accuracy"] * n)


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(reference, tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    out, results = reference
    other = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, num_labels=5))
    fingerprint = model_fingerprint(other, other.config, "tiny-bert", results[0]["labels"])
    with pytest.raises(CheckpointError, match="written for model 'sentence-transformers/all-MiniLM-L6-v2', not for "
                                              "this run's model 'tiny-bert'.*shapes_sha256"):
        load_checkpoint(out / "checkpoints" / "step_000004", other, None, fingerprint)
    same_model_other_labels = {**read_metadata(out / "checkpoints" / "step_000004")["fingerprint"], "labels": ["x", "y"]}
    with pytest.raises(CheckpointError, match="labels: checkpoint has"):
        load_checkpoint(out / "checkpoints" / "step_000004", other, None, same_model_other_labels)


# ---------------------------------------------------------------------------------
# launchers


def test_shipped_accelerate_configs_set_up_the_strategy_they_name():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    expected = {"fsdp2_1node_1gpu.yaml": ("FULL_SHARD", 1), "fsdp2_1node_2gpu.yaml": ("FULL_SHARD", 2),
                "fsdp2_1node_4gpu.yaml": ("FULL_SHARD", 4), "fsdp2_1node_8gpu.yaml": ("FULL_SHARD", 8),
                "fsdp2_1node_8gpu_shard_grad_op.yaml": ("SHARD_GRAD_OP", 8),
                "fsdp2_2node_8gpu_hybrid.yaml": ("HYBRID_SHARD", 16)}
    configs = config_path("accelerate")
    assert sorted(p.name for p in configs.glob("fsdp2_*.yaml")) == sorted(expected)
    for name, (strategy, processes) in expected.items():
        args = launch_command_parser().parse_args(["--config_file", str(configs / name), "--main_process_port", "0",
                                                   "-m", "shardlib.finetune"])
        args, _, _ = _validate_launch_command(args)
        env = prepare_multi_gpu_env(args)
        assert (strategy_from_launch_env(env), args.num_processes) == (strategy, processes), name
        assert env["FSDP_VERSION"] == "2" and env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
        assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    slurm = config_path("slurm_2node.sbatch").read_text()
    assert "fsdp2_2node_8gpu_hybrid.yaml" in slurm and "#SBATCH --nodes=2" in slurm


@pytest.mark.slow
def test_accelerate_launch_with_an_fsdp_config_runs_on_cpu(reference, tmp_path):
    """On CPU Accelerate applies no FSDP plugin; the script shards with fully_shard itself,
    per BertLayer as the config says, and computes the reference's losses."""
    config = config_path("accelerate", "fsdp2_1node_2gpu.yaml")
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "--config_file", str(config), "--main_process_port", "0",
               "-m", "shardlib.finetune", "--device", "cpu", "--output-dir", str(tmp_path), "--max-steps", "4",
               "--max-length", "16", "--batch-size", "8", "--max-eval-examples", "48", "--no-progress"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == "FULL_SHARD" and summary["world_size"] == 2
    assert summary["units"][:6] == [f"bert.encoder.layer.{i}" for i in reversed(range(6))]
    assert losses(summary) == pytest.approx(losses(reference[1][0]), abs=1e-5)
    assert json.loads(done.stdout.strip().splitlines()[-1])["test_accuracy"] == reference[1][0]["test"]["accuracy"]


# ---------------------------------------------------------------------------------
# devices, mixed precision, launching from a notebook, reading failures (no training)


def test_mixed_precision_follows_the_gpu_and_bf16_without_native_support_names_fp16():
    from shardlib.finetune.config import resolve_mixed_precision

    assert resolve_mixed_precision("auto", "cpu") == "no"
    assert resolve_mixed_precision("auto", "cuda", (8, 0)) == "bf16"  # A100
    assert resolve_mixed_precision("auto", "cuda", (9, 0)) == "bf16"  # H100
    assert resolve_mixed_precision("auto", "cuda", (7, 5)) == "fp16"  # T4
    assert resolve_mixed_precision("auto", "cuda", (7, 0)) == "fp16"  # V100
    assert resolve_mixed_precision("fp16", "cuda", (8, 6)) == "fp16" and resolve_mixed_precision("no", "cuda", (7, 5)) == "no"
    with pytest.raises(ValueError, match=r"Tesla T4 \(sm_75\) has no native bf16.*use mixed_precision='fp16'"):
        resolve_mixed_precision("bf16", "cuda", (7, 5), "Tesla T4")
    with pytest.raises(ValueError, match="'fp16' needs a GPU"):
        resolve_mixed_precision("fp16", "cpu")
    with pytest.raises(ValueError, match="mixed_precision must be one of auto, no, bf16, fp16"):
        FinetuneConfig(mixed_precision="fp8")


def test_the_launcher_reads_the_gpus_capability_through_nvml(monkeypatch):
    """check_before_launch decides the format from shardlib.devices (NVML), never from CUDA itself."""
    from shardlib.devices import GPU
    from shardlib.finetune import notebook

    t4s = [GPU(index=i, name="Tesla T4", total_memory=16 << 30, capability=(7, 5), uuid=f"GPU-{i}") for i in range(2)]
    monkeypatch.setattr(notebook, "visible_gpus", lambda: t4s)
    assert check_before_launch(FinetuneConfig(batch_size=8), 2, "cuda") == "fp16"
    with pytest.raises(ValueError, match=r"Tesla T4 \(cuda:0\) \(sm_75\) has no native bf16.*'fp16'"):
        check_before_launch(FinetuneConfig(batch_size=8, mixed_precision="bf16"), 2, "cuda")


def test_too_few_gpus_fail_before_launch_naming_both_counts(monkeypatch):
    from shardlib.finetune import notebook

    with pytest.raises(ValueError, match=r"^run_in_notebook\(num_processes=2\): device='cuda' .*world_size=2\b.*\b0 GPU"):
        notebook.choose_device("cuda", 2)  # here: no GPU at all (shardlib.devices words the reason)
    assert notebook.choose_device("cpu", 2) == "cpu"
    monkeypatch.setattr(notebook, "resolve_device", lambda device, n, forking: __import__("shardlib.devices").devices
                        .DeviceChoice("cpu", f"{n} ranks need {n} GPUs (one per rank) and 1 is visible"))
    assert notebook.choose_device("auto", 2) == "cpu"


def _fake_train(config, fault=None):
    """Stands in for train() where only the launching is tested: writes rank 0's summary."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    summary = {"rank": rank, "world_size": world, "device": config.device}
    if rank == 0:
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.output_dir) / "summary.json").write_text(json.dumps(summary))
    return summary


@pytest.mark.slow
def test_run_in_notebook_routes_one_rank_to_a_forked_process_and_prints_no_cuda_banner(tmp_path, monkeypatch, capfd):
    """One rank: shardlib.launch forks it (notebook_launcher would run it inside the kernel). Two:
    notebook_launcher, with its "Launching training on 2 CUDAs" banner replaced by the truth."""
    from shardlib.finetune import run_in_notebook

    train_module = importlib.import_module("shardlib.finetune.train")  # the module (the package's `train` is the function)
    monkeypatch.setattr(train_module, "train", _fake_train)
    config = FinetuneConfig(batch_size=8, output_dir=str(tmp_path), device="cpu")
    one = run_in_notebook(config, 1)
    assert one == {"rank": 0, "world_size": 1, "device": "cpu"}
    assert run_in_notebook(config, 2) == {"rank": 0, "world_size": 2, "device": "cpu"}
    out = capfd.readouterr()
    assert "CUDA" not in out.out + out.err, out.out + out.err
    assert "Launching training on 1 CPU process with shardlib.launch" in out.out
    assert "Launching training on 2 CPU processes with accelerate.notebook_launcher" in out.out


def test_kill_rank_never_kills_the_process_that_made_it():
    from shardlib.finetune.faults import InjectedFault

    fault = KillRank(rank=0, at_step=3)
    fault("step", 2, 0)
    fault("save", 3, 0)  # a save, not the step: nothing
    fault("step", 3, 1)  # another rank: nothing
    with pytest.raises(InjectedFault, match="rank 0 stopped at step 3"):
        fault("step", 3, 0)


def test_launch_failure_reads_either_report_of_a_killed_rank(tmp_path):
    """The elastic launcher reports whichever failed rank its poll finds first (see launch_failure):
    the killed rank 1, or rank 0 whose collective died of the broken connection. Both are read."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardlib.finetune import launch_failure
    from shardlib.launch import LaunchError

    killed = ChildFailedError("train", {1: ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file="<N/A>")})
    assert launch_failure(killed) == {"error": "ChildFailedError", "rank": 1, "exitcode": -9, "signal": "SIGKILL",
                                      "message": "Signal 9 (SIGKILL) received by PID 11"}
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: [pair.cc:534] Connection closed by peer",
                                                  "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"}}}))
    peer = ChildFailedError("train", {0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(error_file))})
    assert launch_failure(peer) == {"error": "ChildFailedError", "rank": 0, "exitcode": 1, "signal": None,
                                    "message": "RuntimeError: [pair.cc:534] Connection closed by peer"}
    died = LaunchError("rank 0 died without a Python error (exit code -9, killed by signal 9). It may have ...")
    assert launch_failure(died)["rank"] == 0 and launch_failure(died)["signal"] == "SIGKILL"
    assert launch_failure(ValueError("bad"))["message"] == "bad"


def test_a_rank_that_lost_its_peer_waits_to_be_ended_and_other_errors_pass_at_once(monkeypatch):
    """rank_main (what notebook_launcher's ranks run): a lost peer is a consequence, so that rank waits
    for the launcher to find the dead rank first; any other error is raised without waiting."""
    import signal
    import time

    from shardlib.finetune import notebook

    train_module = importlib.import_module("shardlib.finetune.train")
    monkeypatch.setattr(notebook, "PEER_GRACE_S", 0.3)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        for message, waits in [("[pair.cc:545] Read error: Connection reset by peer", True), ("CUDA out of memory", False)]:
            def failing(config, fault=None, message=message):
                raise RuntimeError(message)

            monkeypatch.setattr(train_module, "train", failing)
            started = time.perf_counter()
            with pytest.raises(RuntimeError, match=message.split(":")[-1].strip()):
                notebook.rank_main(FinetuneConfig())
            assert (time.perf_counter() - started >= 0.3) == waits, message
    finally:
        signal.signal(signal.SIGTERM, previous)
