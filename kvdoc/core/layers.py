"""One decoder layer's K/V storage: the parts a :class:`~kvdoc.core.cache.KVCache` is made of.

A cache is a list of layers and a length (:mod:`kvdoc.core.cache`); a layer knows how it stores
rows and nothing about the transaction around a forward call. Three ways to store them:

* :class:`DynamicLayer` grows by ``torch.cat``: a call's copy shares its tensors, since
  concatenation never writes into them.
* :class:`StaticLayer` preallocates ``capacity`` positions and writes new rows in place at their
  absolute positions.
* :class:`RingLayer` keeps the last ``W`` positions in ``W`` slots (position ``p`` in slot
  ``p mod W``), for a sliding-window layer; a call's copy clones the ``W`` rows.

A layer holds two tensors of one layout, ``[B, H, T, width]``: K and V of ``H_kv`` heads for
attention, or an MLA layer's latent ``c_KV`` and rotary key (one shared head, two widths, as
:mod:`kvdoc.core.mla` stores them). A new storage is one subclass: :meth:`CacheLayer.write`,
:meth:`CacheLayer.read` and :meth:`CacheLayer.tensors`, with :meth:`CacheLayer.fork`,
:meth:`CacheLayer.held` and :meth:`CacheLayer.crop` where the defaults do not hold.

>>> layer = RingLayer(batch_size=1, heads=2, widths=(4, 4), window=3)
>>> rows = torch.arange(5.0).view(1, 1, 5, 1).expand(1, 2, 5, 4)
>>> k, _ = layer.write(rows, rows, start=0)        # what the 5 new queries read, in order
>>> layer.held(5), layer.read(5)[0][0, 0, :, 0].tolist()   # the last 3 survive
(range(2, 5), [2.0, 3.0, 4.0])
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .config import check_int

KV = tuple[torch.Tensor, torch.Tensor]


class CacheLayer(ABC):
    """One layer's rows: two tensors ``[B, H, T, width]`` (K and V, or c_KV and k_rope).

    Args:
        batch_size: ``B``.
        heads: ``H``, the heads each tensor holds (``H_kv``, or 1 for a latent).
        widths: the last dimension of the first and the second tensor.
        dtype, device: of the rows it takes and returns.
    """

    in_place: ClassVar[bool] = False
    """Whether a call writes into this layer's own tensors (then :meth:`fork` returns it)."""
    keeps_every_position: ClassVar[bool] = True
    """False for a layer that drops old positions (a ring): it cannot be cropped once it has."""

    def __init__(self, batch_size: int, heads: int, widths: tuple[int, int],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.batch_size = check_int("batch_size", batch_size)
        self.heads = check_int("heads", heads)
        self.widths = (check_int("width", widths[0]), check_int("width", widths[1]))
        self.dtype, self.device = dtype, torch.device(device)

    def _zeros(self, length: int) -> list[torch.Tensor]:
        return [torch.zeros((self.batch_size, self.heads, length, w), dtype=self.dtype,
                            device=self.device) for w in self.widths]

    def check_rows(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``k``, ``v`` are new rows ``[B, H, C, width]`` of this
        layer's sizes and dtype."""
        ks, vs = k.shape, v.shape
        if (len(ks) != 4 or len(vs) != 4 or ks[0] != self.batch_size or ks[1] != self.heads
                or ks[3] != self.widths[0] or vs[:3] != ks[:3] or vs[3] != self.widths[1]):
            shapes = f"got {tuple(ks)} and {tuple(vs)}"
            if self.widths[0] == self.widths[1]:
                want = (self.batch_size, self.heads, self.widths[0])
                raise ValueError("K and V must both be [B, H_kv, C, D_h] with (B, H_kv, D_h) = "
                                 f"{want}, {shapes}")
            raise ValueError("c_KV and k_rope must be [B, 1, C, r] and [B, 1, C, d_R] with "
                             f"(B, r, d_R) = {(self.batch_size, *self.widths)}, {shapes}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"new rows must be {self.dtype}, got {k.dtype} and {v.dtype}")

    def held(self, seq_len: int) -> range:
        """The absolute positions :meth:`read` returns once the cache has seen ``seq_len``."""
        return range(seq_len)

    def fork(self) -> CacheLayer:
        """The layer one forward call writes into, leaving this one as it was (or this one,
        for a layer written in place, whose cache commits its length only at the end)."""
        return self if self.in_place else copy.copy(self)

    @abstractmethod
    def read(self, seq_len: int) -> KV:
        """The rows of the positions :meth:`held` ``(seq_len)``, in position order."""

    @abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        """Store rows ``[B, H, C, width]`` at positions ``start ..``; returns what the ``C`` new
        queries attend over: the held rows up to ``start + C - 1``, in position order."""

    def crop(self, length: int, seq_len: int) -> CacheLayer:
        """This layer with only positions ``0 .. length - 1`` of the ``seq_len`` it has seen."""
        raise ValueError(f"a {type(self).__name__} cannot be cropped")

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer owns."""

    def nbytes(self) -> int:
        """Bytes of :meth:`tensors`: ``sum(numel x element size)``."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


class DynamicLayer(CacheLayer):
    """Rows grown by concatenation: ``k`` and ``v`` are the whole history, ``[B, H, T, width]``.

    >>> layer = DynamicLayer.empty(batch_size=1, heads=2, widths=(3, 5))
    >>> k, v = layer.write(torch.ones(1, 2, 4, 3), torch.ones(1, 2, 4, 5), start=0)
    >>> tuple(v.shape), layer.nbytes() == 4 * (2 * 4 * 3 + 2 * 4 * 5)
    ((1, 2, 4, 5), True)
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError("K and V must both be [B, H, T, width] with the same B, H and T, "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError("K and V must share dtype and device")
        super().__init__(k.shape[0], k.shape[1], (k.shape[3], v.shape[3]), k.dtype, k.device)
        self.k, self.v = k, v

    @classmethod
    def empty(cls, batch_size: int, heads: int, widths: tuple[int, int],
              dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> DynamicLayer:
        """A layer of no positions."""
        check_int("batch_size", batch_size)
        k, v = (torch.empty((batch_size, heads, 0, w), dtype=dtype, device=device)
                for w in widths)
        return cls(k, v)

    @property
    def length(self) -> int:
        """Positions its tensors hold."""
        return self.k.shape[2]

    def read(self, seq_len: int) -> KV:
        return self.k, self.v

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        if start != self.length:
            raise ValueError(f"the layer holds {self.length} positions, "
                             f"write starts at {start}")
        # old rows first, then the new ones: [B, H, P + C, width]
        self.k, self.v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def crop(self, length: int, seq_len: int) -> DynamicLayer:
        return DynamicLayer(self.k[:, :, :length], self.v[:, :, :length])

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class StaticLayer(CacheLayer):
    """``capacity`` preallocated positions, written in place at absolute positions.

    What it holds below the write position never changes; how much of it counts is the cache's
    length, committed when the whole call has succeeded.

    >>> layer = StaticLayer(batch_size=1, heads=2, widths=(4, 4), capacity=8)
    >>> k, _ = layer.write(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), start=0)
    >>> k.shape[2], layer.nbytes() == 2 * 2 * 8 * 4 * 4     # K, V x H x capacity x width x 4
    (3, True)
    """

    in_place = True

    def __init__(self, batch_size: int, heads: int, widths: tuple[int, int], capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(batch_size, heads, widths, dtype, device)
        self.capacity = check_int("capacity", capacity)
        self.k, self.v = self._zeros(capacity)

    def read(self, seq_len: int) -> KV:
        return self.k[:, :, :seq_len], self.v[:, :, :seq_len]

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"cannot write positions {start}..{end - 1}: "
                             f"the layer has {self.capacity} slots")
        self.k.narrow(2, start, end - start).copy_(k)  # in place, at absolute positions
        self.v.narrow(2, start, end - start).copy_(v)
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end)

    def crop(self, length: int, seq_len: int) -> StaticLayer:
        return self  # the rows past the new length are written over by the next call

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class RingLayer(CacheLayer):
    """The last ``window`` positions in ``window`` slots: position ``p`` in slot ``p mod W``.

    With a window of ``W`` keys, query ``i`` reads keys ``i - W < j <= i`` (see
    :mod:`kvdoc.core.mask`), so no later query reads a key older than ``i - W + 1`` and the
    layer's memory stops at ``W`` positions. :meth:`write` returns the keys the new queries may
    read in position order (the last ``W - 1`` held, then the new rows): a contiguous run ending
    at the last new token, so attention knows each key's position from the count alone.
    """

    keeps_every_position = False

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

    def _ordered(self, ring: torch.Tensor, seq_len: int) -> torch.Tensor:
        if seq_len <= self.window:
            return ring[:, :, :seq_len]
        oldest = seq_len % self.window  # the slot the next position would overwrite
        return torch.cat((ring[:, :, oldest:], ring[:, :, :oldest]), dim=2)

    def read(self, seq_len: int) -> KV:
        return self._ordered(self.k, seq_len), self._ordered(self.v, seq_len)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        old_k, old_v = self.read(start)
        keep = min(self.window - 1, old_k.shape[2])  # query `start` reads W - 1 old keys
        full_k = torch.cat((old_k[:, :, old_k.shape[2] - keep:], k), dim=2)
        full_v = torch.cat((old_v[:, :, old_v.shape[2] - keep:], v), dim=2)
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
