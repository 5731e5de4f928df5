"""Sliding-window storage: a ring of ``W`` slots per layer, and the cache of rings for a model.

With a window of ``W`` keys, query ``i`` reads keys ``i - W < j <= i``
(:func:`~kvdoc.core.model.offset_causal_mask`), so no query from position ``i`` on reads a key
older than ``i - W + 1``: a :class:`RingLayer` keeps position ``p`` in slot ``p mod W``,
overwriting position ``p - W``, and its memory stops at ``W`` positions. :func:`window_cache`
gives each window layer of a model a ring and each global layer (Gemma 2 and 3 alternate them)
a growing :class:`~kvdoc.core.cache.DynamicLayer`. A forward call works on a copy, so the
cache passed in is never modified.

>>> from kvdoc.core.gemma import Gemma3Config
>>> cache = window_cache(Gemma3Config(sliding_window=4), batch_size=1)  # layer 1 is global
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

import torch

from .cache import KV, CacheLayer, DynamicLayer, HasLayout, KVCache, check_int


class RingLayer(CacheLayer):
    """The last ``window`` positions in ``window`` slots: position ``p`` in slot ``p mod W``.

    :meth:`write` returns the keys the new queries may read in position order (the last
    ``W - 1`` held, then the new rows): a contiguous run ending at the last new token, so
    attention knows each key's position from the count alone. A call writes into a copy of
    the ring (:meth:`fork`), so the cache passed in keeps its rows.

    >>> layer = RingLayer(batch_size=1, heads=2, widths=(4, 4), window=3)
    >>> rows = torch.arange(5.0).view(1, 1, 5, 1).expand(1, 2, 5, 4)
    >>> k, _ = layer.write(rows, rows, start=0)        # what the 5 new queries read, in order
    >>> layer.held(5), layer.read(5)[0][0, 0, :, 0].tolist()   # the last 3 survive
    (range(2, 5), [2.0, 3.0, 4.0])
    """

    def __init__(self, batch_size: int, heads: int, widths: tuple[int, int], window: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(batch_size, heads, widths, dtype, device)
        self.window = check_int("window", window)
        self.k, self.v = self._zeros(window)

    def held(self, seq_len: int) -> range:
        return range(max(0, seq_len - self.window), seq_len)

    def fork(self) -> RingLayer:
        work = copy.copy(self)
        work.k, work.v = self.k.clone(), self.v.clone()  # W rows: the caller's stay intact
        return work

    def _ordered(self, ring: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
        """The last ``count`` (at most ``W``) of ``seq_len`` positions, in order."""
        count = min(count, seq_len, self.window)
        lo, hi = (seq_len - count) % self.window, (seq_len - 1) % self.window + 1
        if count == 0 or lo < hi:
            return ring[:, :, lo:lo + count]
        return torch.cat((ring[:, :, lo:], ring[:, :, :hi]), dim=2)

    def read(self, seq_len: int) -> KV:
        return (self._ordered(self.k, seq_len, self.window),
                self._ordered(self.v, seq_len, self.window))

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        keep = self.window - 1  # query `start` reads the W - 1 keys before it
        full_k = torch.cat((self._ordered(self.k, start, keep), k), dim=2)
        full_v = torch.cat((self._ordered(self.v, start, keep), v), dim=2)
        C = k.shape[2]
        last = min(C, self.window)  # of a long chunk only its last W rows survive
        slots = torch.arange(start + C - last, start + C, device=k.device) % self.window
        self.k.index_copy_(2, slots, k[:, :, C - last:])
        self.v.index_copy_(2, slots, v[:, :, C - last:])
        return full_k, full_v

    def crop(self, length: int, seq_len: int) -> RingLayer:
        if length != seq_len and seq_len > self.window:
            raise ValueError(f"a ring of {self.window} slots has written positions {length}.."
                             f"{seq_len - 1} over the ones before {length}; it cannot go back")
        return self.fork()

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


def window_cache(config: HasLayout, batch_size: int, window: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> KVCache:
    """An empty cache of rings for a model with ``config``: a :class:`RingLayer` of ``window``
    slots (default: the layer's own window) for each window layer, a growing layer for each
    global one.

    >>> from kvdoc.core.model import GPTConfig, mistral_config
    >>> [layer.window for layer in window_cache(mistral_config(sliding_window=4), 1).layers]
    [4, 4]
    """
    layout = config.cache_layout
    return KVCache([
        DynamicLayer.empty(batch_size, s.heads, s.widths, dtype, device) if s.window is None
        else RingLayer(batch_size, s.heads, s.widths, s.window if window is None else window,
                  dtype, device)
        for s in layout])
