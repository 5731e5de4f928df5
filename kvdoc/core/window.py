"""A sliding-window K/V cache: a ring buffer of ``W`` positions per layer, ``[B, H_kv, W, D_h]``.

With a window of ``W`` keys, query ``i`` reads keys ``i - W < j <= i`` (see :mod:`kvdoc.core.mask`),
so no query from position ``i`` on ever reads a key older than ``i - W + 1``. The cache keeps
the last ``W`` positions only: position ``p`` lands in slot ``p mod W`` and overwrites position
``p - W``. Its memory stops growing at ``W`` positions, however long the stream.

:meth:`SlidingWindowCache.update` returns the keys a chunk of new queries may read, *in position
order*: the last ``W - 1`` held positions followed by the new rows. They are always a contiguous
run of positions ending at the last new token, so the attention knows which position each
returned key holds from its count alone, and slices the last columns of the offset mask.
Like :class:`~kvdoc.core.cache.DynamicCache`, a forward call works on a copy (:meth:`begin`), so the
cache passed in is never modified.
"""

from __future__ import annotations

import copy

import torch

from .cache import KV, KVCache
from .config import GPTConfig, check_int


class SlidingWindowCache(KVCache):
    """The last ``window`` positions of every layer, stored as a ring buffer.

    Args:
        config: the model's configuration (layers, K/V heads, head size).
        batch_size: ``B``.
        window: ring capacity ``W`` (default ``config.sliding_window``); at least the model's
            window.
        dtype, device: must match the model's.

    >>> from kvdoc.core.config import mistral_config
    >>> cache = SlidingWindowCache(mistral_config(sliding_window=4), batch_size=1)
    >>> cache.window, cache.slot(9), cache.held()
    (4, 1, range(0, 0))
    >>> # K and V x layers x B x H_kv x W x D_h x 4 bytes
    >>> cache.nbytes() == 2 * 2 * 1 * 2 * 4 * 16 * 4
    True
    """

    def __init__(self, config: GPTConfig, batch_size: int, window: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        window = config.sliding_window if window is None else window
        if window is None:
            raise ValueError("a sliding-window cache needs a window: "
                             "the config has sliding_window=None")
        self.window = check_int("window", window)
        self._preallocate(config, batch_size, window, dtype, device)  # the ring: W slots

    @property
    def seq_len(self) -> int:
        """Positions seen so far (the absolute position of the next token), not positions held."""
        return self._len

    def slot(self, position: int) -> int:
        """The ring slot that holds ``position``: ``position mod W``."""
        return position % self.window

    def held(self, layer_idx: int | None = None) -> range:
        """The absolute positions the cache holds, in every layer: the last ``min(seq_len, W)``."""
        return range(max(0, self._len - self.window), self._len)

    def _ordered(self, ring: torch.Tensor) -> torch.Tensor:
        """The ring's rows in position order: ``[B, H_kv, len(held()), D_h]``."""
        if self._len <= self.window:
            return ring[:, :, : self._len]
        oldest = self.slot(self._len)  # the slot the next position would overwrite
        return torch.cat((ring[:, :, oldest:], ring[:, :, :oldest]), dim=2)

    def layer(self, idx: int) -> KV:
        """``(K, V)`` of layer ``idx`` for the positions :meth:`held`, in position order."""
        return self._ordered(self._k[idx]), self._ordered(self._v[idx])

    def begin(self) -> SlidingWindowCache:
        work = copy.copy(self)
        # W rows per layer: copying them keeps the caller's cache intact
        work._k = [t.clone() for t in self._k]
        work._v = [t.clone() for t in self._v]
        return work

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        if start != self._len:
            raise ValueError(f"layer {layer_idx}: cache has seen {self._len} positions, "
                             f"write starts at {start}")
        old_k, old_v = self.layer(layer_idx)
        # query `start` reads keys start - W + 1 .. start: W - 1 of them are old
        keep = self.window - 1
        full_k = torch.cat((old_k[:, :, old_k.shape[2] - min(keep, old_k.shape[2]):], k), dim=2)
        full_v = torch.cat((old_v[:, :, old_v.shape[2] - min(keep, old_v.shape[2]):], v), dim=2)
        C = k.shape[2]
        last = min(C, self.window)  # of a long chunk only its last W rows survive
        kept = range(start + C - last, start + C)
        slots = torch.tensor([self.slot(p) for p in kept], device=k.device)
        self._k[layer_idx].index_copy_(2, slots, k[:, :, C - last:])
        self._v[layer_idx].index_copy_(2, slots, v[:, :, C - last:])
        return full_k, full_v  # positions start + C - len .. start + C - 1, in order

    def finish(self, end: int) -> None:
        self._len = end

    def tensors(self) -> list[torch.Tensor]:
        return [*self._k, *self._v]

    def check_compatible(self, config: GPTConfig, batch_size: int, dtype: torch.dtype,
                         device: torch.device, new_len: int) -> None:
        super().check_compatible(config, batch_size, dtype, device, new_len)
        if config.sliding_window is None or config.sliding_window > self.window:
            raise ValueError(f"a ring of {self.window} positions cannot serve a model with "
                             f"sliding_window={config.sliding_window}: "
                             "it would drop keys the model reads")
