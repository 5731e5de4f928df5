"""A sliding-window K/V cache: a ring of ``W`` slots per layer, ``[B, H_kv, W, D_h]``.

With a window of ``W`` keys, query ``i`` reads keys ``i - W < j <= i`` (see :mod:`kvdoc.core.mask`),
so no query from position ``i`` on ever reads a key older than ``i - W + 1``. Each layer is a
:class:`~kvdoc.core.layers.RingLayer`: position ``p`` lands in slot ``p mod W`` and overwrites
position ``p - W``, so memory stops growing at ``W`` positions, however long the stream.

``update`` returns the keys a chunk of new queries may read, *in position order*: the last
``W - 1`` held positions followed by the new rows. They are always a contiguous run of positions
ending at the last new token, so the attention knows which position each returned key holds from
its count alone, and slices the last columns of the offset mask. Like
:class:`~kvdoc.core.cache.DynamicCache`, a forward call works on a copy (``begin``), so the cache
passed in is never modified.
"""

from __future__ import annotations

import torch

from .cache import KVCache
from .config import GPTConfig
from .layers import RingLayer


class SlidingWindowCache(KVCache):
    """The last ``window`` positions of every layer, each layer a ring of ``window`` slots.

    Args:
        config: the model's configuration (layers, K/V heads, head size).
        batch_size: ``B``.
        window: ring capacity ``W`` (default ``config.sliding_window``); at least the model's
            window.
        dtype, device: must match the model's.

    >>> from kvdoc.core.config import mistral_config
    >>> cache = SlidingWindowCache(mistral_config(sliding_window=4), batch_size=1)
    >>> cache.window, cache.held()
    (4, range(0, 0))
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
        widths = (config.head_dim, config.head_dim)
        super().__init__([RingLayer(batch_size, config.n_kv_head, widths, window, dtype, device)
                          for _ in range(config.n_layer)])
        self.window = window

    def check_compatible(self, config: GPTConfig, batch_size: int, dtype: torch.dtype,
                         device: torch.device, new_len: int) -> None:
        super().check_compatible(config, batch_size, dtype, device, new_len)
        if config.sliding_window is None or config.sliding_window > self.window:
            raise ValueError(f"a ring of {self.window} positions cannot serve a model with "
                             f"sliding_window={config.sliding_window}: "
                             "it would drop keys the model reads")
