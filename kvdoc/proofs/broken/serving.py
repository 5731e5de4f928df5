"""Deliberately wrong parts of the serving layer that the suite sweeps: a radix tree evicting
the wrong block, the key of an offloaded block (:data:`OFFLOAD_BROKEN`), and a speculative
rollback that leaves a rejected row in the draft. Those only the pages and tests show are in
:mod:`kvdoc.teach.broken_shown`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdoc.core.cache import DynamicLayer, KVCache
from kvdoc.core.model import Decoder
from kvdoc.serving.offload import hash_block
from kvdoc.serving.radix import RadixCache
from kvdoc.serving.speculative import speculative_generate

from .caches import with_layers


class FirstBlockEviction(RadixCache):
    """BROKEN: block-mode eviction frees a leaf's first block, not its last, while the leaf's
    tokens lose their tail as they should: every decision (which leaf, how many blocks, the
    log) is right, but the blocks left hold the K/V of the positions after their own."""

    def drop(self, leaf, n):
        self.pool.release(leaf.blocks[:n])  # BUG: the head, not the tail
        leaf.tokens, leaf.blocks = leaf.tokens[:-n * self.block_size], leaf.blocks[n:]


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
