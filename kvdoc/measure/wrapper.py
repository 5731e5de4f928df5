"""A cache that wraps another: the way to add behaviour around a cache without editing it.

:class:`CacheWrapper` delegates every method of :class:`~kvdoc.core.cache.KVCache` to the cache
it wraps; a subclass changes ``update``. The copy meter (:mod:`kvdoc.measure.copymeter`) wraps a
cache to count the bytes each update writes, and some deliberately broken caches
(:mod:`kvdoc.proofs.broken.caches`) wrap a correct one to misuse what it returns. The real caches in
:mod:`kvdoc.core` know nothing of either.
"""

from __future__ import annotations

import copy

import torch

from kvdoc.core.cache import KV, KVCache
from kvdoc.core.model import GPTConfig


class CacheWrapper(KVCache):
    """A cache that delegates everything to ``inner``; subclasses change ``update``.

    ``begin`` wraps what the inner cache's ``begin`` returns, so a wrapped dynamic cache is
    still never modified by a call, and a wrapped static cache is still written in place.

    >>> from kvdoc import GPTConfig, StaticCache
    >>> inner = StaticCache(GPTConfig(), batch_size=1, capacity=4)
    >>> wrapped = CacheWrapper(inner)
    >>> wrapped.seq_len, wrapped.begin().inner is inner
    (0, True)
    """

    def __init__(self, inner: KVCache) -> None:
        self.inner = inner
        for name in ("n_layer", "batch_size", "n_kv_head", "head_dim", "dtype", "device"):
            setattr(self, name, getattr(inner, name))

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    @property
    def layers(self) -> list:
        return self.inner.layers

    def layer(self, idx: int) -> KV:
        return self.inner.layer(idx)

    def held(self, layer_idx: int | None = None) -> range:
        return self.inner.held(layer_idx)

    def begin(self) -> CacheWrapper:
        work = copy.copy(self)  # keeps what a subclass holds (a meter, a saved layer)
        work.inner = self.inner.begin()
        return work

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        return self.inner.update(layer_idx, k, v, start)

    def finish(self, end: int) -> None:
        self.inner.finish(end)

    def crop(self, length: int) -> CacheWrapper:
        self.inner.crop(length)
        return self

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors()

    def check_compatible(self, config: GPTConfig, batch_size: int, dtype: torch.dtype,
                         device: torch.device, new_len: int) -> None:
        self.inner.check_compatible(config, batch_size, dtype, device, new_len)
