"""The K/V cache: which keys a query reads, what each layer keeps, whether it serves a model.

Half of the copy set (with :mod:`kvdoc.core.model`). A call writes into ``cache.begin()`` layer
by layer and counts its positions in ``finish`` after the LM head, so a call that fails midway
leaves the cache as it was. A kind of cache is a choice of layers, checked against the config's
``cache_layout``; K and V are ``[B, H_kv, T, D_h]`` (an MLA latent: one head of two widths).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

KV = tuple[torch.Tensor, torch.Tensor]


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``, else a ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


def check_positive(name: str, value: object) -> object:
    """``value``, if it is a positive number; else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return value


def offset_causal_mask(past_len: int, new_len: int, device: torch.device | str | None = None,
                       *, window: int | None = None) -> torch.Tensor:
    """``[C, P + C]`` bool: may new query ``i`` (at ``P + i``) read key ``j``? ``j <= P + i``,
    and ``j > P + i - W`` with a window ``W``. PyTorch's ``is_causal=True`` (and ``torch.tril``)
    align the triangle top-left, as if ``P = 0``: one new token would read key 0 only.

    >>> offset_causal_mask(2, 2).int()
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    check_int("past_len", past_len, minimum=0)
    check_int("new_len", new_len)
    query_pos = past_len + torch.arange(new_len, device=device)  # absolute positions
    key_pos = torch.arange(past_len + new_len, device=device)
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - check_int("window", window)
    return allowed


def last_keys(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """``mask`` (``[..., C, T]``, True: may read) with each query reading only the last
    ``window`` of its readable keys: they run up to its own position, whatever the columns."""
    if window is None:
        return mask
    from_right = mask.flip(-1).cumsum(-1).flip(-1)  # readable keys at or after each column
    return mask & (from_right <= window)


class LayerSpec(NamedTuple):
    """One layer's ``heads`` x two tensors of ``widths``; its queries read ``window`` keys
    (None: every earlier key)."""

    heads: int
    widths: tuple[int, int]
    window: int | None = None


class HasLayout(Protocol):  # a model's config, as far as a cache needs it
    n_positions: int
    cache_layout: tuple[LayerSpec, ...]


class CacheLayer:
    """One layer's rows: two tensors ``[B, H, T, width]`` (K and V, or c_KV and k_rope). A kind
    defines ``write(k, v, start)`` (store rows ``[B, H, C, width]`` at ``start ..``, return what
    the new queries attend over, in position order) and ``read(seq_len)`` (the rows of
    :meth:`held`); the other methods are defaults it may override."""

    in_place = False  # a call writes into this layer's own tensors (then fork returns it)
    window: int | None = None  # the positions a window layer keeps (None: all it is given)
    capacity: int | None = None  # the most positions it can take (None: no bound)

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
        """Raise ``ValueError`` unless ``k``, ``v`` are rows ``[B, H, C, width]`` of this layer."""
        want = (self.batch_size, self.heads, *self.widths)
        if (k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]
                or (*k.shape[:2], k.shape[3], v.shape[3]) != want):
            raise ValueError(f"new rows must be [B, H, C, width] with (B, H, width of K, width of "
                             f"V) = {want}, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"new rows must be {self.dtype}, got {k.dtype} and {v.dtype}")

    def held(self, seq_len: int) -> range:
        """The absolute positions :meth:`read` returns once the cache has seen ``seq_len``."""
        return range(seq_len)

    def fork(self) -> CacheLayer:
        """A layer one call writes into, leaving this one as it was."""
        return self if self.in_place else copy.copy(self)

    def crop(self, length: int, seq_len: int) -> CacheLayer:
        """This layer with only positions ``0 .. length - 1`` of the ``seq_len`` it has seen."""
        raise ValueError(f"a {type(self).__name__} cannot be cropped")

    def tensors(self) -> list[torch.Tensor]:  # every tensor it owns (a kind may hold more)
        return [self.k, self.v]

    def nbytes(self) -> int:  # bytes of tensors()
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def expected_nbytes(self, seq_len: int) -> int:
        """:meth:`nbytes` once the cache has seen ``seq_len``, by the kind's own formula."""
        raise NotImplementedError(f"a {type(self).__name__} states no byte formula")

    def row_bytes(self, positions: int) -> int:  # B x H x positions x (w_K + w_V) x s
        return self.batch_size * self.heads * positions * sum(self.widths) * self.dtype.itemsize


class DynamicLayer(CacheLayer):
    """The whole history ``[B, H, T, width]``, grown by concatenation (a new tensor per call)."""

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
        return cls(*CacheLayer(batch_size, heads, widths, dtype, device)._zeros(0))

    def read(self, seq_len: int) -> KV:
        return self.k, self.v

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        self.k, self.v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def crop(self, length: int, seq_len: int) -> DynamicLayer:
        return DynamicLayer(self.k[:, :, :length], self.v[:, :, :length])

    def expected_nbytes(self, seq_len: int) -> int:
        return self.row_bytes(seq_len)


class StaticLayer(CacheLayer):
    """``capacity`` preallocated positions, written in place at absolute positions; rows past
    the cache's length do not count until a whole call has succeeded."""

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
        end = start + k.shape[2]  # the cache checked end <= capacity before the call
        self.k.narrow(2, start, end - start).copy_(k)
        self.v.narrow(2, start, end - start).copy_(v)
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end)

    def crop(self, length: int, seq_len: int) -> StaticLayer:
        return self  # the rows past the new length are written over by the next call

    def expected_nbytes(self, seq_len: int) -> int:
        return self.row_bytes(self.capacity)


class KVCache:
    """``layers[l]`` stores layer ``l``'s rows; ``seq_len`` positions count.

    >>> cache = KVCache([DynamicLayer.empty(1, 2, (4, 4)), StaticLayer(1, 2, (4, 4), 8)])
    >>> work = cache.begin()
    >>> [tuple(work.update(i, *2 * (torch.ones(1, 2, 3, 4),), 0)[0].shape) for i in range(2)]
    [(1, 2, 3, 4), (1, 2, 3, 4)]
    >>> work.finish(3)
    >>> work.seq_len, cache.seq_len     # the caller's cache counts nothing the call wrote
    (3, 0)
    >>> work.nbytes() == 2 * 2 * 4 * 4 * (3 + 8)     # K, V x H x width x 4 B x (grown + capacity)
    True
    """

    def __init__(self, layers: Sequence[CacheLayer], seq_len: int = 0) -> None:
        shared = {(la.batch_size, la.dtype, la.device) for la in layers}
        if len(shared) != 1:
            raise ValueError("every layer must share one batch size, dtype and device" if shared
                             else "a cache needs at least one layer")
        self.layers, self.n_layer = layers, len(layers)
        self._len = check_int("seq_len", seq_len, minimum=0)
        ((self.batch_size, self.dtype, self.device),) = shared

    @property
    def layers(self) -> list[CacheLayer]:
        return self._layers

    @layers.setter
    def layers(self, layers: Sequence[CacheLayer]) -> None:
        self._layers = list(layers)
        # decided once, not at every call: a decode step of the site's model is ~100 us
        self._in_place = all(layer.in_place for layer in self._layers)
        bounds = [la.capacity for la in self._layers if la.capacity is not None]
        self.capacity = min(bounds, default=None)

    @property
    def seq_len(self) -> int:  # T: positions seen, also the absolute position of the next token
        return self._len

    def _layer(self, idx: int) -> CacheLayer:
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < self.n_layer:
            raise ValueError(f"layer {idx!r} is outside 0..{self.n_layer - 1}")
        return self._layers[idx]

    def layer(self, idx: int) -> KV:
        """The rows layer ``idx`` holds (the positions :meth:`held`), in position order."""
        return self._layer(idx).read(self._len)

    def held(self, layer_idx: int | None = None) -> range:
        """The positions :meth:`layer` returns for layer ``layer_idx`` (None: every layer's)."""
        if layer_idx is not None:
            return self._layer(layer_idx).held(self._len)
        return range(max(layer.held(self._len).start for layer in self.layers), self._len)

    @property
    def keeps_every_position(self) -> bool:  # False: a layer drops old ones (no rolling back)
        return all(layer.window is None for layer in self.layers)

    def begin(self) -> KVCache:
        """What one call writes into: this cache if every layer is written in place, else a
        copy of forked layers (the caller's cache then never changes)."""
        if self._in_place:
            return self
        work = copy.copy(self)
        work.layers = [layer.fork() for layer in self._layers]
        return work

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> KV:
        """Store ``k, v`` (``[B, H_kv, C, D_h]``) at ``start ..``; returns what the
        new queries attend over."""
        if start != self._len:
            raise ValueError(f"layer {layer_idx}: the cache holds {self._len} "
                             f"positions, write starts at {start}")
        return self._layer(layer_idx).write(k, v, start)

    def finish(self, end: int) -> None:  # every layer updated: positions 0 .. end - 1 count
        self._len = end

    def crop(self, length: int) -> KVCache:
        """Forget every position from ``length`` on, in place; returns this cache."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._len:
            raise ValueError(f"cannot crop a cache of {self._len} positions to {length!r}")
        self.layers = [layer.crop(length, self._len) for layer in self.layers]
        self._len = length
        return self

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    def nbytes(self) -> int:  # bytes of the tensors it owns
        return sum(layer.nbytes() for layer in self.layers)

    def expected_nbytes(self) -> int:  # nbytes() by each layer's own formula
        return sum(layer.expected_nbytes(self.seq_len) for layer in self.layers)

    def check_compatible(self, config: HasLayout, batch_size: int, dtype: torch.dtype,
                         device: torch.device, new_len: int) -> None:
        """Raise ``ValueError`` unless ``new_len`` tokens of a model with ``config`` fit: each
        layer its spec's heads, widths and window, and the input's batch, dtype, device, length."""
        layout = config.cache_layout
        if len(layout) != self.n_layer:
            raise ValueError(f"cache was built for another model: {self.n_layer} layers, "
                             f"model has {len(layout)}")
        for i, (layer, spec) in enumerate(zip(self.layers, layout, strict=True)):
            if (held := (layer.heads, layer.widths)) != (wanted := (spec.heads, spec.widths)):
                raise ValueError(f"cache was built for another model: layer {i} holds (heads, "
                                 f"widths) = {held}, model has {wanted}")
            if layer.window is not None and (spec.window is None or spec.window > layer.window):
                reads = "every key" if spec.window is None else f"a window of {spec.window}"
                raise ValueError(f"a window of {layer.window} positions cannot serve layer {i}, "
                                 f"which reads {reads}: it would drop keys the model reads")
        for what, held, wanted in (("batch size", self.batch_size, batch_size),
                                   ("dtype", self.dtype, dtype), ("device", self.device, device)):
            if held != wanted:  # the batch is the input's; dtype and device are the model's
                raise ValueError(f"{what} {held} in the cache, {wanted} in the call")
        self.check_room(new_len)

    def check_room(self, new_len: int) -> None:
        """Raise ``ValueError`` unless ``new_len`` more positions fit the preallocated layers."""
        if self.capacity is not None and self._len + new_len > self.capacity:
            raise ValueError(f"static cache over capacity: holds {self._len} of {self.capacity} "
                             f"positions, {new_len} more do not fit")


class DynamicCache(KVCache):
    """A cache of :class:`DynamicLayer` s, built from one ``(K, V)`` per layer (or ``.empty``)."""

    def __init__(self, layers: Sequence[KV]) -> None:
        built = [DynamicLayer(k, v) for k, v in layers]
        if len({layer.k.shape[2] for layer in built}) > 1:
            raise ValueError("every layer must hold the same number of positions")
        super().__init__(built, seq_len=built[0].k.shape[2] if built else 0)

    @classmethod
    def empty(cls, config: HasLayout, batch_size: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> DynamicCache:
        return cls([DynamicLayer.empty(batch_size, s.heads, s.widths, dtype, device).tensors()
                    for s in config.cache_layout])


class StaticCache(KVCache):
    """A cache of :class:`StaticLayer` s of ``capacity`` positions each."""

    def __init__(self, config: HasLayout, batch_size: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__([StaticLayer(batch_size, s.heads, s.widths, capacity, dtype, device)
                          for s in config.cache_layout])

