"""Per-layer K/V caches: one ``(K, V)`` pair per decoder layer, layout ``[B, H_kv, T, D_h]``.

Two storage strategies sit behind one interface, and the attention code calls both the same
way (:meth:`KVCache.update` with the absolute start position of the new rows):

* :class:`DynamicCache` grows by ``torch.cat``. A forward call works on a shallow copy
  (:meth:`KVCache.begin`), so the cache object passed in is never modified.
* :class:`StaticCache` preallocates ``capacity`` positions and writes new rows in place at
  their absolute positions; its length advances only when the whole call has succeeded, so
  what it holds below the write position never changes.

A forward call does ``work = cache.begin()``, then ``work.update(layer, k, v, start)`` once
per layer, then ``work.finish(start + C)``, and returns ``work``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .config import GPTConfig, check_int

KV = tuple[torch.Tensor, torch.Tensor]


class KVCache(ABC):
    """What every cache offers. ``K`` and ``V`` of layer ``l`` are ``[B, H_kv, T, D_h]``."""

    n_layer: int
    batch_size: int
    n_kv_head: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """``T``: positions held, which is also the absolute position of the next token."""

    def __len__(self) -> int:
        return self.seq_len

    @abstractmethod
    def layer(self, idx: int) -> KV:
        """The filled ``(K, V)`` of layer ``idx``, each ``[B, H_kv, T, D_h]``."""

    def held(self, layer_idx: int | None = None) -> range:
        """The absolute positions whose K/V :meth:`layer` returns for layer ``layer_idx``.

        All of them, ``range(seq_len)``, unless the cache drops old ones: a sliding-window
        cache (:mod:`kvdoc.core.window`) holds only the last ``W``, and this says which. The
        same for every layer, except in a hybrid cache (:mod:`kvdoc.core.hybrid`), whose window
        layers hold fewer than its global ones; None answers for every layer at once (the
        positions each of them holds).
        """
        return range(self.seq_len)

    def begin(self) -> KVCache:
        """The object one forward call writes into: the cache itself, for a cache written in place.

        A cache that a call must leave unchanged (:class:`DynamicCache`) returns a copy instead.
        """
        return self

    @abstractmethod
    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        """Store new rows ``k, v`` (``[B, H_kv, C, D_h]``) at positions ``start .. start + C - 1``.

        Returns the layer's K and V over positions ``0 .. start + C - 1`` to attend over.
        """

    def finish(self, end: int) -> None:  # noqa: B027 (an optional hook, deliberately a no-op)
        """Mark positions ``0 .. end - 1`` as held, once every layer has been updated.

        Nothing to do for a cache whose length is its tensors' length; a preallocated cache
        advances its length here, so a call that fails midway leaves it as it was.
        """

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache owns (for byte counts)."""

    def nbytes(self) -> int:
        """Bytes of the tensors the cache owns: ``sum(numel * element_size)``."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _preallocate(self, config: GPTConfig, batch_size: int, length: int,
                     dtype: torch.dtype, device: torch.device | str) -> None:
        """For caches written in place: zeroed K and V of ``length`` positions per layer
        (``self._k``, ``self._v``), nothing held yet, and the sizes every cache states."""
        self.n_layer, self.batch_size = config.n_layer, check_int("batch_size", batch_size)
        self.n_kv_head, self.head_dim = config.n_kv_head, config.head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (batch_size, config.n_kv_head, length, config.head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self._len = 0

    def check_rows(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``k`` and ``v`` are new rows for this cache:
        ``[B, H_kv, C, D_h]`` with its ``B``, ``H_kv``, ``D_h`` and dtype."""
        expected = (self.batch_size, self.n_kv_head, self.head_dim)
        if k.dim() != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != expected:
            raise ValueError("K and V must both be [B, H_kv, C, D_h] with (B, H_kv, D_h) = "
                             f"{expected}, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"K and V must be {self.dtype}, got {k.dtype} and {v.dtype}")

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

    def check_placement(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ``ValueError`` unless the input's batch size, dtype and device are the cache's."""
        if self.batch_size != batch_size:
            raise ValueError(f"cache holds batch size {self.batch_size}, "
                             f"input has batch size {batch_size}")
        if self.dtype != dtype:
            raise ValueError(f"cache dtype is {self.dtype}, model dtype is {dtype}")
        if self.device != device:  # both torch.device: every cache stores one
            raise ValueError(f"cache is on {self.device}, model is on {device}")


def _check_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError("K and V must both be [B, H_kv, T, D_h], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype or k.device != v.device:
        raise ValueError("K and V must share dtype and device")


class DynamicCache(KVCache):
    """A cache that grows by concatenation; a forward call never modifies the object passed in.

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
            _check_kv(k, v)
            if k.shape != layers[0][0].shape:
                raise ValueError("every layer's K/V must have the same shape")
        self._kv: list[KV] = list(layers)
        k0 = layers[0][0]
        self.n_layer = len(layers)
        self.batch_size, self.n_kv_head, _, self.head_dim = k0.shape
        self.dtype, self.device = k0.dtype, k0.device

    @classmethod
    def empty(cls, config: GPTConfig, batch_size: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> DynamicCache:
        """A cache with no positions yet, for a model with ``config``."""
        check_int("batch_size", batch_size)
        shape = (batch_size, config.n_kv_head, 0, config.head_dim)
        layers = [(torch.empty(shape, dtype=dtype, device=device),
                   torch.empty(shape, dtype=dtype, device=device)) for _ in range(config.n_layer)]
        return cls(layers)

    @property
    def seq_len(self) -> int:
        return self._kv[0][0].shape[2]

    def layer(self, idx: int) -> KV:
        return self._kv[idx]

    def begin(self) -> DynamicCache:
        return DynamicCache(self._kv)  # a new list of the same tensors; cat never touches them

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> KV:
        self.check_rows(k, v)
        past_k, past_v = self._kv[layer_idx]
        if past_k.shape[2] != start:
            raise ValueError(f"layer {layer_idx} holds {past_k.shape[2]} positions, "
                             f"write starts at {start}")
        # old rows first, then the new ones: [B, H_kv, P + C, D_h]
        kv = (torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2))
        self._kv[layer_idx] = kv
        return kv

    def crop(self, length: int) -> DynamicCache:
        """A new cache of the first ``length`` positions (e.g. the common prefix after an edit)."""
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot crop a cache of {self.seq_len} positions to {length}")
        return DynamicCache([(k[:, :, :length], v[:, :, :length]) for k, v in self._kv])

    def tensors(self) -> list[torch.Tensor]:
        return [t for kv in self._kv for t in kv]


class StaticCache(KVCache):
    """A preallocated cache of ``capacity`` positions, written in place at absolute positions.

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
        self.capacity = check_int("capacity", capacity)
        self._preallocate(config, batch_size, capacity, dtype, device)

    @property
    def seq_len(self) -> int:
        return self._len

    def layer(self, idx: int) -> KV:
        return self._k[idx][:, :, : self._len], self._v[idx][:, :, : self._len]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> KV:
        self.check_rows(k, v)
        end = start + k.shape[2]
        if start != self._len or end > self.capacity:
            raise ValueError(f"cannot write positions {start}..{end - 1}: cache holds "
                             f"{self._len} of {self.capacity}")
        k_all, v_all = self._k[layer_idx], self._v[layer_idx]
        k_all.narrow(2, start, end - start).copy_(k)  # in place, at absolute positions
        v_all.narrow(2, start, end - start).copy_(v)
        return k_all.narrow(2, 0, end), v_all.narrow(2, 0, end)

    def finish(self, end: int) -> None:
        self._len = end

    def crop(self, length: int) -> StaticCache:
        """Forget every position from ``length`` on, in place; returns ``self``."""
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot crop a cache of {self._len} positions to {length}")
        self._len = length
        return self

    def check_compatible(self, config: GPTConfig, batch_size: int, dtype: torch.dtype,
                         device: torch.device, new_len: int) -> None:
        super().check_compatible(config, batch_size, dtype, device, new_len)
        if self._len + new_len > self.capacity:
            raise ValueError(f"static cache over capacity: holds {self._len} of {self.capacity} "
                             f"positions, {new_len} more do not fit")

    def tensors(self) -> list[torch.Tensor]:
        return [*self._k, *self._v]

