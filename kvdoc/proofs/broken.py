"""Deliberately wrong KV-cache implementations, kept so that the verification can be seen to fail.

Each variant is a small change to the real :class:`~kvdoc.core.model.Decoder`, made without
editing it and through nothing but its public interface: a subclass whose ``forward`` hands
wrong positions through the real ``positions=`` keyword, attention subclasses that hand a wrong
mask to the real ``attend`` or share K/V heads wrongly, or caches whose layers (a
:class:`~kvdoc.core.layers.CacheLayer` subclass swapped in through the cache's public ``layers``,
:func:`with_layers`) or transaction (``update``, ``begin``, ``finish``) store, return or count the
wrong thing. One variant is a
scenario rather than code: a cache filled before a prefix edit and reused after it. Each
belongs to one of :data:`kvdoc.proofs.variants.BUG_CLASSES`: some show only in long streams, in
grouped-query models, in FP64, after a crop or a failed call, or only against an independent
reference. The RoPE mistakes are in :mod:`kvdoc.proofs.broken_rope`.

Every variant here is **wrong on purpose**. :data:`kvdoc.proofs.variants.VARIANTS` lists them by
name; the suite (:mod:`kvdoc.proofs.suite`, ``python -m kvdoc verify --variant NAME``) must fail
on each.

>>> import torch
>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> broken = copy_as(model, PositionsRestartDecoder)
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

import torch

from kvdoc.core.cache import KV, DynamicCache, KVCache, StaticCache
from kvdoc.core.config import check_int
from kvdoc.core.fast import FastDecoder
from kvdoc.core.layers import CacheLayer, DynamicLayer, StaticLayer
from kvdoc.core.model import CausalSelfAttention, Decoder, DecoderOutput
from kvdoc.measure.wrapper import CacheWrapper


def copy_as(model: Decoder, cls: type[Decoder]) -> Decoder:
    """A new ``cls`` with ``model``'s config, weights, dtype and device, in eval mode."""
    weight = model.wte.weight
    with torch.random.fork_rng():  # the fresh weights are overwritten: leave the global RNG alone
        clone = cls(model.config).to(weight.dtype).to(weight.device)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def with_attention(model: Decoder, cls: type[CausalSelfAttention]) -> Decoder:
    """A copy of ``model`` whose every attention module is a ``cls`` holding the same weights."""
    clone = copy_as(model, Decoder)
    weight = model.wte.weight
    for block in clone.h:
        attn = cls(model.config).to(weight.dtype).to(weight.device)
        attn.load_state_dict(block.attn.state_dict())
        block.attn = attn
    return clone


# --- wrong positions ---------------------------------------------------------------------------

class PositionsRestartDecoder(Decoder):
    """BROKEN: each call numbers its new tokens from 0, as if it began the sequence.

    A full forward starts at 0 anyway, so it is right; every continuation of a cache
    embeds its tokens at positions ``0 .. C - 1`` instead of ``P .. P + C - 1``.
    """

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                **options: object) -> DecoderOutput:
        # a padded batch's own positions: not this bug
        if options.get("positions") is not None:
            return super().forward(idx, cache, **options)
        # BUG: positions 0 .. C - 1, as if no cache came before, not P .. P + C - 1
        restart = torch.arange(idx.shape[1], device=idx.device)
        return super().forward(idx, cache, positions=restart.expand_as(idx), **options)


# --- wrong masks ----------------------------------------------------------------------------

def top_left_causal_mask(past_len: int, new_len: int,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """WRONG whenever ``past_len > 0``: the mask ``is_causal=True`` builds for ``C`` new queries.

    It is ``tril`` of the ``[C, P + C]`` matrix, so local query ``i`` is treated as absolute
    position ``i`` and reads keys ``0 .. i`` only; right for a full forward (``P = 0``). Kept for
    contrast with :func:`kvdoc.core.mask.offset_causal_mask`, the mask the model uses.

    >>> top_left_causal_mask(2, 2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0]], dtype=torch.int32)
    """
    check_int("past_len", past_len, minimum=0)
    check_int("new_len", new_len)
    return torch.ones(new_len, past_len + new_len, dtype=torch.bool, device=device).tril()


class TopLeftMaskAttention(CausalSelfAttention):
    """BROKEN: ``is_causal=True``'s top-left triangle; new query ``i`` reads keys ``0 .. i`` only,
    also in one-token decode."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = top_left_causal_mask(start, q.shape[2], q.device)  # BUG: no offset by start
        return super().attend(q, k, v, start, mask[None])  # [1, C, P + C]: every batch row alike


class NoMaskAttention(CausalSelfAttention):
    """BROKEN: no mask at all, also for chunks of several new tokens, which then read each
    other's future. Right only for one new token without a window."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        everything = torch.ones(1, q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        return super().attend(q, k, v, start, everything)  # BUG: every key visible


class OffByOneMaskAttention(CausalSelfAttention):
    """BROKEN: ``j <= P + i + 1``: each query of a chunk also reads the token after it."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        query_pos = start + torch.arange(q.shape[2], device=q.device)
        key_pos = torch.arange(start + q.shape[2], device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None] + 1  # BUG: one key too many
        return super().attend(q, k, v, start, mask[None])


# --- wrong caches -------------------------------------------------------------------------

class CrossLayerCache(CacheWrapper):
    """BROKEN: stores each layer's K/V correctly, but every layer attends over layer 0's K/V.

    The cache's content is right, so a check of K/V alone passes; only the logits show the bug.
    """

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> KV:
        own = self.inner.update(layer_idx, k, v, start)  # stored correctly
        if layer_idx == 0:
            self._layer0 = own  # layer 0 runs first in every call: rows 0 .. start + C - 1
            return own
        return self._layer0  # BUG: another layer's keys and values


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
    """A decoder whose new caches are :class:`CrossLayerCache` (see there)."""

    def new_cache(self, batch_size: int, kind: str = "dynamic",
                  capacity: int | None = None) -> KVCache:
        return CrossLayerCache(super().new_cache(batch_size, kind, capacity))


class NewBeforeOldDecoder(CacheKindsDecoder):
    """A decoder whose new caches put new K/V before the old (:class:`NewBeforeOldLayer`)."""

    dynamic_layer, static_layer = NewBeforeOldLayer, NewBeforeOldStaticLayer


# --- bugs that show only in long streams ----------------------------------------------------

WINDOW = 32
"""The slot count of the long-stream variants: their bugs show only past this many positions."""


class ModuloStaticLayer(StaticLayer):
    """BROKEN: writes position ``t`` into slot ``t % 32`` (a ring buffer) but reads slots as linear.

    Right while the stream is at most 32 positions long; past that, new rows overwrite old ones
    and the rows read back past slot 31 were never written.
    """

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        end = start + k.shape[2]
        slots = torch.arange(start, end, device=k.device) % WINDOW  # BUG: ring slots, linear reads
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class WindowLayer(DynamicLayer):
    """BROKEN: silently keeps only the newest 32 positions of each layer, while the cache goes on
    counting every position."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        self.k = torch.cat((self.k, k), dim=2)[:, :, -WINDOW:]  # BUG: drops the oldest rows
        self.v = torch.cat((self.v, v), dim=2)[:, :, -WINDOW:]
        return self.k, self.v


class ModuloDecoder(CacheKindsDecoder):
    """A decoder whose static caches have :class:`ModuloStaticLayer` s (dynamic ones are right)."""

    static_layer = ModuloStaticLayer


class WindowDecoder(CacheKindsDecoder):
    """A decoder whose dynamic caches have :class:`WindowLayer` s (static ones are right)."""

    dynamic_layer = WindowLayer


class ClampedPositionsDecoder(Decoder):
    """BROKEN, in code both paths share: positions past 31 are clamped to 31, in every forward.

    Cached and full compute the same wrong function, so only an independent reference sees it.
    """

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                **options: object) -> DecoderOutput:
        # a padded batch's own positions: not this bug
        if options.get("positions") is not None:
            return super().forward(idx, cache, **options)
        start = 0 if cache is None else cache.seq_len
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        clamped = positions.clamp(max=WINDOW - 1)  # BUG
        return super().forward(idx, cache, positions=clamped.expand_as(idx), **options)


# --- grouped-query attention ----------------------------------------------------------------

class TiledGQAAttention(CausalSelfAttention):
    """BROKEN: shares K/V heads by tiling (query head ``h`` reads K/V head ``h % H_kv``), not by
    group (``h // (H / H_kv)``), on cached calls only. With one K/V head (MQA) both rules agree.
    """

    shared = False  # True: the same bug in the full forward too

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        self._tile = cache is not None or self.shared
        return super().forward(x, cache, layer_idx, start, attn_mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self._tile:
            group = self.n_head // self.n_kv_head
            # BUG: repeat, not repeat_interleave
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        return super().attend(q, k, v, start, attn_mask)


class SharedTiledGQAAttention(TiledGQAAttention):
    """BROKEN: :class:`TiledGQAAttention`'s head sharing in every forward, cached or not."""

    shared = True


# --- generation, crop and branch ------------------------------------------------------------

class LastOnlyFirstRowDecoder(Decoder):
    """BROKEN: ``last_only=True`` returns the first new position's logits, not the last one's."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                last_only: bool = False, **options: object) -> DecoderOutput:
        logits, cache = super().forward(idx, cache, **options)
        return DecoderOutput(logits[:, :1] if last_only else logits, cache)  # BUG: row 0, not -1


class PositionCounterDecoder(Decoder):
    """BROKEN: numbers new tokens from a counter on the model (reset by a call from position 0),
    not from the cache's length. Right for one stream fed in order; wrong after a crop, for a
    second branch of one prefix, and after a call that failed.
    """

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                **options: object) -> DecoderOutput:
        # a padded batch's own positions: not this bug
        if options.get("positions") is not None:
            return super().forward(idx, cache, **options)
        start = 0 if cache is None else cache.seq_len
        first = 0 if start == 0 else getattr(self, "_counter", 0)  # BUG: ignores start
        self._counter = first + idx.shape[1]
        counted = torch.arange(first, self._counter, device=idx.device)
        return super().forward(idx, cache, positions=counted.expand_as(idx), **options)


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


# --- padded batches ------------------------------------------------------------------------

class DecodeWithoutPadMaskDecoder(Decoder):
    """BROKEN: the pad mask is honoured on the prompt call but dropped on one-token decode steps,
    so a left-padded row's decode steps read its pad slots. Right for every unpadded call."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                **options: object) -> DecoderOutput:
        if cache is not None and idx.shape[1] == 1:
            options.pop("attn_mask", None)  # BUG: a decode step without the pad mask
        return super().forward(idx, cache, **options)


class _PaddingBlindFast(FastDecoder):
    def __call__(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                 last_only: bool = False, **padding: object) -> DecoderOutput:
        return super().__call__(idx, cache, last_only=last_only)  # BUG: padding dropped


class PaddingBlindFastDecoder(Decoder):
    """BROKEN: one-token calls after a cache go through a fast step (:class:`FastDecoder`'s) that
    ignores ``positions`` and ``attn_mask``; every other call is the model's own. Right for
    every unpadded call."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                last_only: bool = False, **padding: object) -> DecoderOutput:
        if cache is None or idx.shape[1] != 1:
            return super().forward(idx, cache, last_only=last_only, **padding)
        if "_fast" not in self.__dict__:
            self.__dict__["_fast"] = _PaddingBlindFast(self)
        return self.__dict__["_fast"](idx, cache, last_only=last_only, **padding)


class LastLayerLengthDecoder(CacheKindsDecoder):
    """A decoder whose static caches are :class:`LastLayerLengthStaticCache` (dynamic: right)."""

    static_cache = LastLayerLengthStaticCache


# --- a fast step that keeps its first copy of the weights ---------------------------------------

class SnapshotFastDecoder(FastDecoder):
    """BROKEN: the weights copied at construction are used for good; a change made
    in place afterwards (an optimiser step, ``load_state_dict``) is never seen."""

    def _stale(self) -> bool:
        return False  # BUG: never compares the model's weights with the copies


class SnapshotFastStepDecoder(Decoder):
    """A decoder whose one-token cached calls run :class:`SnapshotFastDecoder`'s step, made on the
    first such call (every other call: the model itself)."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                **options: object) -> DecoderOutput:
        # last_only, positions or a pad mask: the model's own path (tensors have no truth value)
        if (cache is None or idx.dim() != 2 or idx.shape[1] != 1
                or any(v is not None and v is not False for v in options.values())):
            return super().forward(idx, cache, **options)
        if getattr(self, "_fast", None) is None:
            self._fast = SnapshotFastDecoder(self)  # its other calls come back to super().forward
        return self._fast(idx, cache)


# --- scenarios ------------------------------------------------------------------------------

def stale_prefix(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The prefix as it was before an edit: ``ids`` (``[B, T]``), token 0 of every row replaced.

    The stale-cache scenario fills the cache from this old prefix, then continues with the edited
    (current) tokens, as if a cache were reused after the user changed the first word.
    """
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must be a non-empty [B, T] tensor, got {tuple(ids.shape)}")
    old = ids.clone()
    old[:, 0] = (ids[:, 0] + 1) % vocab_size
    return old
