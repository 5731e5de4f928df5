"""DeepSeek-V4's compressed caches: a window of K = V rows, entries of finished blocks, and the
rows of the unfinished block.

A layer of :mod:`kvdoc.core.v4` reads the last ``W`` positions' keys (K and V are one tensor, one
head shared by every query head) and, in its compressed layers, one entry per finished block of
``rate`` positions. An entry is a learned softmax-pooling of its block's rows (and, in a CSA
layer, of half of the block before it), so it exists only once the block's last position has been
seen: until then the cache holds the unfinished block's compressor inputs, the *buffer*, of
``T % rate`` rows. A CSA layer also keeps the half of the last finished block's rows that the
next entry pools (the *carry*, ``rate`` rows). What a :class:`CompressedLayer` holds after ``T``
positions, and so its bytes (:meth:`CompressedLayer.expected_nbytes`):

* the window: ``min(T, W)`` rows of width ``D`` (stored once: K = V);
* the entries: ``T // rate`` rows of width ``E`` (a CSA layer's keys and its indexer's keys);
* the buffer: ``T % rate`` rows of the compressor's inputs (width ``F``);
* the carry (CSA): ``rate`` rows of width ``F_carry`` once a block has finished.

A call's write (``KVCache.update``) stores the window rows and returns a :class:`Pending`: the
rows the new queries read, and the buffer plus the new rows from the first unfinished block on.
The attention pools the finished blocks among them (with the layer's weights) and hands the new
entries back with :meth:`CompressedLayer.append`. Nothing is written in place: a call works on a
fork, so the caller's cache keeps what it held.

>>> layer = CompressedLayer(batch_size=1, width=4, window=3, rate=2, features=6)
>>> p = layer.write(torch.ones(1, 1, 5, 4), torch.ones(1, 1, 5, 6), start=0)
>>> tuple(p.window.shape), tuple(p.rows.shape), p.first_block   # 2 finished blocks to pool
((1, 1, 5, 4), (1, 4, 6), 0)
>>> _ = layer.append(torch.zeros(1, 2, 4))
>>> layer.held(5), tuple(layer.buffer.shape)                    # position 4 waits in the buffer
(range(2, 5), (1, 1, 6))
>>> layer.nbytes() == layer.expected_nbytes(5) == 4 * (3 * 4 + 2 * 4 + 1 * 6)
True
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from .cache import CacheLayer, HasLayout, KVCache, check_int
from .window import slide


class Pending(NamedTuple):
    """What a write returns: ``window`` ``[B, 1, R, D]``, the K = V rows the new queries read (the
    last ``W - 1`` held, then the new ones); ``rows`` ``[B, n x rate, F]``, the compressor inputs
    of the ``n`` blocks the call finished, from block ``first_block`` on; ``carry``
    ``[B, rate, F_carry]`` (empty: none), what a CSA entry ``first_block`` pools of the block
    before it. A window-only layer returns ``rows`` and ``carry`` None."""

    window: torch.Tensor
    rows: torch.Tensor | None
    carry: torch.Tensor | None
    first_block: int


class CompressedLayer(CacheLayer):
    """One layer of a compressed cache (see the module docstring); ``rate`` None: a window-only
    layer (V4's sliding layers). ``features`` is ``F``, ``carry_width`` the first ``F_carry``
    columns of a row the next block's entry pools (0: HCA), ``entry_width`` ``E``.

    ``crop`` restores the buffer when it goes back within the unfinished block and the window
    has dropped nothing; a crop into a finished block is refused: its rows were pooled and
    dropped.
    """

    def __init__(self, batch_size: int, width: int, window: int, rate: int | None = None,
                 features: int = 0, carry_width: int = 0, entry_width: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(batch_size, 1, (width, width), dtype, device)
        self.window = check_int("window", window)
        self.rate = None if rate is None else check_int("rate", rate)
        self.features, self.carry_width = features, carry_width
        self.entry_width = width if entry_width is None else entry_width
        self.k = self._zeros(0)[0]  # [B, 1, rows, D]: the window, K and V alike
        if self.rate is not None:
            check_int("features", features)
            empty = {"dtype": dtype, "device": self.device}
            self.entries = torch.zeros(batch_size, 0, self.entry_width, **empty)
            self.buffer = torch.zeros(batch_size, 0, features, **empty)
            self.carry = torch.zeros(batch_size, 0, carry_width, **empty)

    def held(self, seq_len: int) -> range:
        return range(max(0, seq_len - self.window), seq_len)

    def read(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.k  # K = V

    def tensors(self) -> list[torch.Tensor]:
        if self.rate is None:
            return [self.k]
        return [self.k, self.entries, self.buffer, self.carry]

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> Pending:
        """Store the K = V rows ``k`` ``[B, 1, C, D]`` and the compressor inputs ``v``
        ``[B, 1, C, F]`` (ignored by a window-only layer) of positions ``start ..``."""
        B, C = self.batch_size, k.shape[2] if k.dim() == 4 else 0
        if k.dim() != 4 or tuple(k.shape) != (B, 1, C, self.widths[0]) or k.dtype != self.dtype:
            raise ValueError(f"new rows must be {self.dtype} [B, 1, C, D] with (B, D) = "
                             f"{(B, self.widths[0])}, got {k.dtype} {tuple(k.shape)}")
        full, self.k = slide(self.k, k, self.window)  # what the new queries read, what it keeps
        if self.rate is None:
            return Pending(full, None, None, 0)
        if tuple(v.shape) != (B, 1, C, self.features) or v.dtype != self.dtype:
            raise ValueError(f"compressor inputs must be {self.dtype} {(B, 1, C, self.features)}"
                             f", got {v.dtype} {tuple(v.shape)}")
        first_block = self.entries.shape[1]
        rows = torch.cat((self.buffer, v[:, 0]), dim=1)
        done = rows.shape[1] // self.rate * self.rate  # the rows of the blocks finished now
        carry = self.carry
        self.buffer = rows[:, done:]
        if done and self.carry_width:
            self.carry = rows[:, done - self.rate:done, :self.carry_width]
        return Pending(full, rows[:, :done], carry, first_block)

    def append(self, entries: torch.Tensor) -> torch.Tensor:
        """Add the entries ``[B, n, E]`` pooled from a write's finished blocks; returns all."""
        self.entries = torch.cat((self.entries, entries), dim=1)
        return self.entries

    def crop(self, length: int, seq_len: int) -> CompressedLayer:
        if length == seq_len:
            return copy.copy(self)
        if seq_len > self.window:
            raise ValueError(f"a window of {self.window} positions has dropped the ones before "
                             f"{seq_len - self.window}; it cannot go back to {length}")
        cropped = copy.copy(self)
        cropped.k = self.k[:, :, :length]
        if self.rate is not None:
            done = seq_len // self.rate * self.rate
            if length < done:
                raise ValueError(
                    f"positions {done - self.rate} .. {done - 1} were pooled into an entry and "
                    f"dropped; a cache of {seq_len} positions cannot go back to {length} (a "
                    f"compressed layer crops only within its unfinished block, {done} on)")
            cropped.buffer = self.buffer[:, :length - done]
        return cropped

    def expected_nbytes(self, seq_len: int) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        rows = min(seq_len, self.window) * self.widths[0]
        if self.rate is not None:
            blocks, left = divmod(seq_len, self.rate)
            carry = self.rate * self.carry_width if blocks else 0
            rows += blocks * self.entry_width + left * self.features + carry
        return self.batch_size * rows * size


def compressed_cache(config: HasLayout, batch_size: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> KVCache:
    """An empty cache of :class:`CompressedLayer` s for a model with ``config`` (a
    :class:`kvdoc.core.v4.CompressedConfig`: its ``layer_storage(i)`` sizes layer ``i``)."""
    return KVCache([CompressedLayer(batch_size, **config.layer_storage(i), dtype=dtype,
                                    device=device) for i in range(len(config.cache_layout))])
