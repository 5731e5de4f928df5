"""A recurrent layer's cache: a few fixed-size tensors per sequence that each call replaces.

A linear-attention or state-space layer (Gated DeltaNet, Mamba-2) keeps no rows: its last token
needs only a fold over every earlier one, a causal convolution's last ``K - 1`` inputs and a
matrix-valued state, of one size at every position. A :class:`StateLayer` holds them by name
inside a :class:`~kvdoc.core.cache.KVCache`, beside K/V layers (a hybrid model's attention
layers). The cache's checks serve it unchanged, because of how its :class:`StateSpec` reads:

* ``heads`` is 0 and ``widths`` the named shapes, so ``check_compatible`` refuses a K/V layer
  for a state spec and a state layer for a K/V spec (and a state of other shapes);
* ``window`` is 0, the positions it keeps as rows: ``held`` is empty, ``keeps_every_position``
  is False, and a crop to an earlier position is refused (a fold cannot be undone).

A call reads the state with :func:`read_state` and replaces it with :func:`update_state` in the
fork ``cache.begin()`` gives (a shallow copy: the caller's layer keeps its tensors, so a call
that fails midway leaves it as it was); a :class:`RecurrentMixer`'s forward does both around
its mix. Going back is :func:`restore` of a :func:`snapshot` taken at that position (prefix
caching resumes from a block boundary this way): the K/V layers are cropped to it, the states
set to the snapshot's.

>>> spec = StateSpec((("conv", (6, 3)), ("recurrent", (2, 4, 5))))   # per sequence
>>> cache = KVCache([StateLayer(1, spec), DynamicLayer.empty(1, 2, (4, 4))])
>>> work = cache.begin()
>>> old = read_state(work, 0)                        # zeros before the first token
>>> update_state(work, 0, 0, conv=old["conv"] + 1, recurrent=old["recurrent"] + 1)
>>> _ = work.update(1, torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
>>> work.finish(3)
>>> float(read_state(cache, 0)["conv"].sum()), float(read_state(work, 0)["conv"].sum())
(0.0, 18.0)
>>> snap = snapshot(work)                            # at position 3
>>> work.layers[0].nbytes() == 4 * (6 * 3 + 2 * 4 * 5)   # the same at every position
True
>>> work.crop(2)
Traceback (most recent call last):
ValueError: layer StateLayer: a recurrent state ... cannot go back from 3 to 2 without ...
>>> restore(work, snap).seq_len, work.held(0), work.held(1)
(3, range(3, 3), range(0, 3))
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .cache import CacheLayer, DynamicLayer, KVCache, check_int

Shapes = tuple[tuple[str, tuple[int, ...]], ...]


class StateSpec(NamedTuple):
    """What one recurrent layer keeps per sequence: ``shapes``, named tensor shapes without the
    batch dimension (a conv window ``(channels, K - 1)``, a state ``(H, D_k, D_v)``)."""

    shapes: Shapes
    heads: int = 0  # no K/V heads: a K/V layer never serves this spec, nor this kind a K/V one
    window: int = 0  # the positions it keeps as rows: none

    @property
    def widths(self) -> Shapes:  # what check_compatible compares with a layer's
        return self.shapes


class StateLayer(CacheLayer):
    """A recurrent layer's named tensors ``[B, *shape]``, zeros before the first position.

    A call replaces them (:meth:`replace`); nothing is written in place, so :meth:`fork` (a
    shallow copy) leaves the caller's layer as it was. :meth:`nbytes` does not grow with
    positions; :meth:`held` is empty; :meth:`crop` refuses to go back.
    """

    window = 0
    at: int | None = None  # the position of a restored snapshot's state, until a call replaces it

    def __init__(self, batch_size: int, spec: StateSpec, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        # not CacheLayer's __init__: no heads or widths to check, the shapes are
        self.batch_size = check_int("batch_size", batch_size)
        if not isinstance(spec, StateSpec) or not spec.shapes:
            raise ValueError(f"a state layer needs a StateSpec of named shapes, got {spec!r}")
        for name, shape in spec.shapes:
            for size in shape:
                check_int(f"state {name!r} size", size)
        self.spec, self.heads, self.widths = spec, spec.heads, spec.widths
        self.dtype, self.device = dtype, torch.device(device)
        self.state = {name: torch.zeros((batch_size, *shape), dtype=dtype, device=self.device)
                      for name, shape in spec.shapes}

    def read(self, seq_len: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.state.values())  # in the spec's order (by name: read_state)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        raise ValueError("a state layer keeps no K/V rows; a call replaces its state "
                         "(kvdoc.core.state.update_state)")

    def replace(self, **tensors: torch.Tensor) -> None:
        """Replace every named tensor at once (each ``[B, *shape]`` in the layer's dtype)."""
        if set(tensors) != set(self.state):
            raise ValueError(f"a state layer holds {sorted(self.state)}, got {sorted(tensors)}")
        for name, t in tensors.items():
            old = self.state[name]
            if not isinstance(t, torch.Tensor) or t.shape != old.shape or t.dtype != old.dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(f"state {name!r} must be {tuple(old.shape)} {old.dtype}, "
                                 f"got {got}")
        self.state = {name: tensors[name] for name in self.state}  # a new dict: forks keep theirs
        self.at = None  # a state after a call's tokens, not a snapshot's position

    def held(self, seq_len: int) -> range:
        return range(seq_len, seq_len)  # no rows: a fold over all of them

    def crop(self, length: int, seq_len: int) -> StateLayer:
        if length in (seq_len, self.at):
            return self
        raise ValueError(f"layer {type(self).__name__}: a recurrent state folds every position "
                         f"it has seen; it cannot go back from {seq_len} to {length} without a "
                         f"snapshot taken at {length} (kvdoc.core.state.snapshot / restore)")

    def tensors(self) -> list[torch.Tensor]:
        return list(self.state.values())

    def expected_nbytes(self, seq_len: int) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return self.batch_size * size * sum(math.prod(shape) for _, shape in self.spec.shapes)

    def restored(self, state: dict[str, torch.Tensor], at: int | None = None) -> StateLayer:
        """A copy of this layer holding ``state`` (checked as :meth:`replace` checks), the state
        after ``at`` positions: the cache's crop to ``at`` then keeps it."""
        layer = copy.copy(self)
        layer.replace(**state)
        layer.at = at
        return layer


def _state_layer(cache: KVCache, idx: int) -> StateLayer:
    layer = cache.layers[idx] if isinstance(idx, int) and 0 <= idx < cache.n_layer else None
    if not isinstance(layer, StateLayer):
        raise ValueError(f"layer {idx!r} of the cache is not a state layer "
                         f"({type(layer).__name__})")
    return layer


def read_state(cache: KVCache, idx: int) -> dict[str, torch.Tensor]:
    """Layer ``idx``'s state after the ``cache.seq_len`` positions it has seen, by name."""
    return dict(_state_layer(cache, idx).state)


def update_state(cache: KVCache, idx: int, start: int, **tensors: torch.Tensor) -> None:
    """Replace layer ``idx``'s state with the one after a call's new tokens at ``start ..``
    (``start`` must be ``cache.seq_len``, as :meth:`~kvdoc.core.cache.KVCache.update` checks)."""
    layer = _state_layer(cache, idx)
    if start != cache.seq_len:
        raise ValueError(f"layer {idx}: the cache holds {cache.seq_len} positions, "
                         f"write starts at {start}")
    layer.replace(**tensors)


class RecurrentMixer(nn.Module):
    """A recurrent layer (Gated DeltaNet's, Mamba-2's) whose cache layer holds ``conv``, the last
    ``K - 1`` inputs of its causal depthwise ``conv1d``, and ``recurrent``, its state: a call
    reads them (zeros without a cache: ``zero_state(x)``), ``mix(x, conv, recurrent)`` gives its
    outputs and the two after it, and the cache takes those."""

    conv1d: nn.Conv1d

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:  # HybridDecoder: None
        if cache is None:  # a full forward starts from zero states
            conv, recurrent = self.zero_state(x)
        else:
            state = read_state(cache, layer_idx)
            conv, recurrent = state["conv"], state["recurrent"]
        y, conv, recurrent = self.mix(x, conv, recurrent)
        if cache is not None:
            update_state(cache, layer_idx, start, conv=conv, recurrent=recurrent)
        return y

    def conv(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``silu(conv1d)`` of ``x`` ``[B, C, channels]`` after the ``K - 1`` inputs of
        ``window`` ``[B, channels, K - 1]``; and the window after ``x``."""
        seq = torch.cat((window, x.transpose(1, 2)), dim=2)
        out = F.conv1d(seq, self.conv1d.weight, self.conv1d.bias, groups=seq.shape[1])
        # a copy: a view of the last inputs would keep the call's whole input alive
        return F.silu(out).transpose(1, 2), seq[:, :, seq.shape[2] - window.shape[2]:].clone()


class Snapshot(NamedTuple):
    """Every state layer's tensors (copies) after ``position`` positions, by layer index."""

    position: int
    states: dict[int, dict[str, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.states.values() for t in s.values())


def state_layers(cache: KVCache) -> list[int]:
    """The indices of ``cache``'s state layers."""
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, StateLayer)]


def snapshot(cache: KVCache) -> Snapshot:
    """The state layers' tensors now (cloned), to :func:`restore` this position later."""
    return Snapshot(cache.seq_len, {i: {n: t.clone() for n, t in read_state(cache, i).items()}
                                    for i in state_layers(cache)})


def restore(cache: KVCache, snap: Snapshot) -> KVCache:
    """Take ``cache`` back to ``snap.position``, in place (as ``crop``): K/V layers cropped,
    state layers set to the snapshot's tensors (copies of them, so it can be restored again);
    returns the cache. A ``ValueError`` (the cache unchanged) if it cannot."""
    if not isinstance(snap, Snapshot) or not 0 <= snap.position <= cache.seq_len:
        where = snap.position if isinstance(snap, Snapshot) else type(snap).__name__
        raise ValueError(f"cannot restore a cache of {cache.seq_len} positions to {where}")
    if sorted(snap.states) != state_layers(cache):
        raise ValueError(f"the snapshot holds layers {sorted(snap.states)}, the cache's state "
                         f"layers are {state_layers(cache)}")
    old = cache.layers
    cache.layers = [layer.restored({n: t.clone() for n, t in snap.states[i].items()},
                                   snap.position) if isinstance(layer, StateLayer) else layer
                    for i, layer in enumerate(old)]  # each state checked before any change
    try:  # the rows by the cache's own crop (a paged cache's block tables, a layer's rows)
        return cache.crop(snap.position)
    except ValueError:
        cache.layers = old
        raise


def hybrid_cache(layout: tuple, batch_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> KVCache:
    """An empty cache for a ``cache_layout`` that mixes :class:`StateSpec` s (a state layer
    each) and :class:`~kvdoc.core.cache.LayerSpec` s without windows (a growing layer each).

    >>> from kvdoc.core.cache import LayerSpec
    >>> layout = (StateSpec((("s", (2, 3)),)), LayerSpec(2, (4, 4)))
    >>> [type(la).__name__ for la in hybrid_cache(layout, 1).layers]
    ['StateLayer', 'DynamicLayer']
    """
    return KVCache([StateLayer(batch_size, s, dtype, device) if isinstance(s, StateSpec)
                    else DynamicLayer.empty(batch_size, s.heads, s.widths, dtype, device)
                    for s in layout])
