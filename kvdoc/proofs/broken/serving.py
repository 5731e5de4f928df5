"""Deliberately wrong parts of the serving layer, each a subclass of the real class changing one
method it offers for that purpose (or a function in place of one): radix trees (one evicting the
wrong block), hand-over packers, schedulers, a decoder that ignores per-row positions, the key of
an offloaded block (:data:`OFFLOAD_BROKEN`), and a speculative rollback that leaves a rejected
row in the draft.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvdoc.core.cache import DynamicCache, DynamicLayer, KVCache
from kvdoc.core.model import Decoder, DecoderOutput
from kvdoc.serving.batching import RaggedStep
from kvdoc.serving.handover import pack
from kvdoc.serving.offload import hash_block
from kvdoc.serving.radix import LRU, RadixCache
from kvdoc.serving.scheduler import LiveRequest, Scheduler
from kvdoc.serving.speculative import speculative_generate

from .caches import with_layers
from .decoders import copy_as


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


class FirstBlockEviction(RadixCache):
    """BROKEN: block-mode eviction frees a leaf's first block, not its last, while the leaf's
    tokens lose their tail as they should: every decision (which leaf, how many blocks, the
    log) is right, but the blocks left hold the K/V of the positions after their own."""

    def drop(self, leaf, n):
        self.pool.release(leaf.blocks[:n])  # BUG: the head, not the tail
        leaf.tokens, leaf.blocks = leaf.tokens[:-n * self.block_size], leaf.blocks[n:]


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


# --- offloaded blocks ------------------------------------------------------------------------
def parentless_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """BROKEN: the key of ``tokens`` as if every block were a sequence's first.

    >>> parentless_hash(b"any parent", [1, 2]) == parentless_hash(None, [1, 2])
    True
    """
    return hash_block(None, tokens)


OFFLOAD_BROKEN = {"offload-parentless-hash": parentless_hash}
"""Name -> the broken ``hash_fn`` for :func:`kvdoc.serving.offload.serve`."""


# --- speculative rollback -----------------------------------------------------------------------
class StaleCropLayer(DynamicLayer):
    """BROKEN: a crop keeps one row past the new length (the cache's count is right), so the
    next write lands after a row that was rolled back."""

    def crop(self, length: int, seq_len: int) -> DynamicLayer:
        return StaleCropLayer(self.k[:, :, :length + 1], self.v[:, :, :length + 1])  # BUG


def stale_draft_speculative(target: Decoder, draft: Decoder, prompt: torch.Tensor,
                            max_new_tokens: int, k: int = 4, *, cache, **options):
    """BROKEN: :func:`~kvdoc.serving.speculative.speculative_generate` whose draft rolls back
    with :class:`StaleCropLayer`: after a rejection the draft reads a rejected proposal's K/V,
    so it proposes from a wrong context. The target checks every proposal: the tokens stay the
    target's, only acceptance drops. ``cache``: ``(model, capacity) ->`` a dynamic cache."""
    def new(model: Decoder, capacity: int) -> KVCache:
        made = cache(model, capacity)
        return with_layers(made, StaleCropLayer) if model is draft else made
    return speculative_generate(target, draft, prompt, max_new_tokens, k, cache=new, **options)
