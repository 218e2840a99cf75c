"""Unpickling what a process whose code cannot be trusted sent back: plain data only.

A pickle is a small program: unpickling it can call any function it names (`exec`, `os.system`) and
rebuild any class (a tensor subclass whose `__torch_function__` says every comparison is equal). When
`shardlib.launch` runs inside the grader (SHARDLIB_PLAIN_RESULTS=1 in its environment), the ranks' code
is the learner's, so what they send back is read with `loads`, which rebuilds only

    numbers, strings, bytes and the builtin containers (also OrderedDict, defaultdict, deque)
    tensors and parameters, through PyTorch's own weights-only loader; dtypes, devices, sizes
    NumPy arrays, dtypes and scalars
    shardlib's own records (dataclasses and named tuples, such as the ledger's CommRecord)

and refuses anything else, naming it. The rule follows torch.load(weights_only=True)
(https://pytorch.org/docs/stable/generated/torch.load.html), which is what reads the tensors' bytes.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle

__all__ = ["loads", "ENV"]

ENV = "SHARDLIB_PLAIN_RESULTS"
BUILTINS = {"set", "frozenset", "complex", "slice", "range", "bytearray", "bytes", "list", "dict", "tuple", "int",
            "float", "str", "bool", "object"}
ALLOWED = {("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
           ("copyreg", "_reconstructor"), ("torch", "device"), ("torch", "Size"), ("torch._utils", "_rebuild_tensor_v2"),
           ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
           ("torch.nn.parameter", "Parameter"), ("torch._tensor", "_rebuild_from_type_v2")}
NUMPY = {"_reconstruct", "scalar", "ndarray", "dtype"}


def _load_tensor_bytes(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)  # a storage's bytes, read by the weights-only loader


class PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "builtins" and name in BUILTINS or (module, name) in ALLOWED:
            return super().find_class(module, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_tensor_bytes
        if module == "torch" and not name.startswith("_"):
            import torch

            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        if module.split(".")[0] == "numpy" and (name in NUMPY or name.endswith("DType")):
            return super().find_class(module, name)
        parts = module.split(".")
        if parts[0] == "shardlib" and not any(part.startswith("_") for part in parts):  # not __main__: no CLI runs
            found = getattr(importlib.import_module(module), name, None)
            if (isinstance(found, type) and found.__module__ == module and found.__qualname__ == name
                    and (dataclasses.is_dataclass(found) or (issubclass(found, tuple) and hasattr(found, "_fields")))):
                return found
        raise pickle.UnpicklingError(
            f"{module}.{name} may not come back from a rank while the notebook is graded: return plain data "
            "(tensors, numbers, strings, lists, dicts)")


def loads(data: bytes):
    """`pickle.loads(data)` for plain data only (see the module docstring); UnpicklingError otherwise."""
    return PlainUnpickler(io.BytesIO(data)).load()
