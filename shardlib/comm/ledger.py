"""The ledger: every communication call of one rank, with the bytes it sends.

    with comm_ledger() as ledger:
        loss.backward()                    # shardlib's collectives record themselves here
    ledger.sent_bytes(), ledger.calls("all_reduce"), print(ledger)

shardlib's techniques communicate through `shardlib.comm.ops` (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, broadcast, send, recv, all_to_all_single, ...), thin wrappers of the
torch.distributed calls of the same names that write one record per call into every open ledger.
PyTorch's own code (DistributedDataParallel, fully_shard, DTensor...) calls torch.distributed
directly; `comm_ledger(record_torch=True)` records those too, by wrapping torch.distributed's
functions while the ledger is open. That wrapping is opt-in, never raises inside the call it
records (a call it cannot describe is recorded as kind "unknown:<name>"), and is undone when the
last such ledger closes. Ledgers are process-wide (a rank is a process; autograd may run hooks on
another thread) and their bookkeeping is guarded by a lock.

What a record counts, for a tensor of S bytes on a group of n ranks (ring algorithms, lesson 01):

    send / recv            S sent by the sender, 0 by the receiver                  exact
    all-reduce             2(n-1)/n * S                                             ring model
    all-gather             (n-1)/n * S   (S: the gathered output)                   ring model
    reduce-scatter         (n-1)/n * S   (S: the full input)                        ring model
    broadcast              S on every rank (a chain's last rank sends nothing)      upper bound
    all-to-all             the input less the part a rank keeps for itself          exact

For PyTorch's collectives the ring model is what the ledger charges; the backend may pick another
algorithm for small tensors (gloo and NCCL do), which changes the time and the bytes really sent, not
what the ledger counts.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CommRecord", "CommLedger", "comm_ledger", "record", "group_ranks", "collective_record"]

RING_STEPS = {"reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1, "all_reduce": lambda n: 2 * (n - 1)}


@dataclass
class CommRecord:
    kind: str  # e.g. "all_reduce", "send", "recv", "all_to_all"
    nbytes: int  # S: the tensor the call is about (collectives: the full tensor)
    sent_bytes: int  # bytes this rank sends (p2p and all-to-all: exact; collectives: ring model)
    peers: tuple[int, ...]  # p2p: the other rank (global); collectives: the group's global ranks


@dataclass(eq=False)  # a record, so that a rank may send it back as plain data (shardlib.plain_pickle)
class CommLedger:
    """Every communication call of one rank while the ledger is open."""

    records: list[CommRecord] = field(default_factory=list)

    def calls(self, kind: str | None = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def bytes(self, kind: str | None = None) -> int:
        return sum(r.nbytes for r in self.records if kind is None or r.kind == kind)

    def sent_bytes(self, kind: str | None = None) -> int:
        return sum(r.sent_bytes for r in self.records if kind is None or r.kind == kind)

    def summary(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "sent_bytes": 0})
        for r in self.records:
            row = table[r.kind]
            row["calls"] += 1
            row["bytes"] += r.nbytes
            row["sent_bytes"] += r.sent_bytes
        return dict(table)

    def clear(self) -> None:
        self.records.clear()

    def __repr__(self) -> str:
        lines = [f"{'kind':<22}{'calls':>7}{'bytes':>14}{'sent bytes':>14}"]
        for kind, row in sorted(self.summary().items()):
            lines.append(f"{kind:<22}{row['calls']:>7}{row['bytes']:>14,}{row['sent_bytes']:>14,}")
        return "\n".join(lines)


_lock = threading.Lock()
_open: list[CommLedger] = []  # every open ledger of this process
_recording_torch: list[CommLedger] = []  # ... of which these also record torch.distributed's own calls
_local = threading.local()  # .depth > 0 while inside a recorded call: a call built on others counts once


def record(entry: CommRecord, *, from_torch: bool = False) -> None:
    """Append `entry` to every open ledger (shardlib's calls), or to those recording PyTorch's."""
    with _lock:
        for ledger in (_recording_torch if from_torch else _open):
            ledger.records.append(entry)


def recording() -> bool:
    """True when a ledger is open and this thread is not already inside a recorded call."""
    return bool(_open) and getattr(_local, "depth", 0) == 0


@contextmanager
def inside_recorded_call():
    """Calls made inside (a recorded collective built on others) are not recorded again."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


# ---------------------------------------------------------------------------------
# what one call sends


def nbytes_of(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(nbytes_of(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def group_ranks(group=None) -> tuple[int, ...]:
    """The global ranks of `group` (None: every rank), in group order."""
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def collective_record(kind: str, payload, group) -> CommRecord:
    """A collective on `payload` (S = its bytes) over `group`, charged as the ring algorithm sends."""
    ranks = group_ranks(group)
    n, size = len(ranks), nbytes_of(payload)
    if n == 1:
        sent = 0
    elif kind in RING_STEPS:
        sent = RING_STEPS[kind](n) * size // n
    elif kind == "broadcast":
        sent = size
    else:
        sent = 0  # barrier, or a call the ring model does not describe
    return CommRecord(kind, size, sent, ranks)


# ---------------------------------------------------------------------------------
# opt-in: record torch.distributed's own calls (PyTorch's DDP, FSDP2, DTensor...)

_TORCH_KINDS = {  # torch.distributed function -> (kind, index of the argument that is S)
    "all_reduce": ("all_reduce", 0), "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0), "all_gather": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 1), "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1), "broadcast": ("broadcast", 0),
    "all_to_all_single": ("all_to_all", 1), "all_to_all": ("all_to_all", 1),
    "reduce": ("reduce", 0), "gather": ("gather", 0), "scatter": ("scatter", 0), "barrier": ("barrier", None),
    "send": ("send", 0), "isend": ("send", 0), "recv": ("recv", 0), "irecv": ("recv", 0),
}


def _describe_torch_call(name: str, signature: inspect.Signature, args, kwargs) -> CommRecord:
    bound = signature.bind_partial(*args, **kwargs).arguments
    values = list(bound.values())
    group = bound.get("group")
    kind, index = _TORCH_KINDS[name]
    payload = values[index] if index is not None and len(values) > index else None
    if kind in ("send", "recv"):
        peer = bound.get("dst" if kind == "send" else "src")
        if peer is None and group is not None:  # a group-relative peer: translate to a global rank
            group_peer = bound.get("group_dst" if kind == "send" else "group_src")
            peer = None if group_peer is None else dist.get_global_rank(group, group_peer)
        size = nbytes_of(payload)
        return CommRecord(kind, size, size if kind == "send" else 0, (peer,))
    if kind == "all_to_all":
        entry = collective_record(kind, payload, group)
        entry.sent_bytes = entry.nbytes * (len(entry.peers) - 1) // max(len(entry.peers), 1)
        return entry
    return collective_record(kind, payload if isinstance(payload, (torch.Tensor, list, tuple)) else None, group)


def _recorded_torch_function(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not _recording_torch or getattr(_local, "depth", 0) > 0:
            return original(*args, **kwargs)
        try:
            entry = _describe_torch_call(name, signature, args, kwargs)
        except Exception:  # noqa: BLE001 - recording must never break the call it records
            entry = CommRecord(f"unknown:{name}", 0, 0, ())
        record(entry, from_torch=True)
        with inside_recorded_call():
            return original(*args, **kwargs)

    wrapper._shardlib_original = original
    return wrapper


def _recorded_batch_isend_irecv(original):
    @functools.wraps(original)
    def wrapper(p2p_op_list):
        if _recording_torch and getattr(_local, "depth", 0) == 0:
            for op in p2p_op_list:
                try:
                    is_send = getattr(op.op, "_shardlib_original", op.op) is getattr(dist.isend, "_shardlib_original",
                                                                                     dist.isend)
                    size = nbytes_of(op.tensor)
                    entry = CommRecord("send" if is_send else "recv", size, size if is_send else 0, (op.peer,))
                except Exception:  # noqa: BLE001
                    entry = CommRecord("unknown:batch_isend_irecv", 0, 0, ())
                record(entry, from_torch=True)
        with inside_recorded_call():
            return original(p2p_op_list)

    wrapper._shardlib_original = original
    return wrapper


def _p2p_op_accepting_wrapped(original):
    """P2POp accepts only the unwrapped isend/irecv (it checks `op is isend`): unwrap ours."""

    class P2POp(original):
        def __new__(cls, op, *args, **kwargs):
            return original.__new__(cls, getattr(op, "_shardlib_original", op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            original.__init__(self, getattr(op, "_shardlib_original", op), *args, **kwargs)

    P2POp._shardlib_original = original
    return P2POp


def _wrap_torch_distributed() -> None:
    for name in _TORCH_KINDS:
        if hasattr(dist, name):
            setattr(dist, name, _recorded_torch_function(name, getattr(dist, name)))
    dist.batch_isend_irecv = _recorded_batch_isend_irecv(dist.batch_isend_irecv)
    dist.P2POp = _p2p_op_accepting_wrapped(dist.P2POp)


def _unwrap_torch_distributed() -> None:
    for name in (*_TORCH_KINDS, "batch_isend_irecv", "P2POp"):
        fn = getattr(dist, name, None)
        if fn is not None and hasattr(fn, "_shardlib_original"):
            setattr(dist, name, fn._shardlib_original)


@contextmanager
def comm_ledger(*, record_torch: bool = False):
    """`with comm_ledger() as ledger:` records this rank's communication while open.

    record_torch: also record calls that PyTorch's own code makes to torch.distributed (its DDP,
    FSDP, tensor parallelism, or a direct `dist.all_reduce`), by wrapping torch.distributed's
    functions while this ledger is open. Off by default: shardlib's own calls record themselves.
    """
    ledger = CommLedger()
    with _lock:
        if record_torch and not _recording_torch:
            _wrap_torch_distributed()
        _open.append(ledger)
        if record_torch:
            _recording_torch.append(ledger)
    try:
        yield ledger
    finally:
        with _lock:
            _open.remove(ledger)
            if record_torch:
                _recording_torch.remove(ledger)
                if not _recording_torch:
                    _unwrap_torch_distributed()
