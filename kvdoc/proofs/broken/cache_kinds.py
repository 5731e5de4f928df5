"""Deliberately wrong caches of the serving layer and the window layer, and measure functions
that give a wrong figure, for the broken variants.

Each is a small subclass of a real cache layer, block table or pool, swapped in through a public
hook (:func:`~kvdoc.proofs.broken.caches.with_layers`, a cache's ``block_tables``), right on
every path the older scenarios take and wrong at one edge or in one figure: a pool's bytes, an
int8 or FP8 layer's scales, a window layer's long chunk or shared slots, a shared block's copy,
a global layer windowed. Each factory ``(model, batch, capacity) -> cache`` is what
:attr:`kvdoc.proofs.variants.BrokenVariant.caches` puts in place of the real one.

>>> from kvdoc import Decoder, GPTConfig
>>> model = Decoder(GPTConfig()).eval()
>>> cache = k_only_paged_cache(model, batch=1, capacity=8)
>>> cache.pool.nbytes() * 2 == sum(t.numel() * t.element_size() for t in cache.tensors())
True
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch
from torch import nn

from kvdoc.core.cache import KV, CacheLayer, KVCache
from kvdoc.core.window import WindowLayer, window_cache
from kvdoc.measure.costs import StepTraffic, step_traffic
from kvdoc.measure.model_caches import LayerCache, ModelCache, config_cache
from kvdoc.serving.fp8 import Fp8Layer, amax_scale, new_fp8_cache, quantize
from kvdoc.serving.paged import BlockPool, BlockTables, PagedCache, pool_for
from kvdoc.serving.quant import Int8Layer, dequantize, int8_cache

from .caches import with_layers

BLOCK = 4
"""Positions per block of the grid's paged caches (:func:`kvdoc.serving.paged.new_paged_cache`)."""


class KOnlyBlockPool(BlockPool):
    """BROKEN: a block's bytes are K's only, so the pool's figures are half its tensors' bytes."""

    @property
    def block_nbytes(self) -> int:
        return sum(k[0].numel() * k.element_size() for k in self.k)  # BUG: V left out


def k_only_paged_cache(model: nn.Module, batch: int, capacity: int) -> PagedCache:
    return PagedCache(pool_for(model, batch, capacity, BLOCK, 0, KOnlyBlockPool), batch)


def _empty(cache_cls, layer_cls: type[CacheLayer]):
    """``(model, batch, capacity) ->`` an empty ``cache_cls`` whose layers are ``layer_cls``."""
    def new(model: nn.Module, batch: int, capacity: int | None = None) -> KVCache:
        weight = model.wte.weight
        cache = cache_cls(model.config, batch, dtype=weight.dtype, device=weight.device)
        return with_layers(cache, layer_cls)
    return new


class RequantisingInt8Layer(Int8Layer):
    """BROKEN: on every append, every row held is quantised again, one scale a tensor."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        stored = []
        for old, new in zip(self.read(start), (k, v), strict=True):
            x = torch.cat((old, new), dim=2)
            amax = x.abs().amax()
            scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # BUG: one scale
            q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)  # BUG: old rows again
            stored += [q, scale.expand(*x.shape[:3], 1).clone()]
        self.rows = tuple(stored)
        return self.read(start + k.shape[2])


requantising_int8_cache = _empty(int8_cache, RequantisingInt8Layer)


class VScaleReadInt8Layer(Int8Layer):
    """BROKEN: ``write`` returns K dequantised with V's scales (what it stores is right)."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        super().write(k, v, start)
        qk, _, qv, v_scale = self.rows
        return dequantize(qk, v_scale), dequantize(qv, v_scale)  # BUG: V's scale for K


v_scale_read_int8_cache = _empty(int8_cache, VScaleReadInt8Layer)


class NarrowInt8Layer(Int8Layer):
    """BROKEN: quantises and dequantises in the model's own dtype: in BF16 or FP16 a value can
    land a step off, past :func:`kvdoc.proofs.contracts.half_step`."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        new = []
        for x in (k, v):
            amax = x.abs().amax(dim=-1, keepdim=True)
            scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            new += [torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale]  # BUG
        self.rows = tuple(torch.cat((a, b), dim=2) for a, b in zip(self.rows, new, strict=True))
        return self.read(start + k.shape[2])

    def read(self, seq_len: int) -> KV:
        qk, sk, qv, sv = self.rows
        return qk.to(sk.dtype) * sk, qv.to(sv.dtype) * sv  # BUG: rounded to the model's dtype


narrow_int8_cache = _empty(int8_cache, NarrowInt8Layer)


class TensorScaleWriteFp8Layer(Fp8Layer):
    """BROKEN: states per-head scales and dequantises with them, but quantises each write under
    its largest head's."""

    def quantize_rows(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return quantize(x, scale.amax().expand_as(scale), self.fp8)  # BUG: not the head's


class RescalingFp8Layer(Fp8Layer):
    """BROKEN: every write, a decode step included, takes new scales from its own rows."""

    def new_scales(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return amax_scale(k, self.granularity, self.fp8), amax_scale(v, self.granularity,
                                                                     self.fp8)  # BUG: each write


class E4m3ClampFp8Layer(Fp8Layer):
    """BROKEN: each write saturates at 448, e4m3's largest value, whatever the storage."""

    def quantize_rows(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        return (x.to(wide) / scale).clamp(-448.0, 448.0).to(self.fp8)  # BUG: e4m3's range


def _fp8(layer_cls: type[Fp8Layer]):
    """``(model, batch, capacity, granularity=, scales=) ->`` an empty FP8 cache
    (:func:`~kvdoc.serving.fp8.new_fp8_cache`) whose layers are ``layer_cls``."""
    def new(model: nn.Module, batch: int, capacity: int | None = None, **scales) -> KVCache:
        return with_layers(new_fp8_cache(model, batch, capacity, **scales), layer_cls)
    return new


tensor_scale_fp8_cache = _fp8(TensorScaleWriteFp8Layer)
rescaling_fp8_cache = _fp8(RescalingFp8Layer)
e4m3_clamp_fp8_cache = _fp8(E4m3ClampFp8Layer)


class LongChunkRingLayer(WindowLayer):
    """BROKEN: of a chunk longer than the window, the first ``W`` rows are kept."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        full_k, full_v = super().write(k, v, start)
        if k.shape[2] > self.window:
            self.k, self.v = k[:, :, :self.window], v[:, :, :self.window]  # BUG: the first rows
        return full_k, full_v


class LazyRingLayer(WindowLayer):
    """BROKEN: while the window has room, new rows are written in place into ``W`` slots that
    a call shares with the cache it continues (so do two continuations of one cache)."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        end = start + k.shape[2]
        if end > self.window:
            return super().write(k, v, start)
        self.check_rows(k, v)
        slots = [self.k._base, self.v._base]  # held rows are views of the W slots
        if slots[0] is None:
            slots = self._zeros(self.window)
        for store, new in zip(slots, (k, v), strict=True):
            store[:, :, start:end] = new  # BUG: the slots are shared by every fork
        self.k, self.v = (store[:, :, :end] for store in slots)
        return self.k, self.v


long_chunk_ring_cache = _empty(window_cache, LongChunkRingLayer)
lazy_ring_cache = _empty(window_cache, LazyRingLayer)


class LateCopyBlockTables(BlockTables):
    """BROKEN: copy-on-write starts at the first block a write *starts*: a shared block a
    prefix left partly filled is written in place."""

    def needed(self, start: int, end: int) -> int:
        return super().needed(self._first(start), end)

    def reserve(self, start: int, end: int) -> None:
        super().reserve(self._first(start), end)

    def _first(self, start: int) -> int:
        # BUG: the block being continued is floor(start / S); rounding up skips its copy
        return math.ceil(start / self.block_size) * self.block_size


def late_copy_shared_prefix_cache(model: nn.Module, batch: int, capacity: int) -> PagedCache:
    """An empty shared-prefix cache of :class:`LateCopyBlockTables` (a spare block per sequence,
    as the real one)."""
    return PagedCache(pool_for(model, batch, capacity, BLOCK, 1), batch, shared=True,
                      block_tables=LateCopyBlockTables)


class RingedGlobalCache(KVCache):
    """BROKEN: every layer, global ones included, keeps only ``W`` rows, and its layout check
    states that window for every layer, so it passes."""

    def check_compatible(self, config: object, *args: object) -> None:
        window = self.layers[0].window  # BUG: the model's global layers read every key
        stated = SimpleNamespace(cache_layout=tuple(
            spec._replace(window=window) for spec in config.cache_layout))
        super().check_compatible(stated, *args)


def ringed_global_hybrid_cache(model: nn.Module, batch: int, capacity: int | None = None
                               ) -> RingedGlobalCache:
    weight, config = model.wte.weight, model.config
    return RingedGlobalCache([WindowLayer.empty(batch, s.heads, s.widths, config.sliding_window,
                                                weight.dtype, weight.device)
                              for s in config.cache_layout])


# --- measure functions (keys of :data:`kvdoc.proofs.figures.MEASURES`): a wrong figure a page
# could print
def latent_without_rope_key(config: object, windows: bool = True) -> ModelCache:
    """BROKEN: ``config_cache``, an MLA layer counting ``c_KV`` but not its rotary key."""
    model = config_cache(config, windows)
    if model.kind != "MLA":
        return model
    # BUG: kv_lora_rank alone, without qk_rope_head_dim
    return dataclasses.replace(model, layers=(LayerCache(config.kv_lora_rank),) * config.n_layer)


def batch_as_sequence(model, batch: int, context: int) -> StepTraffic:
    """BROKEN: ``step_traffic``, a step's K/V bytes one sequence's, not the batch's."""
    traffic = step_traffic(model, batch, context)
    return dataclasses.replace(traffic, kv_bytes=traffic.kv_bytes // batch)  # BUG: per sequence
