"""What a cache update writes, measured rather than trusted.

:class:`CopyMeter` wraps a cache's layers so that each write runs under
:class:`kvdoc.measure.dispatch.WriteCounter`, which adds up the bytes every tensor operation
writes and reads:
``torch.cat`` in a :class:`~kvdoc.core.cache.DynamicCache` and the slice copy in a
:class:`~kvdoc.core.cache.StaticCache` are counted by what they actually do. Bytes written beyond
the new rows are old content copied again, and a copy reads every byte it writes, so memory
traffic is the sum of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdoc.core.cache import KV, CacheLayer, KVCache

from .dispatch import WriteCounter, tensor_bytes
from .wrapper import LayerWrapper, wrap_layers


@dataclass
class UpdateRecord:
    """What one ``cache.update(layer, k, v, start)`` wrote, measured by :class:`CopyMeter`."""

    layer: int
    start: int
    """``P``: positions held before the update."""
    new_rows: int
    """``C``: positions added."""
    new_bytes: int
    """Bytes of the new K and V rows passed in."""
    written: int
    """Bytes every tensor operation inside the update wrote."""
    read: int
    """Bytes of the tensors those operations read (a copy's source, ``cat``'s inputs)."""
    allocated: int
    """Bytes of tensors the update created."""

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
        """``cache`` itself, its layers wrapped so that their writes are measured into this
        meter; a static layer is still written in place."""
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
        self.meter.records.append(UpdateRecord(self.index, start, k.shape[2], new_bytes,
                                               counter.written, counter.read, counter.allocated))
        return kv
