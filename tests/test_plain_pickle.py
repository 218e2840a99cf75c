"""shardlib.plain_pickle: what a rank may send back under the grader, and what it may not."""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict

import numpy as np
import pytest
import torch

from shardlib import launch, plain_pickle
from shardlib.comm import comm_ledger
from shardlib.comm.ledger import CommRecord

RAN = []


def ran(what: str) -> None:
    RAN.append(what)


class Runs:
    """Unpickling it runs code (pickle's REDUCE calls whatever it names)."""

    def __reduce__(self):
        return (ran, ("it ran",))


class Equal(torch.Tensor):
    """A tensor whose comparisons all say equal."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True if func is torch.equal else super().__torch_function__(func, types, args, kwargs or {})


def test_plain_data_comes_back_as_it_was():
    record = CommRecord(kind="all_reduce", nbytes=16, sent_bytes=24, peers=(0, 1))
    data = {"numbers": [1, 2.5, 3j, True, None], "text": ("a", b"b"), "sets": ({1}, frozenset({2}), range(3)),
            "tensor": torch.arange(6.0).reshape(2, 3)[:, 1:], "parameter": torch.nn.Parameter(torch.ones(2)),
            "state": OrderedDict(w=torch.zeros(3, dtype=torch.float64)), "array": np.arange(4),
            "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]), "record": record}
    back = plain_pickle.loads(pickle.dumps(data))
    assert back.keys() == data.keys() and back["numbers"] == data["numbers"] and back["record"] == record
    assert torch.equal(back["tensor"], data["tensor"]) and type(back["parameter"]) is torch.nn.Parameter
    assert torch.equal(back["state"]["w"], data["state"]["w"]) and (back["array"] == data["array"]).all()
    assert (back["dtype"], back["device"], back["size"], back["sets"]) == (
        data["dtype"], data["device"], data["size"], data["sets"])


class _ForgedStorage:
    """What a tensor's storage pickles to (torch.storage._load_from_bytes: torch.load of its bytes, not
    weights only), with bytes that run code when loaded."""

    def __reduce__(self):
        inside = io.BytesIO()
        torch.save(Runs(), inside, _use_new_zipfile_serialization=False)
        return (torch.storage._load_from_bytes, (inside.getvalue(),))


FORGED = {"code run by its REDUCE": (Runs, lambda back: RAN == ["it ran"]),
          "a tensor subclass": (lambda: torch.zeros(2).as_subclass(Equal), lambda back: type(back) is Equal),
          "a class of the caller's": (lambda: Equal, lambda back: back is Equal),
          "code inside a tensor's bytes": (_ForgedStorage, lambda back: RAN == ["it ran"])}


@pytest.mark.parametrize("what", sorted(FORGED))
def test_what_could_lie_or_run_code_is_refused(what: str):
    make, took = FORGED[what]
    payload = pickle.dumps(make())
    RAN.clear()
    assert took(pickle.loads(payload)), f"{what}: an ordinary unpickling should take it (the danger shown)"
    RAN.clear()
    with pytest.raises(pickle.UnpicklingError):
        plain_pickle.loads(payload)
    assert not RAN, "unpickling ran code"


def equal_tensor():
    return torch.zeros(2).as_subclass(Equal)


def ledger_of_an_all_reduce():
    with comm_ledger(record_torch=True) as ledger:
        torch.distributed.all_reduce(torch.ones(3))
    return ledger


def test_under_the_grader_a_rank_cannot_send_back_a_lying_tensor(monkeypatch):
    assert type(launch(equal_tensor, 1, device="cpu")[0]) is Equal  # an ordinary launch takes anything
    monkeypatch.setenv(plain_pickle.ENV, "1")
    with pytest.raises(pickle.UnpicklingError, match="may not come back from a rank"):
        launch(equal_tensor, 1, device="cpu")
    assert torch.equal(launch(torch.ones, 1, args=(2,), device="cpu")[0], torch.ones(2))
    ledger = launch(ledger_of_an_all_reduce, 1, device="cpu")[0]  # a rank's ledger, as lab 01 returns it
    assert [(r.kind, r.nbytes) for r in ledger.records] == [("all_reduce", 12)], ledger.records


def test_only_records_defined_in_a_shardlib_module_come_back():
    """A module that runs when imported (a command line's __main__), or a name bound to a class defined
    elsewhere, is refused."""
    import shardlib.comm.ledger as ledger


    for module, name in [("shardlib.__main__", "main"), ("shardlib.comm.ledger", "Borrowed")]:
        payload = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b"."
        ledger.Borrowed = OrderedDict  # a class from elsewhere, reachable under a shardlib name
        try:
            with pytest.raises(pickle.UnpicklingError, match="may not come back"):
                plain_pickle.loads(payload)
        finally:
            del ledger.Borrowed
    assert plain_pickle.loads(pickle.dumps(CommRecord)) is CommRecord
