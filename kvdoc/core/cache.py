"""The K/V cache: a list of per-layer storages (:mod:`kvdoc.core.layers`) and one length.

:class:`KVCache` keeps the transaction every kind shares; a layer only stores rows. A forward
call does ``work = cache.begin()``, then ``work.update(layer, k, v, start)`` once per layer, then
``work.finish(start + C)`` after the LM head, and returns ``work``:

* :meth:`KVCache.begin` gives each layer's :meth:`~kvdoc.core.layers.CacheLayer.fork`: a copy
  for a layer that grows or rings (the cache passed in is never modified), the layer itself for
  one written in place (rows from the length on only);
* the length advances only in :meth:`KVCache.finish`, so a call that fails midway leaves the
  cache as it was, in place or not.

The named kinds are this class with one kind of layer each: :class:`DynamicCache`
(:class:`~kvdoc.core.layers.DynamicLayer`) and :class:`StaticCache`
(:class:`~kvdoc.core.layers.StaticLayer`) here; a window ring, a hybrid of rings and growing
layers, latent (MLA) layers, int8 layers and paged layers in their own modules. K and V of layer
``l`` are ``[B, H_kv, T, D_h]``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from .config import GPTConfig, check_int
from .layers import KV, CacheLayer, DynamicLayer, StaticLayer

__all__ = ["KV", "DynamicCache", "KVCache", "StaticCache"]


class KVCache:
    """Layers and a length: ``layers[l]`` stores layer ``l``'s rows, ``seq_len`` positions count.

    Args:
        layers: one :class:`~kvdoc.core.layers.CacheLayer` per decoder layer, of one batch
            size, dtype and device.
        seq_len: positions they already hold.

    >>> cache = KVCache([DynamicLayer.empty(1, 2, (4, 4)), StaticLayer(1, 2, (4, 4), 8)])
    >>> work = cache.begin()
    >>> [tuple(work.update(i, *2 * (torch.ones(1, 2, 3, 4),), 0)[0].shape) for i in range(2)]
    [(1, 2, 3, 4), (1, 2, 3, 4)]
    >>> work.finish(3)
    >>> work.seq_len, cache.seq_len     # the caller's cache counts nothing the call wrote
    (3, 0)
    """

    def __init__(self, layers: Sequence[CacheLayer], seq_len: int = 0) -> None:
        if not layers:
            raise ValueError("a cache needs at least one layer")
        first = layers[0]
        for layer in layers:
            if (layer.batch_size, layer.dtype, layer.device) != (first.batch_size, first.dtype,
                                                                  first.device):
                raise ValueError("every layer must share one batch size, dtype and device")
        self.layers = layers
        self._len = check_int("seq_len", seq_len, minimum=0)
        self.n_layer, self.batch_size = len(self.layers), first.batch_size
        self.n_kv_head, self.head_dim = first.heads, first.widths[0]
        self.dtype, self.device = first.dtype, first.device

    @property
    def layers(self) -> list[CacheLayer]:
        """One storage per decoder layer (assign a new list to swap them: a broken variant)."""
        return self._layers

    @layers.setter
    def layers(self, layers: Sequence[CacheLayer]) -> None:
        self._layers = list(layers)
        # decided once, not at every call: a decode step of the site's model is ~100 us
        self._in_place = all(layer.in_place for layer in self._layers)
        bounds = [layer.capacity for layer in self._layers if hasattr(layer, "capacity")]
        self._capacity = min(bounds) if bounds else None

    @property
    def seq_len(self) -> int:
        """``T``: positions seen, which is also the absolute position of the next token."""
        return self._len

    def __len__(self) -> int:
        return self._len

    def _layer(self, idx: int) -> CacheLayer:
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < self.n_layer:
            raise ValueError(f"layer {idx!r} is outside 0..{self.n_layer - 1}")
        return self.layers[idx]

    def layer(self, idx: int) -> KV:
        """The rows layer ``idx`` holds (the positions :meth:`held`), in position order."""
        return self._layer(idx).read(self._len)

    def held(self, layer_idx: int | None = None) -> range:
        """The absolute positions whose rows :meth:`layer` returns for layer ``layer_idx``.

        All of them, ``range(seq_len)``, unless a layer drops old ones (a ring holds only the
        last ``W``); None answers for every layer at once: the positions they all hold.
        """
        if layer_idx is not None:
            return self._layer(layer_idx).held(self._len)
        return range(max(layer.held(self._len).start for layer in self.layers), self._len)

    def begin(self) -> KVCache:
        """The object one forward call writes into: this cache if every layer is written in
        place, else a copy whose layers are forks (the caller's cache then never changes)."""
        if self._in_place:
            return self
        work = copy.copy(self)
        work.layers = [layer.fork() for layer in self.layers]
        return work

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> KV:
        """Store new rows ``k, v`` (``[B, H_kv, C, D_h]``) at positions
        ``start .. start + C - 1``.

        Returns what the new queries attend over: the layer's rows up to
        ``start + C - 1``.
        """
        if not 0 <= layer_idx < self.n_layer:
            raise ValueError(f"layer {layer_idx!r} is outside 0..{self.n_layer - 1}")
        if start != self._len:
            raise ValueError(f"layer {layer_idx}: the cache holds {self._len} "
                             f"positions, write starts at {start}")
        return self._layers[layer_idx].write(k, v, start)

    def finish(self, end: int) -> None:
        """Count positions ``0 .. end - 1`` as held, once every layer has been updated."""
        self._len = end

    def crop(self, length: int) -> KVCache:
        """Forget every position from ``length`` on, in place; returns this cache.

        >>> from kvdoc import GPTConfig
        >>> cache = DynamicCache.empty(GPTConfig(), 1)
        >>> cache.crop(1)
        Traceback (most recent call last):
        ...
        ValueError: cannot crop a cache of 0 positions to 1
        """
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._len:
            raise ValueError(f"cannot crop a cache of {self._len} positions to {length!r}")
        self.layers = [layer.crop(length, self._len) for layer in self.layers]
        self._len = length
        return self

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache owns (for byte counts)."""
        return [t for layer in self.layers for t in layer.tensors()]

    def nbytes(self) -> int:
        """Bytes of the tensors the cache owns: ``sum(numel * element_size)``."""
        return sum(layer.nbytes() for layer in self.layers)

    @property
    def keeps_every_position(self) -> bool:
        """Whether every layer keeps every position (a ring does not, so it cannot roll back)."""
        return all(layer.keeps_every_position for layer in self.layers)

    @property
    def capacity(self) -> int | None:
        """The most positions every layer can take (None: no bound but the model's)."""
        return self._capacity

    def check_compatible(self, config: GPTConfig, batch_size: int, dtype: torch.dtype,
                         device: torch.device, new_len: int) -> None:
        """Raise ``ValueError`` unless ``new_len`` tokens of a model with ``config`` fit here."""
        expected = (config.n_layer, config.n_kv_head, config.head_dim)
        found = (self.n_layer, self.n_kv_head, self.head_dim)
        if found != expected:
            raise ValueError(
                "cache was built for another model: (layers, K/V heads, head size) = "
                f"{found}, model has {expected}")
        self.check_placement(batch_size, dtype, device)
        self.check_room(new_len)

    def check_room(self, new_len: int) -> None:
        """Raise ``ValueError`` unless ``new_len`` more positions fit the preallocated layers."""
        capacity = self.capacity
        if capacity is not None and self._len + new_len > capacity:
            raise ValueError(f"static cache over capacity: holds {self._len} of {capacity} "
                             f"positions, {new_len} more do not fit")

    def check_placement(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ``ValueError`` unless the input's batch size, dtype and device are the cache's."""
        if self.batch_size != batch_size:
            raise ValueError(f"cache holds batch size {self.batch_size}, "
                             f"input has batch size {batch_size}")
        if self.dtype != dtype:
            raise ValueError(f"cache dtype is {self.dtype}, model dtype is {dtype}")
        if self.device != device:  # both torch.device: every cache stores one
            raise ValueError(f"cache is on {self.device}, model is on {device}")


class DynamicCache(KVCache):
    """A cache of :class:`~kvdoc.core.layers.DynamicLayer` s: it grows by concatenation, and a
    forward call never modifies the object passed in.

    Args:
        layers: one ``(K, V)`` per layer, each ``[B, H_kv, T, D_h]`` with the same shape.

    >>> from kvdoc import GPTConfig
    >>> cache = DynamicCache.empty(GPTConfig(), batch_size=2)
    >>> cache.seq_len, tuple(cache.layer(0)[0].shape)
    (0, (2, 4, 0, 16))
    """

    def __init__(self, layers: list[KV]) -> None:
        if not layers:
            raise ValueError("a cache needs at least one layer")
        for k, v in layers:
            if k.dim() != 4 or k.shape != v.shape:
                raise ValueError("K and V must both be [B, H_kv, T, D_h], "
                                 f"got {tuple(k.shape)} and {tuple(v.shape)}")
        built = [DynamicLayer(k, v) for k, v in layers]
        if any(t.shape != layers[0][0].shape for kv in layers for t in kv):
            raise ValueError("every layer's K/V must have the same shape")
        super().__init__(built, seq_len=built[0].length)

    @classmethod
    def empty(cls, config: GPTConfig, batch_size: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> DynamicCache:
        """A cache with no positions yet, for a model with ``config``."""
        check_int("batch_size", batch_size)
        shape = (batch_size, config.n_kv_head, 0, config.head_dim)
        return cls([(torch.empty(shape, dtype=dtype, device=device),
                     torch.empty(shape, dtype=dtype, device=device))
                    for _ in range(config.n_layer)])


class StaticCache(KVCache):
    """A cache of :class:`~kvdoc.core.layers.StaticLayer` s: ``capacity`` preallocated positions,
    written in place at absolute positions; its length advances only when a whole call has
    succeeded, so what it holds below the write position never changes.

    Args:
        config: the model's configuration (layers, K/V heads, head size).
        batch_size: ``B``.
        capacity: the most positions it can hold (at most ``config.n_positions`` is useful).
        dtype, device: must match the model's.

    >>> from kvdoc import GPTConfig
    >>> cache = StaticCache(GPTConfig(), batch_size=1, capacity=8)
    >>> cache.seq_len, cache.capacity
    (0, 8)
    >>> # K and V x layers x B x H_kv x capacity x D_h x 4 bytes
    >>> cache.nbytes() == 2 * 2 * 1 * 4 * 8 * 16 * 4
    True
    """

    def __init__(self, config: GPTConfig, batch_size: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        widths = (config.head_dim, config.head_dim)
        super().__init__([StaticLayer(batch_size, config.n_kv_head, widths, capacity, dtype,
                                      device) for _ in range(config.n_layer)])
