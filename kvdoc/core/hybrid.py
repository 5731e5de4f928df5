"""A hybrid K/V cache: a ring of ``W`` slots for each sliding-window layer, a growing cache for
each global layer, in one :class:`~kvdoc.core.cache.KVCache`.

A decoder whose layers alternate sliding-window and global attention (Gemma 2 and 3,
:mod:`kvdoc.core.gemma`) needs both kinds of storage at once: a window layer's queries never read
a key more than ``W - 1`` positions back, so its memory can stop at ``W`` positions, while a global
layer reads every position. :class:`HybridCache` is the two caches kvdoc already has, side by side:
one :class:`~kvdoc.core.window.SlidingWindowCache` over the window layers and one
:class:`~kvdoc.core.cache.DynamicCache` (grown by concatenation, not preallocated) over the global
layers, each layer index routed to its own. Per layer it behaves exactly as that cache does:
``layer(i)`` returns the positions ``held(i)`` in order, ``update`` returns what the new queries
read, and a forward call works on a copy (:meth:`HybridCache.begin`: the rings cloned, the
global layers' tensors shared, as concatenation never touches them), so the cache passed in is
never modified.

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

import copy
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from .cache import KV, DynamicCache, KVCache
from .config import check_int
from .window import SlidingWindowCache


class HybridConfig(Protocol):
    """What a hybrid cache needs of a model's config (:class:`~kvdoc.core.gemma.Gemma3Config`)."""

    n_layer: int
    n_kv_head: int
    head_dim: int

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer the window ``W`` of a sliding layer, or None for a global one."""


class _Sizes(NamedTuple):
    """The sizes :class:`SlidingWindowCache` and :class:`DynamicCache` are built from."""

    n_layer: int
    n_kv_head: int
    head_dim: int
    sliding_window: int | None


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
        self.n_layer, self.batch_size = len(self.windows), check_int("batch_size", batch_size)
        self.n_kv_head, self.head_dim = config.n_kv_head, config.head_dim
        self.dtype, self.device = dtype, torch.device(device)
        rings = [i for i, w in enumerate(self.windows) if w is not None]
        full = [i for i, w in enumerate(self.windows) if w is None]
        # layer i -> (ring part?, its index there)
        self._where = [(w is not None, (rings if w is not None else full).index(i))
                       for i, w in enumerate(self.windows)]
        self.window = self.windows[rings[0]] if rings else None
        self._ring = (SlidingWindowCache(_Sizes(len(rings), self.n_kv_head, self.head_dim,
                                                self.window), batch_size, dtype=dtype,
                                         device=device) if rings else None)
        self._full = (DynamicCache.empty(_Sizes(len(full), self.n_kv_head, self.head_dim, None),
                                         batch_size, dtype, device) if full else None)
        self._len = 0

    @property
    def seq_len(self) -> int:
        """Positions seen so far (the absolute position of the next token)."""
        return self._len

    def _part(self, layer_idx: int) -> tuple[KVCache, int]:
        if not 0 <= layer_idx < self.n_layer:
            raise ValueError(f"layer {layer_idx} is outside 0..{self.n_layer - 1}")
        ring, j = self._where[layer_idx]
        return (self._ring if ring else self._full), j

    def held(self, layer_idx: int | None = None) -> range:
        """The positions layer ``layer_idx`` holds: the last ``min(seq_len, W)`` for a window
        layer, all for a global one; None: the positions every layer holds."""
        if layer_idx is None:
            return self._ring.held() if self._ring is not None else range(self._len)
        part, _ = self._part(layer_idx)
        return part.held() if part is self._ring else range(self._len)

    def layer(self, idx: int) -> KV:
        part, j = self._part(idx)
        return part.layer(j)

    def begin(self) -> HybridCache:
        work = copy.copy(self)
        work._ring = None if self._ring is None else self._ring.begin()  # W rows a layer, cloned
        work._full = None if self._full is None else self._full.begin()  # a new list, same tensors
        return work

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        part, j = self._part(layer_idx)
        if start != self._len:
            raise ValueError(f"layer {layer_idx}: cache has seen {self._len} positions, "
                             f"write starts at {start}")
        return part.update(j, k, v, start)

    def finish(self, end: int) -> None:
        self._len = end
        if self._ring is not None:
            self._ring.finish(end)

    def tensors(self) -> list[torch.Tensor]:
        return [t for part in (self._ring, self._full) if part is not None
                for t in part.tensors()]

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
