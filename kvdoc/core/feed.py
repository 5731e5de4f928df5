"""The one loop that feeds a prompt or a stream through a model chunk by chunk.

Chunked prefill, a stream fed a few tokens at a time, a decode loop over known tokens: each is
``feed(model, ids, cache, chunk)``. The verification, the measurements, the tests and the pages
all call it, so a chunk boundary is computed, and a cache continued, in one place.

>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18, 3]])
>>> seen = []
>>> run = feed(model, ids, model.new_cache(1), 3,
...            hook=lambda start, n, before, after: seen.append((start, n, after.seq_len)))
>>> seen, tuple(run.logits.shape)
([(0, 3, 3), (3, 3, 6), (6, 1, 7)], (1, 7, 97))
>>> torch.allclose(run.logits, model(ids).logits, atol=1e-5)
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .cache import KVCache

Hook = Callable[[int, int, KVCache, KVCache], None]
"""``hook(start, n, before, after)``: after each call, the position it started at, its token
count, the cache passed in and the cache it returned."""


def chunk_lengths(total: int, chunk: int | Sequence[int]) -> list[int]:
    """Split ``total`` tokens into chunks of ``chunk`` (the last may be short) or of given lengths.

    >>> chunk_lengths(24, 5)
    [5, 5, 5, 5, 4]
    >>> chunk_lengths(6, [4, 2])
    [4, 2]
    >>> chunk_lengths(6, [4, 1])
    Traceback (most recent call last):
    ...
    ValueError: chunk lengths [4, 1] must be positive and sum to 6
    """
    if isinstance(chunk, int):
        if chunk < 1:
            raise ValueError(f"chunk size must be positive, got {chunk}")
        return [min(chunk, total - s) for s in range(0, total, chunk)]
    lengths = [int(c) for c in chunk]
    if any(c < 1 for c in lengths) or sum(lengths) != total:
        raise ValueError(f"chunk lengths {lengths} must be positive and sum to {total}")
    return lengths


class Fed(NamedTuple):
    """What :func:`feed` returns."""

    logits: torch.Tensor
    """``[B, T, V]``: the logits of every token fed, chunk after chunk."""
    cache: KVCache
    """The cache after the last chunk."""


@torch.no_grad()
def feed(call: Callable, ids: torch.Tensor, cache: KVCache, chunk: int | Sequence[int], *,
         hook: Hook | None = None) -> Fed:
    """Feed ``ids`` (``[B, T]``, the tokens after what ``cache`` holds) through ``call`` (a
    :class:`~kvdoc.core.model.Decoder`, or any ``(idx, cache) -> (logits, cache)``) in chunks
    (:func:`chunk_lengths`), continuing ``cache``; ``hook`` after each call (:data:`Hook`)."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, T], got {tuple(ids.shape)}")
    out, fed = [], 0
    for n in chunk_lengths(ids.shape[1], chunk):
        logits, after = call(ids[:, fed:fed + n], cache)
        if hook is not None:
            hook(fed, n, cache, after)
        out.append(logits)
        cache, fed = after, fed + n
    return Fed(torch.cat(out, dim=1), cache)
