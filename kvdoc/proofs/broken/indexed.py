"""Deliberately wrong indexed attention (:mod:`kvdoc.core.indexed`): the selection of keys and
the indexer keys' cache.

Each is an :class:`~kvdoc.core.indexed.IndexedDecoder` whose attention changes the rule it
selects keys by (its ``read_mask`` or ``choose``), or whose cache layers fork wrongly.

>>> import torch
>>> from kvdoc.core.indexed import IndexedConfig, IndexedDecoder
>>> _ = torch.manual_seed(0)
>>> model = IndexedDecoder(IndexedConfig(index_topk=2)).eval()
>>> _, split = cached_only(indexed_as(model, NewRowsTopkDecoder), model)
>>> split > 1e-3   # the cached call ranks keys 4 and 5 only
True
"""

from __future__ import annotations

import copy
import math

import torch

from kvdoc.core.cache import KVCache
from kvdoc.core.indexed import IndexedAttention, IndexedDecoder, IndexedLayer, select
from kvdoc.serving.paged import BlockPool, PagedCache, paged_cache

from .decoders import cached_only, copy_as  # noqa: F401 (cached_only: the doctest)


def indexed_as(model: IndexedDecoder, cls: type[IndexedDecoder]) -> IndexedDecoder:
    """A ``cls`` holding ``model``'s weights (its attention is the only change)."""
    return copy_as(model, cls)


class NewRowsTopkAttention(IndexedAttention):
    """BROKEN: the top k are taken over the call's new rows only: the cached keys are never
    ranked, so never read. A full forward (every key new) is right; a cached call is not."""

    def read_mask(self, x, q_latent, cache, layer_idx, start, at, T, attn_mask):
        mask = super().read_mask(x, q_latent, cache, layer_idx, start, at, T, attn_mask)
        if start == 0:
            return mask
        keys = self.indexer.keys(x, at)  # BUG: this call's indexer keys, not the cache's
        allowed = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool,
                             device=x.device).tril()  # the new rows among themselves
        chosen = select(self.indexer.scores(x, q_latent, keys, at), allowed,
                        self.config.index_topk)
        return torch.cat((torch.zeros_like(mask[..., :start]), chosen[:, None]), dim=-1)


class NewRowsTopkDecoder(IndexedDecoder):
    attention = NewRowsTopkAttention


class TopkTiesAttention(IndexedAttention):
    """BROKEN: ties are left to ``torch.topk`` over the whole row of ``T`` keys (transformers'
    rule, :mod:`kvdoc.core.indexed`): which of several tied keys it returns depends on ``T``,
    the keys after the query included, so a row's choice is not causal and the cached path,
    whose rows are shorter, chooses otherwise."""

    def choose(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        ranked = scores.masked_fill(~allowed, float("-inf"))
        k = min(self.config.index_topk, scores.shape[-1])
        picked = ranked.topk(k, dim=-1).indices  # BUG: tied keys in topk's order, not by position
        return torch.zeros_like(scores, dtype=torch.bool).scatter(-1, picked, True) & allowed


class TopkTiesDecoder(IndexedDecoder):
    attention = TopkTiesAttention


class UnforkedKeysLayer(IndexedLayer):
    """BROKEN: a call forks the latent's layer but not the indexer keys', so it grows the keys
    of the cache it continues: that cache then holds more indexer keys than latent rows."""

    def fork(self) -> IndexedLayer:
        forked = copy.copy(self)
        forked.latent = self.latent.fork()  # BUG: forked.keys is still this layer's
        return forked


class UnforkedKeysDecoder(IndexedDecoder):
    def new_cache(self, batch_size: int, kind=None, capacity=None) -> KVCache:
        cache = super().new_cache(batch_size, kind, capacity)
        cache.layers = [UnforkedKeysLayer(layer.latent, layer.keys) for layer in cache.layers]
        return cache


class KeysNotCopiedPool(BlockPool):
    """BROKEN: copy-on-write copies a shared block's latent rows but not its indexer keys."""

    def copy(self, block: int) -> int:
        (new,) = self.allocate(1)
        for store in (*self.k, *self.v):  # BUG: self.index_k and self.index_v left as zeros
            store[new] = store[block]
        self.release([block])
        return new


def keys_not_copied_cache(model: IndexedDecoder, batch: int, capacity: int,
                          block_size: int = 4) -> PagedCache:
    """A shared-prefix cache over a :class:`KeysNotCopiedPool` sized as the grid's."""
    weight = model.wte.weight
    pool = KeysNotCopiedPool(model.config, batch * (math.ceil(capacity / block_size) + 1),
                             block_size, weight.dtype, weight.device)
    return paged_cache(pool, batch, shared=True)
