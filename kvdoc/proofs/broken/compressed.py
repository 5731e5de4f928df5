"""Deliberately wrong V4 layers and compressed caches (:mod:`kvdoc.core.v4`,
:mod:`kvdoc.core.compressed`), for the broken variants.

Each is a small subclass of the real one, right on a stream whose calls end on block edges and
wrong where a call ends inside a block (the cache factories), or everywhere alike (the sink),
which only an independent reference sees.

>>> from kvdoc.core.v4 import CompressedConfig, CompressedDecoder
>>> model = CompressedDecoder(CompressedConfig()).eval()
>>> cache = early_entry_cache(model, batch=1, capacity=8)
>>> _, cache = model(torch.tensor([[1, 2, 3, 4, 5]]), cache)
>>> [tuple(layer.entries.shape) for layer in cache.layers[:2]]   # 5 positions: 2 and 1 entries
[(1, 2, 32), (1, 1, 16)]
"""

from __future__ import annotations

import torch
from torch import nn

from kvdoc.core.cache import KVCache
from kvdoc.core.compressed import CompressedLayer, Pending
from kvdoc.core.v4 import CompressedAttention, CompressedDecoder

from .decoders import copy_as


class EarlyEntryLayer(CompressedLayer):
    """Pools the unfinished block at the end of every call, its last row repeated to fill it:
    an entry emitted before its block is full, and the rest of the block lost."""

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> Pending:
        done = super().write(k, v, start)
        if self.rate is None or self.buffer.shape[1] == 0:
            return done
        short = self.rate - self.buffer.shape[1]
        padded = torch.cat((self.buffer, self.buffer[:, -1:].expand(-1, short, -1)), dim=1)
        self.buffer = self.buffer[:, :0]
        return done._replace(rows=torch.cat((done.rows, padded), dim=1))


class DroppedBufferLayer(CompressedLayer):
    """Drops the unfinished block's rows when a call ends: the next block pools only the rows
    of the calls after it."""

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
    """Adds each head's sink logit to the softmax twice, in every call, full or cached."""

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
