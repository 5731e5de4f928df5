"""A cache layer that wraps another, to add behaviour around a cache without editing it: the copy
meter (:class:`kvdoc.measure.dispatch.CopyMeter`) counts what each write moves, and broken
caches (:mod:`kvdoc.proofs.broken.caches`) misuse what correct ones return.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from kvdoc.core.cache import KV, CacheLayer, KVCache


class LayerWrapper(CacheLayer):
    """Layer ``index`` of a cache, delegating to ``inner`` (its :meth:`fork` too, so a wrapped
    layer keeps its rules); subclasses change :meth:`write`.

    >>> from kvdoc import GPTConfig, StaticCache
    >>> cache = wrap_layers(StaticCache(GPTConfig(), batch_size=1, capacity=4), LayerWrapper)
    >>> work = cache.begin()
    >>> work is cache, type(work.layers[1]).__name__, work.layers[1].index, work.capacity
    (True, 'LayerWrapper', 1, 4)
    """

    def __init__(self, inner: CacheLayer, index: int) -> None:
        self.inner, self.index = inner, index
        self.batch_size, self.heads, self.widths = inner.batch_size, inner.heads, inner.widths
        self.dtype, self.device = inner.dtype, inner.device
        self.in_place, self.window, self.capacity = inner.in_place, inner.window, inner.capacity

    def __getattr__(self, name: str) -> object:  # what a kind adds (scales, tables, ...)
        if name == "inner":  # not set yet (copy.copy builds without __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _around(self, inner: CacheLayer) -> LayerWrapper:
        work = copy.copy(self)  # keeps what a subclass holds (a meter, a record)
        work.inner = inner
        return work

    def fork(self) -> LayerWrapper:
        return self if self.in_place else self._around(self.inner.fork())

    def held(self, seq_len: int) -> range:
        return self.inner.held(seq_len)

    def read(self, seq_len: int) -> KV:
        return self.inner.read(seq_len)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        return self.inner.write(k, v, start)

    def crop(self, length: int, seq_len: int) -> LayerWrapper:
        return self._around(self.inner.crop(length, seq_len))

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors()

    def expected_nbytes(self, seq_len: int) -> int:
        return self.inner.expected_nbytes(seq_len)


def wrap_layers(cache: KVCache, wrapper: Callable[[CacheLayer, int], CacheLayer]) -> KVCache:
    """``cache`` itself, each layer ``l`` now ``wrapper(layer, l)``."""
    cache.layers = [wrapper(layer, i) for i, layer in enumerate(cache.layers)]
    return cache


def unwrapped(cache: KVCache) -> KVCache:
    """A cache of the layers inside ``cache``'s wrappers, at its length."""
    return KVCache([layer.inner for layer in cache.layers], cache.seq_len)
