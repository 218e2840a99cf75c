"""Labelled text for fine-tuning: loading with clear errors, and a data order that can resume.

A split is a JSONL file (one {"text": ..., "label": ...} object a line) or a CSV file
with a header naming `text` and `label` columns. Bad rows fail loudly, naming the file,
the line and what is wrong, before any process starts.

The data order is a pure function of (seed, step): optimizer step s of a run reads the
global batch

    epoch  = s // steps_per_epoch
    order  = randperm(n_examples, seed + epoch)          # one permutation per epoch
    batch  = order[(s mod steps_per_epoch) * B : ... + B]  # B = global batch size

and rank r of N reads the r-th contiguous share of B/N examples of it (`rank_share`). Nothing about the
order lives in a data-loader's state, so a run stopped after step k resumes at step k+1
with exactly the batches the uninterrupted run would have read, on any number of ranks.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch

SPLITS = ("train", "validation", "test")


def default_data_dir() -> Path:
    """The course's topic data set, shipped inside the package (shardlib/data/topics)."""
    from shardlib.resources import data_path

    return data_path("topics")


class DatasetError(ValueError):
    """A dataset file is missing or has a bad row; the message names the file and line."""


@dataclass
class TextSplit:
    texts: list[str]
    labels: list[int]  # indices into the dataset's label names

    def __len__(self) -> int:
        return len(self.texts)


def _read_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) pairs of a .jsonl or .csv file."""
    if path.suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DatasetError(f"{path}, line {line_no}: not valid JSON ({error.msg}); "
                                       'each line must be an object like {"text": "...", "label": "..."}') from None
                rows.append((line_no, row))
        return rows
    if path.suffix == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            missing = {"text", "label"} - set(reader.fieldnames or [])
            if missing:
                raise DatasetError(f"{path}, line 1: the header must name the columns 'text' and 'label'; "
                                   f"missing {sorted(missing)} (found {reader.fieldnames})")
            return [(line_no, row) for line_no, row in enumerate(reader, start=2)]
    raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .csv")


def _check_row(path: Path, line_no: int, row) -> tuple[str, str]:
    where = f"{path}, line {line_no}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with 'text' and 'label', got {type(row).__name__}")
    missing = [key for key in ("text", "label") if key not in row or row[key] is None]
    if missing:
        raise DatasetError(f"{where}: missing field(s) {missing}; every row needs 'text' and 'label'")
    text, label = row["text"], row["label"]
    if not isinstance(text, str) or not text.strip():
        raise DatasetError(f"{where}: 'text' must be a non-empty string, got {text!r}")
    if isinstance(label, bool) or not isinstance(label, (str, int)) or str(label).strip() == "":
        raise DatasetError(f"{where}: 'label' must be a non-empty string or an integer, got {label!r}")
    return text, str(label)


def read_split(path: str | Path, label_names: list[str] | None = None) -> tuple[TextSplit, list[str]]:
    """Read one split. With `label_names`, a label outside them is an error; without, they are
    the sorted labels found here. Returns the split and the label names."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    checked = [(line_no, *_check_row(path, line_no, row)) for line_no, row in _read_rows(path)]
    if not checked:
        raise DatasetError(f"{path}: the file has no rows")
    if label_names is None:
        label_names = sorted({label for _, _, label in checked})
    index = {name: i for i, name in enumerate(label_names)}
    for line_no, _, label in checked:
        if label not in index:
            raise DatasetError(f"{path}, line {line_no}: label {label!r} does not occur in the training split "
                               f"(known labels: {label_names})")
    split = TextSplit([text for _, text, _ in checked], [index[label] for _, _, label in checked])
    return split, label_names


def _split_file(data_dir: Path, split: str) -> Path:
    for suffix in (".jsonl", ".csv"):
        if (data_dir / f"{split}{suffix}").is_file():
            return data_dir / f"{split}{suffix}"
    raise DatasetError(f"{data_dir}: no {split}.jsonl or {split}.csv; a dataset directory holds "
                       f"{', '.join(s + '.jsonl' for s in SPLITS)} (or .csv)")


def load_dataset(data_dir: str | Path) -> tuple[dict[str, TextSplit], list[str]]:
    """The train/validation/test splits of a directory, and the label names (from train)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DatasetError(f"{data_dir}: no such dataset directory")
    train, label_names = read_split(_split_file(data_dir, "train"))
    if len(label_names) < 2:
        raise DatasetError(f"{_split_file(data_dir, 'train')}: needs at least 2 labels, found {label_names}")
    splits = {"train": train}
    for split in SPLITS[1:]:
        splits[split], _ = read_split(_split_file(data_dir, split), label_names)
    return splits, label_names


def steps_per_epoch(n_examples: int, global_batch: int) -> int:
    """Whole global batches per epoch (the last partial batch is dropped)."""
    return n_examples // global_batch


def global_batch_indices(n_examples: int, global_batch: int, step: int, seed: int) -> list[int]:
    """Example indices of optimizer step `step` (0-based) over all ranks; see the module docstring."""
    per_epoch = steps_per_epoch(n_examples, global_batch)
    epoch, position = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_examples, generator=generator)
    return order[position * global_batch:(position + 1) * global_batch].tolist()


def rank_share(indices: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a global batch's example indices (its length divides evenly)."""
    per_rank = len(indices) // world_size
    return indices[rank * per_rank:(rank + 1) * per_rank]


def eval_indices(n_examples: int, rank: int, world_size: int) -> list[int]:
    """This rank's share of an evaluation split, padded with -1 so every rank runs the same
    number of forward passes (FSDP gathers parameters collectively in each)."""
    mine = list(range(rank, n_examples, world_size))
    per_rank = -(-n_examples // world_size)
    return mine + [-1] * (per_rank - len(mine))


def tokenize(tokenizer, texts: list[str], max_length: int, device) -> dict:
    """Token ids padded to `max_length`, so every batch has the same shape."""
    batch = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    return {key: value.to(device) for key, value in batch.items()}
