"""Sliding-window storage: the last ``W`` positions of a layer, and the cache for a model.

With a window of ``W`` keys, query ``i`` reads keys ``i - W < j <= i``
(:func:`~kvdoc.core.cache.offset_causal_mask`): no query from position ``i`` on reads a key
older than ``i - W + 1``, so a :class:`WindowLayer` keeps the last ``W`` rows and drops the
rest. :func:`window_cache` gives each window layer one and each global layer (Gemma 2 and 3
alternate them) a growing :class:`~kvdoc.core.cache.DynamicLayer`.

>>> from kvdoc.core.gemma import Gemma3Config
>>> cache = window_cache(Gemma3Config(sliding_window=4), batch_size=1)  # layer 1 is global
>>> k = torch.zeros(1, 2, 6, 16)                      # 6 new positions, [B, H_kv, C, D_h]
>>> work = cache.begin()
>>> [tuple(work.update(i, k, k, 0)[0].shape) for i in range(2)]   # what the queries read
[(1, 2, 6, 16), (1, 2, 6, 16)]
>>> work.finish(6)
>>> work.held(0), work.held(1), cache.seq_len       # the window keeps 4; the caller's is untouched
(range(2, 6), range(0, 6), 0)
>>> work.nbytes() == 2 * 1 * 2 * 16 * 4 * (4 + 6)    # K and V x B x H_kv x D_h x 4 bytes x rows
True
"""

from __future__ import annotations

import torch

from .cache import KV, CacheLayer, DynamicLayer, HasLayout, KVCache, check_int


def slide(old: torch.Tensor, new: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the ``new`` queries read (``old``'s last ``window - 1``, then ``new``) and the
    last ``window`` of them, to keep (dimension 2: the positions)."""
    past = old.narrow(2, max(0, old.shape[2] - window + 1), min(old.shape[2], window - 1))
    full = torch.cat((past, new), dim=2)  # the one copy of the call
    kept = full[:, :, -window:]
    # a view keeps the whole concatenation alive: past 2W rows (a long chunk), copy it out
    return full, kept.clone() if full.shape[2] > 2 * window else kept


class WindowLayer(CacheLayer):
    """The last ``window`` positions, in order, ``[B, H, min(T, W), width]``.

    A call concatenates the ``W - 1`` rows its first query reads to the new ones, once: the
    attention reads that concatenation (a run of positions ending at the last new token, so the
    mask follows from the count) and the layer keeps a view of its last ``W`` rows. Nothing is
    written in place, so the cache passed in keeps its rows (as transformers 5.24's
    ``DynamicSlidingWindowLayer``, which keeps ``W - 1``).

    >>> layer = WindowLayer.empty(batch_size=1, heads=2, widths=(4, 4), window=3)
    >>> rows = torch.arange(5.0).view(1, 1, 5, 1).expand(1, 2, 5, 4)
    >>> k, _ = layer.write(rows, rows, start=0)        # what the 5 new queries read, in order
    >>> layer.held(5), layer.read(5)[0][0, 0, :, 0].tolist()   # the last 3 survive
    (range(2, 5), [2.0, 3.0, 4.0])
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, window: int) -> None:
        super().__init__(k.shape[0], k.shape[1], (k.shape[3], v.shape[3]), k.dtype, k.device)
        self.window = check_int("window", window)
        self.k, self.v = k, v

    @classmethod
    def empty(cls, batch_size: int, heads: int, widths: tuple[int, int], window: int,
              dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> WindowLayer:
        return cls(*DynamicLayer.empty(batch_size, heads, widths, dtype, device).tensors(),
                   window=window)

    def held(self, seq_len: int) -> range:
        return range(max(0, seq_len - self.window), seq_len)

    def read(self, seq_len: int) -> KV:
        return self.k, self.v

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        full_k, self.k = slide(self.k, k, self.window)
        full_v, self.v = slide(self.v, v, self.window)
        return full_k, full_v

    def crop(self, length: int, seq_len: int) -> WindowLayer:
        if length != seq_len and seq_len > self.window:
            raise ValueError(f"a window of {self.window} positions has dropped the ones before "
                             f"{seq_len - self.window}; it cannot go back to {length}")
        return WindowLayer(self.k[:, :, :length], self.v[:, :, :length], self.window)

    def expected_nbytes(self, seq_len: int) -> int:
        return self.row_bytes(min(seq_len, self.window))


def window_cache(config: HasLayout, batch_size: int, window: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> KVCache:
    """An empty cache for a model with ``config``: a :class:`WindowLayer` of ``window``
    positions (default: the layer's own window) for each window layer, a growing layer for each
    global one.

    >>> from kvdoc.core.model import mistral_config
    >>> [layer.window for layer in window_cache(mistral_config(sliding_window=4), 1).layers]
    [4, 4]
    """
    return KVCache([
        DynamicLayer.empty(batch_size, s.heads, s.widths, dtype, device) if s.window is None
        else WindowLayer.empty(batch_size, s.heads, s.widths,
                               s.window if window is None else window, dtype, device)
        for s in config.cache_layout])
