"""Recurrent states saved at chosen positions, so that a radix tree serves a hybrid model.

A recurrent layer (Gated DeltaNet, Mamba-2) keeps one state, a fold over every earlier token
that no other sequence's rows stand for and that cannot be cropped back: a request resumes only
at a position where an earlier prefill saved a :class:`~kvdoc.core.state.Snapshot`, filed under
the token ids before it. The tree gives it the deepest one inside its match, the K/V blocks
before it, and a copy of its states. Prefills save where :func:`save_points` says, ``branch``
also where the match ended (SGLang's ``mamba_branching_seqlen``); a snapshot is kept while the
tree keeps the rows before it. :func:`kvdoc.measure.prefix_report.state_prefix_report` models
the hit rates these rules give.

>>> import torch
>>> from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder
>>> from kvdoc.serving.paged import BlockPool
>>> from kvdoc.serving.radix import RadixCache, serve_prompt
>>> _ = torch.manual_seed(0)
>>> model = DeltaNetDecoder(DeltaNetConfig()).eval()   # a DeltaNet layer, an attention layer
>>> tree = RadixCache(BlockPool(model.config, num_blocks=16, block_size=4), states="every")
>>> system = list(range(1, 11))                        # 10 tokens: boundaries at 4 and 8
>>> a = serve_prompt(model, tree, system + [20, 21], max_new=2)   # saves at 4, 8, 12
>>> b = serve_prompt(model, tree, system + [30, 31, 32], max_new=2)   # resumes at 8
>>> a.matched, b.matched, sorted(len(key) for key in tree.states.saved)
(0, 8, [4, 8, 12, 12])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvdoc.core.cache import KVCache
from kvdoc.core.state import Snapshot, StateLayer, StateSpec, state_layers

from .paged import BlockPool

WHERE = ("every", "last", "end")
"""The save rules, as in the module docstring."""
Where = Literal["every", "last", "end"]


def save_points(n: int, hit: int, where: str, block: int) -> list[int]:
    """Positions where a prefill of a prompt of ``n`` tokens, resumed at ``hit``, saves states:
    every multiple of ``block`` (a prefill in chunks of a block); the last before its last token
    (vLLM 0.33's ``mamba_cache_mode="align"``); its end (SGLang 0.5.23's ``no_buffer``).

    >>> save_points(30, 0, "every", 8), save_points(30, 0, "last", 8), save_points(30, 8, "end", 8)
    ([8, 16, 24], [24], [30])
    """
    last = (n - 1) // block * block  # the last boundary before the last token
    if where == "every":
        return list(range((hit // block + 1) * block, n + 1, block))
    if where == "last":
        return [last] if last > hit else []
    return [n]


class SnapshotStore:
    """The saved states of one tree, by the token ids before each: ``saved[tuple(ids)]``."""

    def __init__(self, where: Where = "last", block: int = 16, branch: bool = False) -> None:
        if where not in WHERE:
            raise ValueError(f"where must be one of {WHERE}, got {where!r}")
        self.where, self.block, self.branch = where, block, branch
        self.saved: dict[tuple[int, ...], Snapshot] = {}

    def points(self, n: int, hit: int, matched: int) -> list[int]:
        """Where a prompt of ``n`` tokens resumed at ``hit`` saves (``branch``: also its match)."""
        points = save_points(n, hit, self.where, self.block)
        branch = matched // self.block * self.block
        if self.branch and branch > hit and branch not in points:
            points = sorted([*points, branch])
        return points

    def deepest(self, prompt: Sequence[int], length: int) -> int:
        """The deepest ``p <= length`` with states saved for ``prompt[:p]`` (0: zero states)."""
        return max((p for p in range(length, 0, -1) if tuple(prompt[:p]) in self.saved),
                   default=0)

    def restore(self, cache: KVCache, prompt: Sequence[int]) -> None:
        """Set ``cache``'s state layers to copies of the states saved after ``prompt``."""
        if not prompt:
            return
        snap = self.saved[tuple(prompt)]
        cache.layers = [layer.restored({n: t.clone() for n, t in snap.states[i].items()})
                        if isinstance(layer, StateLayer) else layer
                        for i, layer in enumerate(cache.layers)]

    def keep(self, tokens: Sequence[int], snapshots: Sequence[Snapshot], held: int) -> int:
        """File the ``snapshots`` within the first ``held`` positions; returns how many were new."""
        new = 0
        for snap in snapshots:
            key = tuple(tokens[:snap.position])
            if snap.position <= held and key not in self.saved:
                self.saved[key] = snap
                new += 1
        return new

    def prune(self, holds: callable) -> None:
        """Drop the snapshots whose rows are gone (``holds(ids)``: positions still held)."""
        self.saved = {key: s for key, s in self.saved.items() if holds(key) >= len(key)}

    def nbytes(self) -> int:
        """Bytes of every saved state."""
        return sum(s.nbytes() for s in self.saved.values())


def takes_states(cache: KVCache) -> bool:
    """Whether ``cache`` has a state layer, so resuming it needs a snapshot."""
    return bool(state_layers(cache))


def store_for(pool: BlockPool, states: Where | SnapshotStore | None) -> SnapshotStore | None:
    """A radix tree's store for ``pool``, or None for a pool without recurrent layers."""
    hybrid = any(isinstance(spec, StateSpec) for spec in pool.layout)
    if states is not None and not hybrid:
        raise ValueError("states: only a pool with recurrent state layers saves states")
    if not hybrid or isinstance(states, SnapshotStore):
        return states
    return SnapshotStore(states or "last", pool.block_size)
