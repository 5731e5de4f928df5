"""Deliberately wrong sparse and compressed attention: DeepSeek-V3.2's indexed attention
(:mod:`kvdoc.core.indexed`; the rule that selects keys, the indexer keys' cache) and
DeepSeek-V4's compressed caches (:mod:`kvdoc.core.compressed`; right on a stream whose calls end
on block edges, wrong where a call ends inside a block) and its sinks (wrong alike in every
call: only an independent reference sees it).

>>> from kvdoc.core.indexed import IndexedConfig
>>> from kvdoc.core.v4 import CompressedConfig
>>> _ = torch.manual_seed(0)
>>> model = IndexedDecoder(IndexedConfig(index_topk=2)).eval()
>>> _, split = cached_only(copy_as(model, NewRowsTopkDecoder), model)
>>> split > 1e-3   # the cached call ranks keys 4 and 5 only
True
>>> model = CompressedDecoder(CompressedConfig()).eval()
>>> cache = early_entry_cache(model, batch=1, capacity=8)
>>> _, cache = model(torch.tensor([[1, 2, 3, 4, 5]]), cache)
>>> [tuple(layer.entries.shape) for layer in cache.layers[:2]]   # 5 positions: 2 and 1 entries
[(1, 2, 32), (1, 1, 16)]
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from kvdoc.core.cache import KVCache
from kvdoc.core.compressed import CompressedLayer, Pending
from kvdoc.core.indexed import IndexedAttention, IndexedDecoder, IndexedLayer, select
from kvdoc.core.v4 import CompressedAttention, CompressedDecoder
from kvdoc.serving.paged import BlockPool, PagedCache, paged_cache

from .decoders import cached_only, copy_as  # noqa: F401 (the doctest)


class NewRowsTopkAttention(IndexedAttention):
    """BROKEN: the top k are taken over the call's new rows only: cached keys are never read."""

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
    rule, :mod:`kvdoc.core.indexed`), whose choice among tied keys depends on ``T``."""

    def choose(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        ranked = scores.masked_fill(~allowed, float("-inf"))
        k = min(self.config.index_topk, scores.shape[-1])
        picked = ranked.topk(k, dim=-1).indices  # BUG: tied keys in topk's order, not by position
        return torch.zeros_like(scores, dtype=torch.bool).scatter(-1, picked, True) & allowed


class TopkTiesDecoder(IndexedDecoder):
    attention = TopkTiesAttention


class UnforkedKeysLayer(IndexedLayer):
    """BROKEN: a call forks the latent's layer but not the indexer keys'."""

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


class EarlyEntryLayer(CompressedLayer):
    """BROKEN: pools the unfinished block at the end of every call, its last row repeated."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> Pending:
        done = super().write(k, v, start)
        if self.rate is None or self.buffer.shape[1] == 0:
            return done
        short = self.rate - self.buffer.shape[1]
        padded = torch.cat((self.buffer, self.buffer[:, -1:].expand(-1, short, -1)), dim=1)
        self.buffer = self.buffer[:, :0]
        return done._replace(rows=torch.cat((done.rows, padded), dim=1))


class DroppedBufferLayer(CompressedLayer):
    """BROKEN: drops the unfinished block's rows when a call ends."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> Pending:
        done = super().write(k, v, start)
        if self.rate is not None:
            self.buffer = self.buffer[:, :0]
        return done


def _cache(layer_cls: type[CompressedLayer]):
    def new(model: nn.Module, batch: int, capacity: int) -> KVCache:
        weight, config = model.wte.weight, model.config
        return KVCache([layer_cls(batch, **config.layer_storage(i), dtype=weight.dtype,
                                  device=weight.device) for i in range(config.n_layer)])
    return new


early_entry_cache = _cache(EarlyEntryLayer)
dropped_buffer_cache = _cache(DroppedBufferLayer)


class SinkTwiceAttention(CompressedAttention):
    """BROKEN: adds each head's sink logit to the softmax twice, in every call."""

    def attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, H, C, _ = q.shape
        logits = (q @ keys.mT) * self.config.head_dim ** -0.5
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        sink = self.sinks.view(1, H, 1, 1).expand(B, H, C, 1).to(logits.dtype)
        probs = torch.cat((logits, sink, sink), dim=-1).softmax(dim=-1)
        return probs[..., :-2] @ keys


def sink_twice(model: CompressedDecoder) -> CompressedDecoder:
    """A copy of ``model`` whose every attention is a :class:`SinkTwiceAttention`."""
    clone = copy_as(model, CompressedDecoder)
    for block in clone.h:
        with torch.random.fork_rng():  # its fresh weights are overwritten
            attn = SinkTwiceAttention(model.config, block.attn.kind).to(model.wte.weight.dtype)
        attn.load_state_dict(block.attn.state_dict())
        block.attn = attn.eval()
    return clone
