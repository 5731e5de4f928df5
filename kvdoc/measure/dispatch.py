"""Counting what ATen operations do, through torch's dispatch mode: the bytes each writes and
reads (:class:`WriteCounter`; :class:`CopyMeter` per cache update) and how many run. A cache
update is counted by what it does (a dynamic cache's ``torch.cat``, a static one's slice copy):
bytes written beyond the new rows are old content copied again. ``TorchDispatchMode`` and
``_schema`` are private PyTorch APIs, used for measurements only and in this module only.

>>> import torch
>>> a, b = torch.zeros(2, 3), torch.zeros(1, 3)
>>> with WriteCounter() as counter:
...     _ = torch.cat((a, b))  # reads 24 + 12 bytes, writes a new 3 x 3 FP32 tensor: 36 bytes
>>> counter.read, counter.written, counter.allocated
(36, 36, 36)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvdoc.core.cache import KV, CacheLayer, KVCache

from .wrapper import LayerWrapper, wrap_layers


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
    """Adds up the bytes every ATen op writes (outputs, in-place targets) and reads."""

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


@dataclass
class UpdateRecord:
    """What one ``cache.update(layer, k, v, start)`` did: ``start`` positions held before it, the
    new rows' bytes, and the bytes its operations wrote, read and allocated."""

    layer: int
    start: int
    new_bytes: int
    written: int
    read: int
    allocated: int

    @property
    def old_bytes_copied(self) -> int:
        """Bytes written beyond the new rows: old content copied again."""
        return self.written - self.new_bytes


@dataclass
class CopyMeter:
    """A log of measured cache updates, shared by every cache object one generation creates.

    >>> from kvdoc import Decoder, GPTConfig
    >>> from kvdoc.measure.kv_bytes import kv_bytes_for_config
    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig())
    >>> meter = CopyMeter()
    >>> cache = meter.watch(model.new_cache(1, "dynamic"))
    >>> _, cache = model(torch.tensor([[1, 2, 3]]), cache)        # prefill 3 positions
    >>> _, cache = model(torch.tensor([[4]]), cache)              # decode: cat copies 3 old rows
    >>> meter.old_bytes_copied(start=3) == kv_bytes_for_config(model.config, 1, 3)
    True
    >>> meter.bytes_read(start=3) == meter.bytes_written(start=3)  # cat reads what it writes
    True
    """

    records: list[UpdateRecord] = field(default_factory=list)

    def watch(self, cache: KVCache) -> KVCache:
        """``cache`` itself, its layers wrapped so that their writes are measured here."""
        return wrap_layers(cache, lambda layer, i: _MeteredLayer(layer, i, self))

    def old_bytes_copied(self, start: int | None = None) -> int:
        """Old-content bytes copied, over all updates (or those that started at ``start``)."""
        return sum(r.old_bytes_copied for r in self.records if start is None or r.start == start)

    def bytes_written(self, start: int | None = None) -> int:
        """Bytes written, over all updates (or those that started at ``start``)."""
        return sum(r.written for r in self.records if start is None or r.start == start)

    def bytes_read(self, start: int | None = None) -> int:
        """Bytes read, over all updates (or those that started at ``start``)."""
        return sum(r.read for r in self.records if start is None or r.start == start)

    def per_step(self) -> list[tuple[int, int, int]]:
        """``(P, bytes written, old bytes copied)`` per forward call, layers summed, in order."""
        steps: dict[int, list[int]] = {}
        for r in self.records:
            acc = steps.setdefault(r.start, [0, 0])
            acc[0] += r.written
            acc[1] += r.old_bytes_copied
        return [(p, w, o) for p, (w, o) in steps.items()]


class _MeteredLayer(LayerWrapper):
    def __init__(self, inner: CacheLayer, index: int, meter: CopyMeter) -> None:
        super().__init__(inner, index)
        self.meter = meter

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        with WriteCounter() as counter:
            kv = self.inner.write(k, v, start)
        new_bytes = tensor_bytes(k) + tensor_bytes(v)
        self.meter.records.append(UpdateRecord(self.index, start, new_bytes, counter.written,
                                               counter.read, counter.allocated))
        return kv
