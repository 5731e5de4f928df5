"""What each kind of cache layer should hold in bytes, from its sizes alone: the one byte formula
that the verification checks every layer's ``nbytes()`` against.

A formula is registered per layer class; a subclass (a broken variant of a layer, say) is held
to its real kind's formula, and a class with no formula anywhere in its bases is refused, so a
new layer kind cannot slip past the bytes check unnoticed.

>>> from kvdoc.core.cache import DynamicLayer, KVCache, StaticLayer
>>> expected_bytes(KVCache([StaticLayer(1, 2, (4, 4), capacity=8)]))   # K, V x 2 x 8 x 4 x 4
512
>>> class Mystery(DynamicLayer):
...     pass
>>> expected_bytes(KVCache([Mystery.empty(1, 2, (4, 4))]))        # a subclass: its base's formula
0
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvdoc.core.cache import CacheLayer, DynamicLayer, KVCache, StaticLayer
from kvdoc.core.window import RingLayer
from kvdoc.serving.fp8 import SCALE_DTYPE, Fp8Layer
from kvdoc.serving.paged import PoolLayer
from kvdoc.serving.quant import Int8Layer

from .kv_bytes import rows_bytes


def _size(layer: CacheLayer) -> int:
    return torch.empty((), dtype=layer.dtype).element_size()


def _rows(layer: CacheLayer, positions: int) -> int:
    """Bytes of ``positions`` rows of both tensors: ``B x H x positions x (w_K + w_V) x s``."""
    return rows_bytes(layer.batch_size, layer.heads, positions, layer.widths, layer.dtype)


def _pool(layer: PoolLayer, seq_len: int) -> int:
    pool = layer.pool
    # a layer's share of the pool, every block free or held; both stores at their own
    # widths (K and V, or an MLA latent's c_KV and k_rope)
    return rows_bytes(1, layer.heads, pool.num_blocks * pool.block_size, layer.widths,
                      layer.dtype)


LAYER_BYTES: dict[type[CacheLayer], Callable[[CacheLayer, int], int]] = {
    DynamicLayer: lambda layer, T: _rows(layer, T),
    StaticLayer: lambda layer, T: _rows(layer, layer.capacity),
    RingLayer: lambda layer, T: _rows(layer, layer.window),
    # int8 values, and one scale in the model's dtype per row of K and of V
    Int8Layer: lambda layer, T: layer.batch_size * layer.heads * T * (sum(layer.widths)
                                                                     + 2 * _size(layer)),
    PoolLayer: _pool,
    # FP8 values (1 byte), and K's and V's FP32 scales: 1 each per tensor, or H_kv per head
    Fp8Layer: lambda layer, T: (layer.batch_size * layer.heads * T * sum(layer.widths)
                                + 2 * (layer.heads if layer.granularity == "per-head" else 1)
                                * SCALE_DTYPE.itemsize),
}
"""Layer class -> ``(layer, seq_len) -> bytes``."""


def expected_bytes(cache: KVCache) -> int:
    """The bytes ``cache``'s layers should hold, each by its class's formula (or its nearest
    base's); a ValueError for a layer no formula covers."""
    total = 0
    for layer in cache.layers:
        formula = next((LAYER_BYTES[c] for c in type(layer).__mro__ if c in LAYER_BYTES), None)
        if formula is None:
            raise ValueError(f"no byte formula for a {type(layer).__name__}: register its kind "
                             "in kvdoc.measure.layer_bytes.LAYER_BYTES")
        total += formula(layer, cache.seq_len)
    return total
