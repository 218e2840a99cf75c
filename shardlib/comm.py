"""Collectives from scratch on send/recv, a ledger of bytes sent, and the alpha-beta cost model.

Ring collectives (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", JPDC 2009; the schedule NCCL and gloo use for large tensors).
A tensor of S bytes is cut into N chunks of c = ceil(numel/N) elements (the last
chunks padded with zeros); each step every rank sends one chunk to its right
neighbour and receives one from its left.

    collective       steps     bytes sent per rank          time (alpha-beta model)
    reduce-scatter   N-1       (N-1)/N * S                  (N-1) * (alpha + S/(N*B))
    all-gather       N-1       (N-1)/N * S                  (N-1) * (alpha + S/(N*B))
    all-reduce       2(N-1)    2(N-1)/N * S                 2(N-1) * (alpha + S/(N*B))
    broadcast        k+N-2     S (every rank but the last)  (k+N-2) * (alpha + S/(k*B))

S is the full tensor (all-gather: the gathered output; reduce-scatter: the input),
alpha the latency per message, B the bandwidth of one link, and k the number of
pieces the pipelined chain broadcast cuts the tensor into (k = N here). With padding
the bytes are exact when S is replaced by N*c*element_size.

`comm_ledger()` records every torch.distributed call made while it is open - PyTorch's
own collectives and ours alike - as (kind, bytes, peers). For point-to-point calls the
bytes sent are exact; for PyTorch's collectives the ledger charges what the ring
algorithm above sends (the backend may pick another algorithm for small tensors).
"""

from __future__ import annotations

import functools
import inspect
import math
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------
# the alpha-beta cost model

_RING_STEPS = {"reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1, "all_reduce": lambda n: 2 * (n - 1)}


def ring_sent_bytes(kind: str, numel: int, world_size: int, element_size: int = 4, rank: int = 0, src: int = 0) -> int:
    """Bytes one rank sends in the ring collective `kind` on a tensor of `numel` elements.

    Exact for this module's implementation, padding included: chunks of ceil(numel/N).
    For broadcast, `rank` and `src` matter: every rank but the last of the chain sends S.
    """
    n = world_size
    if n == 1:
        return 0
    chunk = math.ceil(numel / n) * element_size
    if kind == "broadcast":
        last_of_chain = (src - 1) % n
        return 0 if rank == last_of_chain else n * chunk
    if kind not in _RING_STEPS:
        raise ValueError(f"unknown collective {kind!r}; use one of {sorted(_RING_STEPS) + ['broadcast']}")
    return _RING_STEPS[kind](n) * chunk


@dataclass(frozen=True)
class AlphaBeta:
    """A link: `alpha` seconds of latency per message, `bandwidth` bytes per second."""

    alpha: float
    bandwidth: float

    def time(self, kind: str, nbytes: float, world_size: int) -> float:
        """Predicted seconds for a ring collective of `nbytes` (S) on `world_size` ranks."""
        n = world_size
        if n == 1:
            return 0.0
        if kind == "broadcast":
            steps, piece = 2 * n - 2, nbytes / n  # k = N pieces
        else:
            steps, piece = _RING_STEPS[kind](n), nbytes / n
        return steps * (self.alpha + piece / self.bandwidth)


def fit_alpha_beta(kind: str, world_size: int, nbytes: list[float], seconds: list[float]) -> AlphaBeta:
    """Least-squares fit of t = steps*alpha + steps*(S/N)/B to measured times.

    Each point is weighted by 1/t (relative error), since sizes span decades: unweighted,
    the largest tensors' jitter alone would decide alpha.
    """
    n = world_size
    steps = (2 * n - 2) if kind == "broadcast" else _RING_STEPS[kind](n)
    x = torch.tensor([[steps, steps * s / n] for s in nbytes], dtype=torch.float64)  # (k, 2)
    y = torch.tensor(seconds, dtype=torch.float64)  # (k,)
    weight = 1.0 / y.unsqueeze(1)  # (k, 1)
    alpha, inv_bw = torch.linalg.lstsq(x * weight, (y.unsqueeze(1) * weight)).solution.squeeze(1).tolist()
    return AlphaBeta(alpha=max(alpha, 0.0), bandwidth=1.0 / inv_bw if inv_bw > 0 else float("inf"))


# ---------------------------------------------------------------------------------
# the ledger


@dataclass
class CommRecord:
    kind: str  # e.g. "all_reduce", "send", "recv"
    nbytes: int  # S: the tensor the call is about (collectives: the full tensor)
    sent_bytes: int  # bytes this rank sends (p2p: exact; collectives: ring model)
    peers: tuple[int, ...]  # p2p: the other rank; collectives: the group's ranks


class CommLedger:
    """Every communication call of one rank while the ledger is open."""

    def __init__(self):
        self.records: list[CommRecord] = []

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


_open_ledgers: list[CommLedger] = []
_inside_recorded_call = False  # a collective built on others is recorded once, at the top


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _group_ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _collective_record(kind: str, ring_kind: str | None, payload, group) -> CommRecord:
    ranks = _group_ranks(group)
    nbytes = _nbytes(payload)
    sent = 0
    if ring_kind is not None and len(ranks) > 1:
        sent = int(_RING_STEPS[ring_kind](len(ranks)) * nbytes / len(ranks)) if ring_kind != "broadcast" else nbytes
    return CommRecord(kind, nbytes, sent, ranks)


def _describe(name: str, signature: inspect.Signature, args, kwargs) -> CommRecord:
    """Turn a torch.distributed call into a record. S is the full tensor of the collective.

    Arguments are bound to the function's signature, so positional and keyword calls
    (`all_reduce(t, op, group)` or `all_reduce(t, group=group)`) are read alike.
    """
    bound = signature.bind_partial(*args, **kwargs).arguments
    values = list(bound.values())
    group = bound.get("group")
    if name in ("send", "isend", "recv", "irecv"):
        tensor = bound.get("tensor", values[0] if values else None)
        peer = bound.get("dst" if "send" in name else "src")
        if peer is None and group is not None:  # a group-relative peer: translate to a global rank
            group_peer = bound.get("group_dst" if "send" in name else "group_src")
            peer = None if group_peer is None else dist.get_global_rank(group, group_peer)
        sent = _nbytes(tensor) if "send" in name else 0
        return CommRecord("send" if "send" in name else "recv", _nbytes(tensor), sent, (peer,))
    first = values[0] if values else None
    second = values[1] if len(values) > 1 else None
    if name == "all_reduce":
        return _collective_record("all_reduce", "all_reduce", first, group)
    if name in ("all_gather_into_tensor", "all_gather_single", "all_gather"):
        return _collective_record("all_gather", "all_gather", first, group)  # output: the full S
    if name in ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter"):
        return _collective_record("reduce_scatter", "reduce_scatter", second, group)  # input: the full S
    if name == "broadcast":
        return _collective_record("broadcast", "broadcast", first, group)
    if name in ("all_to_all_single", "all_to_all"):
        record = _collective_record("all_to_all", None, second, group)
        record.sent_bytes = int(record.nbytes * (len(record.peers) - 1) / max(len(record.peers), 1))
        return record
    payload = first if isinstance(first, (torch.Tensor, list, tuple)) else None  # barrier(group) has none
    return _collective_record(name, None, payload, group)  # barrier, reduce, gather, scatter...


_RECORDED = ("send", "recv", "isend", "irecv", "all_reduce", "all_gather", "all_gather_into_tensor",
             "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
             "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier")


def _recording(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        global _inside_recorded_call
        if _inside_recorded_call or not _open_ledgers:
            return original(*args, **kwargs)
        record = _describe(name, signature, args, kwargs)
        for ledger in _open_ledgers:
            ledger.records.append(record)
        _inside_recorded_call = True
        try:
            return original(*args, **kwargs)
        finally:
            _inside_recorded_call = False

    wrapper._shardlib_original = original
    return wrapper


def _batch_isend_irecv_recording(original):
    @functools.wraps(original)
    def wrapper(p2p_op_list):
        global _inside_recorded_call
        if _open_ledgers and not _inside_recorded_call:
            for op in p2p_op_list:
                is_send = op.op in (dist.isend, getattr(dist.isend, "_shardlib_original", None))
                nbytes = _nbytes(op.tensor)
                record = CommRecord("send" if is_send else "recv", nbytes, nbytes if is_send else 0, (op.peer,))
                for ledger in _open_ledgers:
                    ledger.records.append(record)
        _inside_recorded_call = True
        try:
            return original(p2p_op_list)
        finally:
            _inside_recorded_call = False

    wrapper._shardlib_original = original
    return wrapper


def _p2p_op_recording(original):
    """P2POp accepts only the unpatched isend/irecv (it checks `op is isend`): unwrap ours."""

    class P2POp(original):
        def __new__(cls, op, *args, **kwargs):
            return original.__new__(cls, getattr(op, "_shardlib_original", op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            original.__init__(self, getattr(op, "_shardlib_original", op), *args, **kwargs)

    P2POp._shardlib_original = original
    return P2POp


@contextmanager
def comm_ledger():
    """`with comm_ledger() as ledger:` records this rank's torch.distributed calls."""
    ledger = CommLedger()
    if not _open_ledgers:  # first ledger opened: patch the module's functions
        for name in _RECORDED:
            if hasattr(dist, name):
                setattr(dist, name, _recording(name, getattr(dist, name)))
        dist.batch_isend_irecv = _batch_isend_irecv_recording(dist.batch_isend_irecv)
        dist.P2POp = _p2p_op_recording(dist.P2POp)
    _open_ledgers.append(ledger)
    try:
        yield ledger
    finally:
        _open_ledgers.remove(ledger)
        if not _open_ledgers:
            for name in _RECORDED + ("batch_isend_irecv", "P2POp"):
                fn = getattr(dist, name, None)
                if fn is not None and hasattr(fn, "_shardlib_original"):
                    setattr(dist, name, fn._shardlib_original)


# ---------------------------------------------------------------------------------
# ring collectives, from scratch on isend/recv


def _ring(group) -> tuple[int, int, int, int]:
    """(my index in the group, group size, global rank on my left, global rank on my right)."""
    ranks = _group_ranks(group)
    n, me = len(ranks), ranks.index(dist.get_rank())
    return me, n, ranks[(me - 1) % n], ranks[(me + 1) % n]


def _exchange(send_chunk: torch.Tensor, recv_chunk: torch.Tensor, left: int, right: int, group) -> None:
    """Send to the right neighbour while receiving from the left (isend first: no deadlock)."""
    request = dist.isend(send_chunk, right, group=group)
    dist.recv(recv_chunk, left, group=group)
    request.wait()


def _padded_chunks(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """Flatten and zero-pad to N equal chunks: (numel,) -> (N, c), c = ceil(numel/N)."""
    flat = tensor.reshape(-1)
    c = math.ceil(flat.numel() / n)
    padded = torch.zeros(n * c, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()] = flat
    return padded.view(n, c)  # (N, c)


def _reduce_scatter_chunks(chunks: torch.Tensor, me: int, n: int, left: int, right: int, group) -> None:
    """After N-1 steps, chunks[me] holds the sum over ranks of everyone's chunks[me]."""
    incoming = torch.empty_like(chunks[0])  # (c,)
    for step in range(n - 1):
        send_index, recv_index = (me - step - 1) % n, (me - step - 2) % n
        _exchange(chunks[send_index], incoming, left, right, group)
        chunks[recv_index] += incoming


def _all_gather_chunks(chunks: torch.Tensor, me: int, n: int, left: int, right: int, group) -> None:
    """Starting from chunks[me] complete on each rank, after N-1 steps every chunk is."""
    for step in range(n - 1):
        send_index, recv_index = (me - step) % n, (me - step - 1) % n
        _exchange(chunks[send_index], chunks[recv_index], left, right, group)


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over the group, in place: a ring reduce-scatter, then a ring all-gather."""
    me, n, left, right = _ring(group)
    if n == 1:
        return tensor
    in_place = tensor.is_contiguous() and tensor.numel() % n == 0
    chunks = tensor.view(n, -1) if in_place else _padded_chunks(tensor, n)  # (N, c): no copy when N divides
    _reduce_scatter_chunks(chunks, me, n, left, right, group)
    _all_gather_chunks(chunks, me, n, left, right, group)
    if not in_place:
        tensor.copy_(chunks.reshape(-1)[: tensor.numel()].view_as(tensor))
    return tensor


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over the group and return this rank's shard of the flattened result.

    Shard r is elements [r*c, (r+1)*c) of the flattened tensor, c = ceil(numel/N), cut
    at numel (so the last shards may be shorter, or empty), as FSDP shards a flat parameter.
    """
    me, n, left, right = _ring(group)
    chunks = _padded_chunks(tensor, n)  # (N, c)
    _reduce_scatter_chunks(chunks, me, n, left, right, group)
    start = me * chunks.shape[1]
    return chunks[me][: max(0, min(chunks.shape[1], tensor.numel() - start))].clone()  # (<= c,)


def ring_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's `tensor` (same shape on all) along a new first dim: (N, *shape)."""
    me, n, left, right = _ring(group)
    chunks = torch.empty((n, tensor.numel()), dtype=tensor.dtype, device=tensor.device)  # (N, numel)
    chunks[me] = tensor.reshape(-1)
    _all_gather_chunks(chunks, me, n, left, right, group)
    return chunks.view(n, *tensor.shape)  # (N, *shape)


def ring_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy `tensor` from group rank `src` to all, in place: a chain src -> src+1 -> ... cut
    into N pieces so that every link is busy at once (pipelined), as NCCL's ring broadcast."""
    me, n, left, right = _ring(group)
    if n == 1:
        return tensor
    pieces = _padded_chunks(tensor, n)  # (k=N, c)
    position = (me - src) % n  # 0 at the source, n-1 at the end of the chain
    for piece in pieces:
        if position > 0:
            dist.recv(piece, left, group=group)
        if position < n - 1:
            dist.send(piece, right, group=group)
    tensor.copy_(pieces.reshape(-1)[: tensor.numel()].view_as(tensor))
    return tensor


# ---------------------------------------------------------------------------------
# verify and bench entry points (see shardlib/verify.py and shardlib/bench.py)

_SHAPES = [(1,), (7,), (1000,), (1001,), (5, 3), (4096,)]


def _check_against_torch(technique: str) -> tuple[float, float, bool]:
    """On every rank: run ours and torch.distributed's on the same inputs; compare.

    Returns (max abs diff, max relative diff, ledger bytes == ring formula for every shape).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    max_abs = max_rel = 0.0
    bytes_match = True
    for i, shape in enumerate(_SHAPES):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(100 * i + rank))
        with comm_ledger() as ledger:
            if technique == "allreduce":
                ours = ring_all_reduce(x.clone())
            elif technique == "allgather":
                ours = ring_all_gather(x)
            elif technique == "reducescatter":
                ours = ring_reduce_scatter(x)
            else:
                ours = ring_broadcast(x.clone(), src=n - 1)
        kind = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter"}.get(technique, "broadcast")
        numel_s = x.numel() * (n if technique == "allgather" else 1)  # S: all-gather's is its output
        expected_sent = ring_sent_bytes(kind, numel_s, n, x.element_size(), rank=rank, src=n - 1)
        bytes_match &= ledger.sent_bytes() == expected_sent
        if technique == "allreduce":
            reference = x.clone()
            dist.all_reduce(reference)
        elif technique == "allgather":
            reference = torch.empty(n * x.numel())
            _all_gather_single(reference, x.reshape(-1))
            reference = reference.view(n, *shape)
        elif technique == "reducescatter":
            padded = _padded_chunks(x, n)  # torch wants equal shards: pad, then cut ours' way
            shard = torch.empty(padded.shape[1])
            _reduce_scatter_single(shard, padded.reshape(-1))
            reference = shard[: ours.numel()]
        else:
            reference = x.clone()
            dist.broadcast(reference, src=n - 1)
        if ours.shape != reference.shape:
            return float("inf"), float("inf"), False
        diff = (ours - reference).abs()
        if diff.numel():
            max_abs = max(max_abs, diff.max().item())
            max_rel = max(max_rel, (diff / reference.abs().clamp_min(1e-6)).max().item())
    return max_abs, max_rel, bytes_match


def _all_gather_single(output, input, group=None):
    """torch >= 2.14 names it all_gather_single; older releases all_gather_into_tensor."""
    return getattr(dist, "all_gather_single", None)(output, input, group=group) if hasattr(dist, "all_gather_single") \
        else dist.all_gather_into_tensor(output, input, group=group)


def _reduce_scatter_single(output, input, group=None):
    """torch >= 2.14 names it reduce_scatter_single; older releases reduce_scatter_tensor."""
    return dist.reduce_scatter_single(output, input, group=group) if hasattr(dist, "reduce_scatter_single") \
        else dist.reduce_scatter_tensor(output, input, group=group)


def verify_collective(world_size: int, technique: str = "allreduce") -> dict:
    """Ours vs torch.distributed on shapes N does not divide; ledger bytes vs the ring formula."""
    results = _launch(_check_against_torch, world_size, args=(technique,), timeout=60)
    max_abs = max(r[0] for r in results)
    max_rel = max(r[1] for r in results)
    bytes_ok = all(r[2] for r in results)
    passed = max_abs <= 1e-5 and bytes_ok
    return {"passed": passed, "max_abs_diff": max_abs, "max_rel_diff": max_rel,
            "detail": "ledger bytes = ring formula" if bytes_ok else "ledger bytes DIFFER from the ring formula"}


def _launch(fn, world_size, **kwargs):
    from shardlib.launch import launch  # late import: comm is imported inside ranks too

    return launch(fn, world_size, **kwargs)


def _time_allreduces(numel: int, repeats: int) -> dict[str, float]:
    """Median seconds of ours and torch's all-reduce, interleaved so both see the same machine."""
    x = torch.randn(numel)
    times = {"ours": [], "torch": []}
    for name, op in (("ours", ring_all_reduce), ("torch", dist.all_reduce)):  # warm-up
        op(x.clone())
    for _ in range(repeats):
        for name, op in (("ours", ring_all_reduce), ("torch", dist.all_reduce)):
            y = x.clone()
            dist.barrier()
            start = time.perf_counter()
            op(y)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_allreduce(quick: bool = False, world_size: int = 4) -> list[dict]:
    """From-scratch ring all-reduce vs torch.distributed.all_reduce (gloo), 1 MB and 16 MB."""
    rows = []
    for megabytes in (1, 16):
        numel = megabytes * 2**20 // 4
        repeats = 3 if quick else 15
        per_rank = _launch(_time_allreduces, world_size, args=(numel, repeats), timeout=600)
        ours = max(r["ours"] for r in per_rank)  # a collective ends when its slowest rank does
        theirs = max(r["torch"] for r in per_rank)
        rows.append({"benchmark": "allreduce", "case": f"{megabytes} MB fp32, N={world_size} gloo",
                     "ours_s": ours, "torch_s": theirs, "ratio": ours / theirs,
                     "target": 1.5 if megabytes == 16 else None})
    return rows
