"""Deliberately wrong dynamic and static caches: layers that store or return the wrong rows,
and transactions that commit the length at the wrong time or write into the caller's cache.

A broken layer is a subclass of the real one swapped in through the cache's public ``layers``
(:func:`with_layers`); a broken transaction, a subclass of the real cache; :func:`decoder_with`
makes a decoder whose new caches are built of them.

>>> import torch
>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = decoder_with(dynamic_layer=NewBeforeOldLayer)(Decoder(GPTConfig()).eval())
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
>>> with torch.no_grad():
...     _, cache = model(ids[:, :4], model.new_cache(1, "dynamic"))
...     wrong = model(ids[:, 4:], cache).logits
>>> bool((wrong - model(ids).logits[:, 4:]).abs().max() > 1e-3)
True
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from kvdoc.core.cache import (
    KV,
    CacheLayer,
    DynamicCache,
    DynamicLayer,
    KVCache,
    StaticCache,
    StaticLayer,
)
from kvdoc.core.model import Decoder
from kvdoc.measure.wrapper import LayerWrapper, wrap_layers

from . import LONG_STREAM
from .decoders import copy_as

# --- wrong caches -------------------------------------------------------------------------


class CrossLayerLayer(LayerWrapper):
    """BROKEN: stores each layer's K/V correctly, but every layer attends over layer 0's."""

    def __init__(self, inner: CacheLayer, index: int, first: dict) -> None:
        super().__init__(inner, index)
        self.first = first  # one dict for every layer of the cache

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        own = self.inner.write(k, v, start)  # stored correctly
        if self.index == 0:
            self.first["rows"] = own  # layer 0 runs first in every call: rows 0 .. start + C - 1
            return own
        return self.first["rows"]  # BUG: another layer's keys and values


class NewBeforeOldLayer(DynamicLayer):
    """BROKEN: stores the new K/V before the cached ones, ``cat((new, old))``."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        # BUG: new rows first, then the old ones
        self.k, self.v = torch.cat((k, self.k), dim=2), torch.cat((v, self.v), dim=2)
        return self.k, self.v


class NewBeforeOldStaticLayer(StaticLayer):
    """BROKEN: :class:`NewBeforeOldLayer` in place: rows below the write position change."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        end = start + k.shape[2]
        for store, new in ((self.k, k), (self.v, v)):
            old = store[:, :, :start].clone()
            store[:, :, : end - start] = new  # BUG: new rows first, old rows pushed behind them
            store[:, :, end - start: end] = old
        return self.k[:, :, :end], self.v[:, :, :end]


def with_layers(cache: KVCache, cls: type[CacheLayer]) -> KVCache:
    """``cache`` with every layer's class swapped for ``cls`` (a broken subclass of it): the same
    tensors and sizes, the broken ``write``."""
    for layer in cache.layers:
        if not isinstance(layer, cls.__mro__[1]):
            raise ValueError(f"{cls.__name__} replaces a {cls.__mro__[1].__name__}, "
                             f"not a {type(layer).__name__}")
    cache.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in cache.layers:
        layer.__class__ = cls
    return cache


class CacheKindsDecoder(Decoder):
    """A decoder whose new dynamic and static caches are of the classes ``dynamic_cache`` and
    ``static_cache`` with layers ``dynamic_layer`` and ``static_layer`` (None: the real ones)."""

    dynamic_cache: type[DynamicCache] = DynamicCache
    static_cache: type[StaticCache] = StaticCache
    dynamic_layer: type[DynamicLayer] | None = None
    static_layer: type[StaticLayer] | None = None

    def new_cache(self, batch_size: int, kind: str | None = None,
                  capacity: int | None = None) -> KVCache:
        weight = self.wte.weight
        if kind == "dynamic":
            cache = self.dynamic_cache.empty(self.config, batch_size, weight.dtype, weight.device)
            return with_layers(cache, self.dynamic_layer) if self.dynamic_layer else cache
        if kind == "static":
            cache = self.static_cache(self.config, batch_size,
                                      capacity or self.config.n_positions, weight.dtype,
                                      weight.device)
            return with_layers(cache, self.static_layer) if self.static_layer else cache
        return super().new_cache(batch_size, kind, capacity)  # other kinds: not this bug


def decoder_with(**broken: type) -> Callable[[Decoder], Decoder]:
    """``model ->`` a copy of it whose new caches use the ``broken`` classes (attributes of
    :class:`CacheKindsDecoder`: ``dynamic_layer=FP32Layer``, ``static_cache=...``)."""
    cls = type("BrokenCachesDecoder", (CacheKindsDecoder,), broken)
    return lambda model: copy_as(model, cls)


class FP32Layer(DynamicLayer):
    """BROKEN: rounds every K/V it stores to FP32 (a cache allocated in the default dtype)."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        k, v = k.float().to(k.dtype), v.float().to(v.dtype)  # BUG: precision lost on the way in
        return super().write(k, v, start)


class CrossLayerDecoder(Decoder):
    """A decoder whose new caches' layers are :class:`CrossLayerLayer` s (see there)."""

    def new_cache(self, batch_size: int, kind: str = "dynamic",
                  capacity: int | None = None) -> KVCache:
        first: dict = {}
        return wrap_layers(super().new_cache(batch_size, kind, capacity),
                           lambda layer, i: CrossLayerLayer(layer, i, first))


class ModuloStaticLayer(StaticLayer):
    """BROKEN: writes position ``t`` into slot ``t % 32`` but reads slots as linear."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        end = start + k.shape[2]
        # BUG: ring slots, linear reads
        slots = torch.arange(start, end, device=k.device) % LONG_STREAM
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class WindowLayer(DynamicLayer):
    """BROKEN: keeps only the newest 32 positions while the cache counts every one."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        self.k = torch.cat((self.k, k), dim=2)[:, :, -LONG_STREAM:]  # BUG: drops the oldest rows
        self.v = torch.cat((self.v, v), dim=2)[:, :, -LONG_STREAM:]
        return self.k, self.v


class EarlyLengthStaticCache(StaticCache):
    """BROKEN: advances its length once layer 0 is written, not after every layer succeeded."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> KV:
        if layer_idx == 0:
            self.call_start = self.seq_len
        if start != self.call_start:
            raise ValueError(f"cannot write at {start}: cache holds {self.call_start}")
        kv = self.layers[layer_idx].write(k, v, start)
        self.finish(start + k.shape[2])  # BUG: before the other layers ran
        return kv


class InPlaceDynamicCache(DynamicCache):
    """BROKEN: a call writes into the dynamic cache passed in (``begin`` returns ``self``)."""

    def begin(self) -> InPlaceDynamicCache:
        return self  # BUG: no copy


class LastLayerLengthStaticCache(StaticCache):
    """BROKEN: advances its length in the last layer's update, not in ``finish``."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> KV:
        kv = super().update(layer_idx, k, v, start)
        if layer_idx == self.n_layer - 1:
            self.finish(start + k.shape[2])  # BUG: the call has not finished yet
        return kv
