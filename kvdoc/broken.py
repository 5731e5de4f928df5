"""Deliberately wrong KV-cache implementations, kept so that the equivalence check can be seen to fail.

Each variant is a small change to the real :class:`~kvdoc.model.Decoder`, made without editing
it: a subclass that overrides :meth:`~kvdoc.model.Decoder.positions`, an attention module whose
:meth:`~kvdoc.model.CausalSelfAttention.mask` is swapped, or a cache (a :class:`~kvdoc.cache.KVCache`)
whose ``update`` returns or stores the wrong K/V. One variant is a scenario rather than code: a
cache filled before a prefix edit and reused after it.

Every variant here is **wrong on purpose**. :data:`VARIANTS` lists them by name;
:func:`kvdoc.verify.verify` (``python -m kvdoc verify --variant NAME``) must fail on each.

>>> import torch
>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> broken = VARIANTS["positions-restart"].build(model)
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
>>> with torch.no_grad():
...     _, cache = broken(ids[:, :4], broken.new_cache(1))
...     wrong = broken(ids[:, 4:], cache).logits      # positions 0, 1 instead of 4, 5
...     right = model(ids).logits[:, 4:]
>>> bool((wrong - right).abs().max() > 1e-2)
True
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cache import KV, DynamicCache, KVCache, StaticCache
from .config import GPTConfig
from .mask import offset_causal_mask, top_left_causal_mask
from .model import CausalSelfAttention, Decoder


def _copy_as(model: Decoder, cls: type[Decoder]) -> Decoder:
    """A model of class ``cls`` with ``model``'s config, weights, dtype and device, in eval mode."""
    clone = copy.deepcopy(model)  # no fresh initialisation: fast, and the global RNG is left alone
    clone.__class__ = cls  # the variants add methods, never state
    return clone.eval()


def _with_mask(model: Decoder, mask: Callable[..., torch.Tensor | None]) -> Decoder:
    """A copy of ``model`` whose every attention module uses ``mask(self, past_len, new_len, device)``."""
    clone = _copy_as(model, Decoder)
    for block in clone.h:
        block.attn.mask = types.MethodType(mask, block.attn)
    return clone


# --- wrong positions ---------------------------------------------------------------------------

class PositionsRestartDecoder(Decoder):
    """BROKEN: every call numbers its new tokens from 0, as if each chunk began the sequence.

    A full forward starts at 0 anyway, so it is right; every continuation of a cache embeds its
    tokens at positions ``0 .. C - 1`` instead of ``P .. P + C - 1``.
    """

    def positions(self, start: int, new_len: int, device: torch.device) -> torch.Tensor:
        return torch.arange(0, new_len, device=device)  # BUG: ignores start


# --- wrong masks ----------------------------------------------------------------------------

def _top_left_mask(self: CausalSelfAttention, past_len: int, new_len: int,
                   device: torch.device) -> torch.Tensor:
    """BROKEN: ``is_causal=True``'s top-left triangle; new query ``i`` reads keys ``0 .. i`` only."""
    return top_left_causal_mask(past_len, new_len, device)  # BUG: no offset by past_len


def _no_mask(self: CausalSelfAttention, past_len: int, new_len: int, device: torch.device) -> None:
    """BROKEN: no mask at all, also for chunks of several new tokens, which then read each other's future."""
    return None  # BUG: right only when new_len == 1


def _off_by_one_mask(self: CausalSelfAttention, past_len: int, new_len: int,
                     device: torch.device) -> torch.Tensor | None:
    """BROKEN: ``j <= P + i + 1``: each query of a chunk also reads the token after it."""
    if new_len == 1:
        return None
    query_pos = past_len + torch.arange(new_len, device=device)
    key_pos = torch.arange(past_len + new_len, device=device)
    return key_pos[None, :] <= query_pos[:, None] + 1  # BUG: one key too many


# --- wrong caches -------------------------------------------------------------------------

class _CacheWrapper(KVCache):
    """A cache that delegates to a real one; subclasses change what ``update`` returns."""

    def __init__(self, inner: KVCache) -> None:
        self.inner = inner
        for name in ("n_layer", "batch_size", "n_kv_head", "head_dim", "dtype", "device"):
            setattr(self, name, getattr(inner, name))

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    def layer(self, idx: int) -> KV:
        return self.inner.layer(idx)

    def begin(self) -> _CacheWrapper:
        return type(self)(self.inner.begin())

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        return self.inner.update(layer_idx, k, v, start)

    def finish(self, end: int) -> None:
        self.inner.finish(end)

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors()

    def check_compatible(self, config: GPTConfig, batch_size: int, dtype: torch.dtype,
                         device: torch.device, new_len: int) -> None:
        self.inner.check_compatible(config, batch_size, dtype, device, new_len)


class CrossLayerCache(_CacheWrapper):
    """BROKEN: stores each layer's K/V correctly, but every layer attends over layer 0's K/V.

    The cache's content is right, so a check of K/V alone passes; only the logits show the bug.
    """

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        own = self.inner.update(layer_idx, k, v, start)  # stored correctly
        if layer_idx == 0:
            self._layer0 = own  # layer 0 runs first in every call, so this holds rows 0 .. start + C - 1
            return own
        return self._layer0  # BUG: another layer's keys and values


class NewBeforeOldDynamicCache(DynamicCache):
    """BROKEN: concatenates the new K/V before the cached ones, ``cat((new, old))``, and stores that order."""

    def begin(self) -> NewBeforeOldDynamicCache:
        return NewBeforeOldDynamicCache(self._kv)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        past_k, past_v = self._kv[layer_idx]
        if past_k.shape[2] != start:
            raise ValueError(f"layer {layer_idx} holds {past_k.shape[2]} positions, write starts at {start}")
        kv = (torch.cat((k, past_k), dim=2), torch.cat((v, past_v), dim=2))  # BUG: new rows first
        self._kv[layer_idx] = kv
        return kv


class NewBeforeOldStaticCache(StaticCache):
    """BROKEN: the static twin of :class:`NewBeforeOldDynamicCache`: it rewrites rows ``0 .. P + C - 1``
    in place as new-then-old, so the rows below the write position change too."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        end = start + k.shape[2]
        if start != self._len or end > self.capacity:
            raise ValueError(f"cannot write positions {start}..{end - 1}: cache holds {self._len} "
                             f"of {self.capacity}")
        for store, new in ((self._k[layer_idx], k), (self._v[layer_idx], v)):
            old = store[:, :, :start].clone()
            store[:, :, : end - start] = new  # BUG: new rows first, old rows pushed behind them
            store[:, :, end - start: end] = old
        return self._k[layer_idx][:, :, :end], self._v[layer_idx][:, :, :end]


class CrossLayerDecoder(Decoder):
    """A decoder whose new caches are :class:`CrossLayerCache` (see there)."""

    def new_cache(self, batch_size: int, kind: str = "dynamic", capacity: int | None = None) -> KVCache:
        return CrossLayerCache(super().new_cache(batch_size, kind, capacity))


class NewBeforeOldDecoder(Decoder):
    """A decoder whose new caches place new K/V before the old (see :class:`NewBeforeOldDynamicCache`)."""

    def new_cache(self, batch_size: int, kind: str = "dynamic", capacity: int | None = None) -> KVCache:
        weight = self.wte.weight
        if kind == "dynamic":
            return NewBeforeOldDynamicCache.empty(self.config, batch_size, weight.dtype, weight.device)
        if kind == "static":
            return NewBeforeOldStaticCache(self.config, batch_size, capacity or self.config.n_positions,
                                           weight.dtype, weight.device)
        raise ValueError(f"unknown cache kind {kind!r}; use 'dynamic' or 'static'")


# --- the registry ---------------------------------------------------------------------------

def stale_prefix(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The prefix as it was before an edit: ``ids`` (``[B, T]``) with token 0 of every row replaced.

    The stale-cache scenario fills the cache from this old prefix, then continues with the edited
    (current) tokens, as if a cache were reused after the user changed the first word.
    """
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must be a non-empty [B, T] tensor, got {tuple(ids.shape)}")
    old = ids.clone()
    old[:, 0] = (ids[:, 0] + 1) % vocab_size
    return old


@dataclass(frozen=True)
class BrokenVariant:
    """One deliberately wrong implementation.

    Attributes:
        name: the key in :data:`VARIANTS` and the value of ``--variant``.
        breaks: one sentence: what is wrong.
        build: makes the broken model from a correct one (same weights, dtype, device).
        stale_prefix: a scenario, not code: the cached path's first chunk is fed the prefix as it
            was before an edit (:func:`stale_prefix`), the rest the current tokens.
    """

    name: str
    breaks: str
    build: Callable[[Decoder], Decoder]
    stale_prefix: bool = False


VARIANTS: dict[str, BrokenVariant] = {v.name: v for v in (
    BrokenVariant("positions-restart", "position ids restart at 0 on every call instead of at the cache length",
                  lambda m: _copy_as(m, PositionsRestartDecoder)),
    BrokenVariant("top-left-mask", "the causal mask is not offset by the cache length (is_causal=True's top-left "
                  "triangle), also for one-token decode", lambda m: _with_mask(m, _top_left_mask)),
    BrokenVariant("no-mask", "no mask at all, so a chunk of several tokens reads its own future",
                  lambda m: _with_mask(m, _no_mask)),
    BrokenVariant("off-by-one-mask", "the mask allows j <= P + i + 1: each query also reads the next token",
                  lambda m: _with_mask(m, _off_by_one_mask)),
    BrokenVariant("cross-layer-cache", "every layer attends over layer 0's K/V instead of its own",
                  lambda m: _copy_as(m, CrossLayerDecoder)),
    BrokenVariant("new-before-old", "new K/V are concatenated before the cached ones, not after",
                  lambda m: _copy_as(m, NewBeforeOldDecoder)),
    BrokenVariant("stale-cache", "a cache filled before a prefix edit (token 0 changed) is reused after it",
                  lambda m: _copy_as(m, Decoder), stale_prefix=True),
)}
"""Every broken variant, by name."""
