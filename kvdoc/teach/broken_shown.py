"""Deliberately wrong parts that the pages and tests show being caught, each a subclass of the
real class changing one method it offers for that purpose (or a function in place of one):
radix trees, hand-over packers, schedulers, a decoder that ignores per-row positions, and an
attention whose sums follow the chunking. Every one is **wrong on purpose**. Those the suite
sweeps are in :mod:`kvdoc.proofs.broken`.

:class:`ChunkSplitAttention` is within every tolerance of the full forward: only bits show it.

>>> from kvdoc import Decoder, GPTConfig, batch_invariant
>>> _ = torch.manual_seed(0)
>>> model = with_attention(Decoder(GPTConfig()).eval(), ChunkSplitAttention)
>>> ids = torch.randint(0, 97, (1, 12))
>>> with torch.no_grad(), batch_invariant():
...     full = model(ids).logits
...     _, cache = model(ids[:, :5], model.new_cache(1))
...     rest = model(ids[:, 5:], cache).logits
>>> torch.equal(rest, full[:, 5:]), torch.allclose(rest, full[:, 5:], atol=1e-5, rtol=0)
(False, True)
"""

from __future__ import annotations

import math

import torch

from kvdoc.core.cache import DynamicCache, KVCache
from kvdoc.core.model import CausalSelfAttention, Decoder, DecoderOutput
from kvdoc.proofs.broken.decoders import copy_as, with_attention  # noqa: F401 (the doctest)
from kvdoc.serving.batching import RaggedStep
from kvdoc.serving.handover import pack
from kvdoc.serving.radix import LRU, RadixCache
from kvdoc.serving.scheduler import LiveRequest, Scheduler
from kvdoc.serving.splitk import merge, partial_attention


# --- radix trees --------------------------------------------------------------------------------
class WholeBlockMatch(RadixCache):
    """BROKEN: rounds a token-granular match up to its last block's end, so the request skips
    prefilling positions whose K/V belong to another sequence."""

    def match(self, tokens):
        length, blocks, node = super().match(tokens)
        end = len(blocks) * self.block_size
        if length % self.block_size and end < len(tokens):
            length = end  # BUG: the tail of the last block is another request's
        return length, blocks, node


class ReserveFinalToken(RadixCache):
    """BROKEN: makes room for ``len(prompt) + max_new`` positions, one more than a request writes
    (its last token is never fed), so it may refuse a request that fits."""

    def admit(self, prompt, max_new=0):
        return super().admit(prompt, max_new + 1)  # BUG: the last token is never written


class ShareLastBlock(RadixCache):
    """BROKEN: in block mode a prompt found whole shares its last block and copies it on its
    first write (vLLM and SGLang match whole blocks only)."""

    def reusable(self, prompt):
        length, blocks, node = self.match(prompt)
        length = min(length, len(prompt) - 1)  # BUG: not rounded down to whole blocks
        return length, blocks[:math.ceil(length / self.block_size)], node


class IgnoreLocks(LRU):
    """BROKEN: an eviction policy that ignores locks: making room may evict the path matched."""

    def may_evict(self, node):
        return True  # BUG: node.lock not consulted


class EvictLocked(RadixCache):
    """A tree whose eviction policy is :class:`IgnoreLocks`."""

    def __init__(self, pool, granularity="token", evict="leaf"):
        super().__init__(pool, granularity, policy=IgnoreLocks(), evict=evict)


# --- hand-over packers: each rebuilds the cache as a dynamic one of the layers it ships ----------
def pack_off_by_one(cache: KVCache, logits: torch.Tensor | None = None) -> bytes:
    """BROKEN: ships positions ``0 .. T - 2``: decoding writes over the prompt's last one."""
    layers = [cache.layer(i) for i in range(cache.n_layer)]
    return pack(DynamicCache(layers).crop(cache.seq_len - 1), logits)


def pack_zeroed_last_v(cache: KVCache, logits: torch.Tensor | None = None) -> bytes:
    """BROKEN: the last layer's V is sent as zeros: every size right, only the values wrong."""
    layers = [cache.layer(i) for i in range(cache.n_layer)]
    layers[-1] = (layers[-1][0], torch.zeros_like(layers[-1][1]))
    return pack(DynamicCache(layers), logits)


# --- schedulers ----------------------------------------------------------------------------
class SharedStartScheduler(Scheduler):
    """BROKEN: every row of a step is embedded at the step's common start, not its own length."""

    def positions(self, view: RaggedStep) -> torch.Tensor:
        C = max(view.new)
        return view.seq_len + torch.arange(C, device=view.device).expand(len(view.new), C)


class ResumeWithoutRecompute(Scheduler):
    """BROKEN: preemption gives the blocks back but keeps the count of written positions, so the
    request decodes on as if its K/V were still there."""

    def preempt(self, live: LiveRequest) -> int:
        discarded = live.fed
        self.pool.release(live.table)
        live.table.clear()
        live.preemptions += 1  # BUG: live.fed = 0 missing
        return discarded


class ForkWithoutCopy(Scheduler):
    """BROKEN: a fork writes into the block it shares (no copy-on-write)."""

    def reserve(self, live: LiveRequest, end: int) -> bool:
        missing = max(0, self.blocks_for(end) - len(live.table))
        if missing > self.pool.num_free:
            return False
        live.table.extend(self.pool.allocate(missing))  # BUG: shared blocks not copied
        return True


# --- padded batches ---------------------------------------------------------------------------
class UnshiftedPositionsDecoder(Decoder):
    """BROKEN: ignores per-row positions: a row with ``pad`` slots in front sees its prompt at
    positions ``pad ..``, not ``0 ..``."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *, last_only: bool = False,
                positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> DecoderOutput:
        # BUG: drops positions
        return super().forward(idx, cache, last_only=last_only, attn_mask=attn_mask)


def unshifted_positions(model: Decoder) -> UnshiftedPositionsDecoder:
    return copy_as(model, UnshiftedPositionsDecoder)


# --- sums that follow the chunking ----------------------------------------------------------
class ChunkSplitAttention(CausalSelfAttention):
    """BROKEN: cached keys and the chunk's keys as two partial softmaxes, merged as split-K does."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        C, T = q.shape[2], k.shape[2]
        if T == C:  # nothing cached: one pass, as the real attention
            return super().attend(q, k, v, start, attn_mask)
        mask = self.visible(start, C, T, attn_mask, q.device)
        mask = torch.ones(C, T, dtype=torch.bool, device=q.device) if mask is None else mask
        dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)  # no rounding to see
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
        parts = [partial_attention(q, k[:, :, keys], v[:, :, keys], mask[..., keys])
                 for keys in (slice(None, T - C), slice(T - C, None))]  # the split: the chunk
        return merge(parts)[0].to(dtype)
