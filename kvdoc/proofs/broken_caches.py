"""Deliberately wrong caches of the serving layer and the window ring, for the broken variants.

Each is a small subclass of a real cache that is right on every path the older scenarios take
and wrong at one edge or in one figure, so that only a check of :mod:`kvdoc.proofs.invariants`
catches it:

* :class:`KOnlyBlockPool`: a paged pool that counts only K's bytes (the memory page's figures
  would silently halve);
* :class:`RequantisingInt8Cache`: an int8 cache that re-quantises every row it holds on every
  append, with one scale per tensor;
* :class:`VScaleReadInt8Cache`: an int8 cache that stores and returns every row right through
  ``layer()``, but hands the attention K dequantised with V's scales;
* :class:`LongChunkRingCache`: a window ring that keeps the first ``W`` rows of a chunk longer
  than the window, not the last;
* :class:`LazyRingCache`: a window ring shared with the cache it continues until a write would
  overwrite a held position, so two branches before the ring has wrapped write into one ring;
* :class:`ResumeWithoutRecompute`: a scheduler whose preemption gives the blocks back but keeps
  the count of written positions (the ``scheduling`` scenario's ``"scheduler"``);
* :class:`ForkWithoutCopy`: a scheduler whose forks write into the blocks they share;
* :class:`LateCopySharedPrefixCache`: a shared-prefix cache that copies only the shared blocks
  a write starts, never the shared, partly filled one it continues;
* :class:`RingedGlobalHybridCache`: a hybrid cache (:mod:`kvdoc.core.hybrid`) that rings its
  global layers too: right until the stream passes the window.

The factories (``(model, batch, capacity) -> cache``) are what
:attr:`kvdoc.proofs.variants.BrokenVariant.caches` puts in place of a kind's real factory.

>>> from kvdoc import Decoder, GPTConfig
>>> model = Decoder(GPTConfig()).eval()
>>> cache = k_only_paged_cache(model, batch=1, capacity=8)
>>> cache.pool.nbytes() * 2 == sum(t.numel() * t.element_size() for t in cache.tensors())
True
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn

from kvdoc.core.cache import KV
from kvdoc.core.gemma import Gemma3Config
from kvdoc.core.hybrid import HybridCache
from kvdoc.core.window import SlidingWindowCache
from kvdoc.serving.paged import BlockPool, PagedCache, SharedPrefixCache
from kvdoc.serving.quant import Int8Cache, dequantize
from kvdoc.serving.scheduler import LiveRequest, Scheduler

BLOCK = 4
"""Positions per block of the grid's paged caches (:func:`kvdoc.serving.paged.new_paged_cache`)."""


def _pool(pool_cls: type[BlockPool], model: nn.Module, batch: int, capacity: int,
          spare: int) -> BlockPool:
    weight = model.wte.weight
    blocks = batch * (math.ceil(capacity / BLOCK) + spare)
    return pool_cls(model.config, blocks, BLOCK, weight.dtype, weight.device)


class KOnlyBlockPool(BlockPool):
    """BROKEN: a block's bytes are K's only, so the pool's figures are half its tensors' bytes."""

    @property
    def block_nbytes(self) -> int:
        return sum(k[0].numel() * k.element_size() for k in self.k)  # BUG: V left out


def k_only_paged_cache(model: nn.Module, batch: int, capacity: int) -> PagedCache:
    """A :class:`~kvdoc.serving.paged.PagedCache` on a :class:`KOnlyBlockPool`."""
    return PagedCache(_pool(KOnlyBlockPool, model, batch, capacity, spare=0), batch)


class RequantisingInt8Cache(Int8Cache):
    """BROKEN: on every append, every row held is dequantised and quantised again with the new
    rows, under one scale for the whole tensor (per layer, K and V apart)."""

    def begin(self) -> RequantisingInt8Cache:
        return RequantisingInt8Cache(self._kv)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        old_k, old_v = self.layer(layer_idx)
        if start != old_k.shape[2]:
            raise ValueError(f"layer {layer_idx} holds {old_k.shape[2]} positions, "
                             f"write starts at {start}")
        stored = []
        for old, new in ((old_k, k), (old_v, v)):
            x = torch.cat((old, new), dim=2)
            amax = x.abs().amax()
            scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # BUG: one scale
            q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)  # BUG: old rows again
            stored += [q, scale.expand(*x.shape[:3], 1).clone()]
        self._kv[layer_idx] = tuple(stored)
        return self.layer(layer_idx)


def requantising_int8_cache(model: nn.Module, batch: int, capacity: int | None = None
                            ) -> RequantisingInt8Cache:
    """An empty :class:`RequantisingInt8Cache` for ``model``."""
    weight = model.wte.weight
    return RequantisingInt8Cache.empty(model.config, batch, weight.dtype, weight.device)


class VScaleReadInt8Cache(Int8Cache):
    """BROKEN: what ``update`` returns to the attention is K dequantised with the V rows' scales;
    the rows stored, and what :meth:`layer` returns, are right."""

    def begin(self) -> VScaleReadInt8Cache:
        return VScaleReadInt8Cache(self._kv)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        super().update(layer_idx, k, v, start)
        qk, _, qv, v_scale = self._kv[layer_idx]
        return dequantize(qk, v_scale), dequantize(qv, v_scale)  # BUG: V's scale for K


def v_scale_read_int8_cache(model: nn.Module, batch: int, capacity: int | None = None
                            ) -> VScaleReadInt8Cache:
    """An empty :class:`VScaleReadInt8Cache` for ``model``."""
    weight = model.wte.weight
    return VScaleReadInt8Cache.empty(model.config, batch, weight.dtype, weight.device)


class LongChunkRingCache(SlidingWindowCache):
    """BROKEN: of a chunk longer than the window, the first ``W`` rows go into the ring, not the
    last ``W``. Right for every chunk of at most ``W`` tokens."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        if start != self._len:
            raise ValueError(f"layer {layer_idx}: cache has seen {self._len} positions, "
                             f"write starts at {start}")
        old_k, old_v = self.layer(layer_idx)
        keep = self.window - 1
        full_k = torch.cat((old_k[:, :, old_k.shape[2] - min(keep, old_k.shape[2]):], k), dim=2)
        full_v = torch.cat((old_v[:, :, old_v.shape[2] - min(keep, old_v.shape[2]):], v), dim=2)
        last = min(k.shape[2], self.window)
        slots = torch.tensor([self.slot(p) for p in range(start, start + last)], device=k.device)
        self._k[layer_idx].index_copy_(2, slots, k[:, :, :last])  # BUG: the first rows
        self._v[layer_idx].index_copy_(2, slots, v[:, :, :last])
        return full_k, full_v


class LazyRingCache(SlidingWindowCache):
    """BROKEN: a call shares the ring of the cache passed in and copies a layer's ring only when
    a write would overwrite a position it holds. The cache passed in keeps its rows, but two
    continuations of one cache before its ring has wrapped write into the same free slots."""

    def begin(self) -> LazyRingCache:
        work = copy.copy(self)
        work._k, work._v = list(self._k), list(self._v)  # BUG: the same ring tensors
        return work

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        if start + k.shape[2] > self.window:  # a held slot would be overwritten: copy first
            self._k[layer_idx] = self._k[layer_idx].clone()
            self._v[layer_idx] = self._v[layer_idx].clone()
        return super().update(layer_idx, k, v, start)


def _ring(cls: type[SlidingWindowCache]):
    def new(model: nn.Module, batch: int, capacity: int) -> SlidingWindowCache:
        weight = model.wte.weight
        return cls(model.config, batch, dtype=weight.dtype, device=weight.device)
    return new


long_chunk_ring_cache = _ring(LongChunkRingCache)
"""``(model, batch, capacity) ->`` an empty :class:`LongChunkRingCache`."""
lazy_ring_cache = _ring(LazyRingCache)
"""``(model, batch, capacity) ->`` an empty :class:`LazyRingCache`."""


class LateCopySharedPrefixCache(SharedPrefixCache):
    """BROKEN: copy-on-write starts at the first block a write *starts*, so the shared block a
    prefix left partly filled is written in place: a second continuation of the same prefix
    overwrites the first one's rows there (the prefix's own rows stay as they were)."""

    def _first_block(self) -> int:
        return math.ceil(self._len / self.block_size)  # BUG: floor is the block being continued

    def _blocks_needed(self, end: int) -> int:
        first, last = self._first_block(), math.ceil(end / self.block_size)
        return sum(max(0, last - len(t)) + sum(self.pool.refs(b) > 1 for b in t[first:last])
                   for t in self.tables)

    def _reserve(self, end: int) -> None:
        needed = self._blocks_needed(end)
        if needed > self.pool.num_free:
            raise ValueError(f"out of blocks: {needed} needed, {self.pool.num_free} free")
        first, last = self._first_block(), math.ceil(end / self.block_size)
        for table in self.tables:
            for n in range(first, min(last, len(table))):
                if self.pool.refs(table[n]) > 1:
                    table[n] = self.pool.copy(table[n])
            table.extend(self.pool.allocate(max(0, last - len(table))))


def late_copy_shared_prefix_cache(model: nn.Module, batch: int, capacity: int
                                  ) -> LateCopySharedPrefixCache:
    """An empty :class:`LateCopySharedPrefixCache` (a spare block per sequence, as the real one)."""
    return LateCopySharedPrefixCache(_pool(BlockPool, model, batch, capacity, spare=1), batch)


class ResumeWithoutRecompute(Scheduler):
    """BROKEN: preemption gives the blocks back but keeps the count of written positions, so the
    request, admitted again, decodes on as if its K/V were still there: nothing re-prefilled."""

    def preempt(self, live: LiveRequest) -> int:
        discarded = live.fed
        self.pool.release(live.table)
        live.table.clear()
        live.preemptions += 1  # BUG: live.fed = 0 missing
        return discarded


class ForkWithoutCopy(Scheduler):
    """BROKEN: a write into a block shared with other forks goes into the shared block itself
    (no copy-on-write), so the forks overwrite each other's K/V in the prompt's last block."""

    def reserve(self, live: LiveRequest, end: int) -> bool:
        missing = max(0, self.blocks_for(end) - len(live.table))
        if missing > self.pool.num_free:
            return False
        live.table.extend(self.pool.allocate(missing))  # BUG: shared blocks not copied
        return True


class RingedGlobalHybridCache(HybridCache):
    """BROKEN: every layer, global ones included, is a ring of ``W`` slots (the cache still states
    the model's per-layer windows, so it passes its compatibility check). A global layer's
    queries then lose every key older than ``W - 1`` positions."""

    def __init__(self, config: Gemma3Config, batch_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        # BUG: built as if every layer slid (a pattern longer than the model has no global layer)
        every_layer_slides = dataclasses.replace(config, sliding_window_pattern=config.n_layer + 1)
        super().__init__(every_layer_slides, batch_size, dtype, device)
        self.windows = config.layer_windows  # what it states: the model's windows


def ringed_global_hybrid_cache(model: nn.Module, batch: int, capacity: int | None = None
                               ) -> RingedGlobalHybridCache:
    """An empty :class:`RingedGlobalHybridCache` for a Gemma ``model``."""
    weight = model.wte.weight
    return RingedGlobalHybridCache(model.config, batch, weight.dtype, weight.device)
