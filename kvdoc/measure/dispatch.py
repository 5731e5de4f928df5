"""Counting what ATen operations do, through torch's dispatch mode.

``TorchDispatchMode`` and an operator's ``_schema`` are private PyTorch APIs: kvdoc uses them
for measurements only and keeps every use in this one module, so a PyTorch release that moves
them breaks one file.

>>> import torch
>>> a, b = torch.zeros(2, 3), torch.zeros(1, 3)
>>> with WriteCounter() as counter:
...     _ = torch.cat((a, b))  # reads 24 + 12 bytes, writes a new 3 x 3 FP32 tensor: 36 bytes
>>> counter.read, counter.written, counter.allocated
(36, 36, 36)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def tensor_bytes(t: object) -> int:
    """``numel * element_size`` of a tensor; 0 for anything else."""
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _tensors(values: object) -> list[torch.Tensor]:
    """The tensors among an op's arguments, looking into lists and tuples (``cat`` takes one)."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _tensors(v)]
    return []


class WriteCounter(TorchDispatchMode):
    """Adds up the bytes every ATen op writes (outputs of functional ops, targets of in-place
    ops) and reads (its tensor inputs other than a target it overwrites: a copy reads its
    source as it writes its destination)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.read = 0
        self.allocated = 0  # bytes of freshly created output tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out  # a view writes nothing
        if func._schema.is_mutable:
            values = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
            for spec, value in zip(func._schema.arguments, values, strict=True):
                if spec.alias_info is not None and spec.alias_info.is_write:
                    self.written += tensor_bytes(value)
                else:
                    self.read += sum(tensor_bytes(t) for t in _tensors(value))
        else:
            self.read += sum(tensor_bytes(t) for t in _tensors([args, list(kwargs.values())]))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            fresh = sum(tensor_bytes(t) for t in outs)
            self.written += fresh
            self.allocated += fresh
        return out


def count_ops(call: Callable[[], Any]) -> dict[str, int]:
    """ATen operators dispatched while ``call()`` runs, by name (what a step costs in dispatches).

    >>> ops = count_ops(lambda: torch.ones(2) + 1)
    >>> ops["aten.add.Tensor"]
    1
    """
    counts: dict[str, int] = {}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[str(func)] = counts.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    with Counter():
        call()
    return counts
