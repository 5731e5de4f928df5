"""A hybrid K/V cache: a ring of ``W`` slots for each sliding-window layer, a growing layer for
each global one, in one :class:`~kvdoc.core.cache.KVCache`.

A decoder whose layers alternate sliding-window and global attention (Gemma 2 and 3,
:mod:`kvdoc.core.gemma`) needs both kinds of storage at once: a window layer's queries never read
a key more than ``W - 1`` positions back, so its memory can stop at ``W`` positions, while a global
layer reads every position. :class:`HybridCache` is a list of mixed layers: a
:class:`~kvdoc.core.layers.RingLayer` for each window layer, a
:class:`~kvdoc.core.layers.DynamicLayer` (grown by concatenation, not preallocated) for each
global one. Per layer it behaves exactly as that layer's cache does: ``layer(i)`` returns the
positions ``held(i)`` in order, ``update`` returns what the new queries read, and a forward call
works on a copy (the rings cloned, the global layers' tensors shared, as concatenation never
touches them), so the cache passed in is never modified.

Memory after ``T`` positions, with ``L_w`` window layers and ``L_g`` global ones, is
``2 x B x H_kv x D_h x s x (L_w x W + L_g x T)``: the rings are allocated at ``W`` slots from the
start.

>>> from kvdoc.core.gemma import Gemma3Config
>>> config = Gemma3Config(sliding_window=4)            # layer 0 slides, layer 1 is global
>>> cache = HybridCache(config, batch_size=1)
>>> cache.windows, cache.seq_len
((4, None), 0)
>>> k = torch.zeros(1, 2, 6, 16)                      # 6 new positions, [B, H_kv, C, D_h]
>>> work = cache.begin()
>>> [tuple(work.update(i, k, k, 0)[0].shape) for i in range(2)]   # what the queries read
[(1, 2, 6, 16), (1, 2, 6, 16)]
>>> work.finish(6)
>>> work.held(0), work.held(1), cache.seq_len       # the ring keeps 4; the caller's is untouched
(range(2, 6), range(0, 6), 0)
>>> work.nbytes() == 2 * 1 * 2 * 16 * 4 * (4 + 6)    # K and V x B x H_kv x D_h x 4 bytes x rows
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .cache import KVCache
from .config import check_int
from .layers import DynamicLayer, RingLayer


class HybridConfig(Protocol):
    """What a hybrid cache needs of a model's config (:class:`~kvdoc.core.gemma.Gemma3Config`)."""

    n_layer: int
    n_kv_head: int
    head_dim: int

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer the window ``W`` of a sliding layer, or None for a global one."""


def check_windows(windows: Sequence[int | None]) -> tuple[int | None, ...]:
    """``windows`` as a tuple, or ``ValueError`` unless every entry is None or one positive ``W``.

    >>> check_windows([8, None, 4])
    Traceback (most recent call last):
    ...
    ValueError: the window layers must share one window, got [8, 4]
    """
    windows = tuple(windows)
    if not windows:
        raise ValueError("a cache needs at least one layer")
    rings = [w for w in windows if w is not None]
    for w in rings:
        check_int("window", w)
    if len(set(rings)) > 1:
        raise ValueError(f"the window layers must share one window, got {rings}")
    return windows


class HybridCache(KVCache):
    """Rings of ``W`` slots for the window layers, growing K/V for the global ones.

    Args:
        config: the model's sizes and its per-layer windows (``config.layer_windows``).
        batch_size: ``B``.
        dtype, device: must match the model's.

    :meth:`held` takes a layer: a window layer holds the last ``min(seq_len, W)`` positions, a
    global layer all of them; without a layer it answers for every layer at once (the positions
    each holds: a window layer's, once any layer is one).
    """

    def __init__(self, config: HybridConfig, batch_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.windows = check_windows(config.layer_windows)
        check_int("batch_size", batch_size)
        widths = (config.head_dim, config.head_dim)
        super().__init__([
            DynamicLayer.empty(batch_size, config.n_kv_head, widths, dtype, device) if w is None
            else RingLayer(batch_size, config.n_kv_head, widths, w, dtype, device)
            for w in self.windows])
        self.window = next((w for w in self.windows if w is not None), None)

    def check_compatible(self, config: HybridConfig, batch_size: int, dtype: torch.dtype,
                         device: torch.device, new_len: int) -> None:
        windows = getattr(config, "layer_windows", None)
        if windows is None:
            raise ValueError("a hybrid cache serves a model with per-layer windows "
                             "(config.layer_windows); this model has none")
        super().check_compatible(config, batch_size, dtype, device, new_len)
        if tuple(windows) != self.windows:
            raise ValueError(f"cache was built for other layer windows: {self.windows}, "
                             f"model has {tuple(windows)}")
