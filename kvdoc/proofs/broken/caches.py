"""Deliberately wrong dynamic and static caches: layers that store or return the wrong rows,
and transactions that commit the length at the wrong time or write into the caller's cache.

A broken layer is a subclass of the real one, swapped in through the cache's public ``layers``
(:func:`with_layers`); a broken transaction is a subclass of the real cache whose ``update`` or
``begin`` goes wrong through the public ``layers`` and ``finish``. :class:`CacheKindsDecoder`
makes the new caches of a decoder of these.

>>> import torch
>>> from kvdoc import Decoder, GPTConfig
>>> from kvdoc.proofs.broken.decoders import copy_as
>>> _ = torch.manual_seed(0)
>>> model = copy_as(Decoder(GPTConfig()).eval(), NewBeforeOldDecoder)
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
>>> with torch.no_grad():
...     _, cache = model(ids[:, :4], model.new_cache(1, "dynamic"))
...     wrong = model(ids[:, 4:], cache).logits
>>> bool((wrong - model(ids).logits[:, 4:]).abs().max() > 1e-3)
True
"""

from __future__ import annotations

import copy

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

# --- wrong caches -------------------------------------------------------------------------


class CrossLayerLayer(LayerWrapper):
    """BROKEN: stores each layer's K/V correctly, but every layer attends over layer 0's K/V.

    The cache's content is right, so a check of K/V alone passes; only the logits show the bug.
    """

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
    """BROKEN: concatenates the new K/V before the cached ones, ``cat((new, old))``, and stores
    that order."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        # BUG: new rows first, then the old ones
        self.k, self.v = torch.cat((k, self.k), dim=2), torch.cat((v, self.v), dim=2)
        return self.k, self.v


class NewBeforeOldStaticLayer(StaticLayer):
    """BROKEN: the static twin of :class:`NewBeforeOldLayer`: it rewrites rows
    ``0 .. P + C - 1`` in place as new-then-old, so the rows below the write position change
    too."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        end = start + k.shape[2]
        for store, new in ((self.k, k), (self.v, v)):
            old = store[:, :, :start].clone()
            store[:, :, : end - start] = new  # BUG: new rows first, old rows pushed behind them
            store[:, :, end - start: end] = old
        return self.k[:, :, :end], self.v[:, :, :end]


def with_layers(cache: KVCache, cls: type[CacheLayer]) -> KVCache:
    """``cache`` with every layer's class swapped for ``cls`` (a broken subclass of it), through
    the cache's public ``layers``: the same tensors and sizes, the broken ``write``.

    >>> from kvdoc import GPTConfig
    >>> cache = with_layers(DynamicCache.empty(GPTConfig(), 1), NewBeforeOldLayer)
    >>> type(cache.layers[0]).__name__
    'NewBeforeOldLayer'
    """
    for layer in cache.layers:
        if not isinstance(layer, cls.__mro__[1]):
            raise ValueError(f"{cls.__name__} replaces a {cls.__mro__[1].__name__}, "
                             f"not a {type(layer).__name__}")
    cache.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in cache.layers:
        layer.__class__ = cls
    return cache


class CacheKindsDecoder(Decoder):
    """A decoder whose new dynamic and static caches have the broken layers ``dynamic_layer`` and
    ``static_layer`` (None: the real ones), or the cache classes ``dynamic_cache`` and
    ``static_cache`` (for a bug in the transaction around the layers)."""

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


class FP32Layer(DynamicLayer):
    """BROKEN: rounds every K/V it stores to FP32, whatever the model's dtype (a cache allocated in
    the default dtype). Invisible in FP32; in FP64 the cached path is only FP32-accurate."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        k, v = k.float().to(k.dtype), v.float().to(v.dtype)  # BUG: precision lost on the way in
        return super().write(k, v, start)


class FP32CacheDecoder(CacheKindsDecoder):
    """A decoder whose dynamic caches have :class:`FP32Layer` s (static ones are right)."""

    dynamic_layer = FP32Layer


class CrossLayerDecoder(Decoder):
    """A decoder whose new caches' layers are :class:`CrossLayerLayer` s (see there)."""

    def new_cache(self, batch_size: int, kind: str = "dynamic",
                  capacity: int | None = None) -> KVCache:
        first: dict = {}
        return wrap_layers(super().new_cache(batch_size, kind, capacity),
                           lambda layer, i: CrossLayerLayer(layer, i, first))


class NewBeforeOldDecoder(CacheKindsDecoder):
    """A decoder whose new caches put new K/V before the old (:class:`NewBeforeOldLayer`)."""

    dynamic_layer, static_layer = NewBeforeOldLayer, NewBeforeOldStaticLayer


# --- bugs that show only in long streams ----------------------------------------------------


class ModuloStaticLayer(StaticLayer):
    """BROKEN: writes position ``t`` into slot ``t % 32`` (a ring buffer) but reads slots as linear.

    Right while the stream is at most 32 positions long; past that, new rows overwrite old ones
    and the rows read back past slot 31 were never written.
    """

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        end = start + k.shape[2]
        # BUG: ring slots, linear reads
        slots = torch.arange(start, end, device=k.device) % LONG_STREAM
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class WindowLayer(DynamicLayer):
    """BROKEN: silently keeps only the newest 32 positions of each layer, while the cache goes on
    counting every position."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        self.k = torch.cat((self.k, k), dim=2)[:, :, -LONG_STREAM:]  # BUG: drops the oldest rows
        self.v = torch.cat((self.v, v), dim=2)[:, :, -LONG_STREAM:]
        return self.k, self.v


class ModuloDecoder(CacheKindsDecoder):
    """A decoder whose static caches have :class:`ModuloStaticLayer` s (dynamic ones are right)."""

    static_layer = ModuloStaticLayer


class WindowDecoder(CacheKindsDecoder):
    """A decoder whose dynamic caches have :class:`WindowLayer` s (static ones are right)."""

    dynamic_layer = WindowLayer


# --- a call that fails midway ---------------------------------------------------------------


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
    """BROKEN: a call writes into the dynamic cache passed in (``begin`` returns ``self``), so a
    call that fails after layer 0 leaves layer 0 one chunk longer than the others."""

    def begin(self) -> InPlaceDynamicCache:
        return self  # BUG: no copy


class LastLayerLengthStaticCache(StaticCache):
    """BROKEN: advances its length in the last layer's update, not in ``finish``: right unless the
    call fails after the last attention (its MLP, the final norm, the LM head)."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> KV:
        kv = super().update(layer_idx, k, v, start)
        if layer_idx == self.n_layer - 1:
            self.finish(start + k.shape[2])  # BUG: the call has not finished yet
        return kv


class EarlyLengthDecoder(CacheKindsDecoder):
    """A decoder whose static caches are :class:`EarlyLengthStaticCache` (dynamic: right)."""

    static_cache = EarlyLengthStaticCache


class InPlaceDecoder(CacheKindsDecoder):
    """A decoder whose dynamic caches are :class:`InPlaceDynamicCache` (static ones are right)."""

    dynamic_cache = InPlaceDynamicCache



class LastLayerLengthDecoder(CacheKindsDecoder):
    """A decoder whose static caches are :class:`LastLayerLengthStaticCache` (dynamic: right)."""

    static_cache = LastLayerLengthStaticCache
