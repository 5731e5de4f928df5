"""The causal mask for a chunk of new queries that continues a cache.

A call that continues a cache of ``P`` positions with ``C`` new tokens has ``C`` queries at
absolute positions ``P .. P + C - 1`` and ``P + C`` keys at ``0 .. P + C - 1``. Query ``i`` may
read key ``j`` iff ``j <= P + i``: the diagonal is shifted right by ``P``.

PyTorch's ``scaled_dot_product_attention(is_causal=True)`` (and ``torch.tril`` on the
``[C, P + C]`` score matrix) aligns the triangle to the top-left corner instead, i.e. it
assumes ``P = 0``; with one new token it lets that token read key 0 only.

A sliding window of ``W`` keys (Mistral) also hides keys that are too old: query ``i`` reads
key ``j`` iff ``P + i - W < j <= P + i``, the convention of transformers' Mistral.
"""

from __future__ import annotations

import torch

from .config import check_int


def _check_lengths(past_len: int, new_len: int) -> None:
    check_int("past_len", past_len, minimum=0)
    check_int("new_len", new_len)


def offset_causal_mask(past_len: int, new_len: int, device: torch.device | str | None = None, *,
                       window: int | None = None) -> torch.Tensor:
    """Which keys each new query may read, for ``new_len`` queries after ``past_len`` cached keys.

    Args:
        past_len: ``P``, positions already in the cache (0 for a full forward).
        new_len: ``C``, new tokens in this call (at least 1).
        device: where to build the mask.
        window: ``W``, the most keys a query reads (its own included), or None for no limit.

    Returns:
        A bool tensor ``[C, P + C]``; ``mask[i, j]`` is True iff key ``j`` is visible to
        query ``i``, i.e. ``j <= P + i`` (and ``j > P + i - W`` with a window).

    >>> offset_causal_mask(2, 2).int()
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    >>> offset_causal_mask(2, 2, window=2).int()
    tensor([[0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    _check_lengths(past_len, new_len)
    if window is not None:
        check_int("window", window)
    query_pos = past_len + torch.arange(new_len, device=device)  # absolute positions of the queries
    key_pos = torch.arange(past_len + new_len, device=device)
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window
    return allowed


def top_left_causal_mask(past_len: int, new_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The mask that ``is_causal=True`` builds for ``C`` queries over ``P + C`` keys: wrong when ``P > 0``.

    Kept for contrast: it is ``tril`` of the ``[C, P + C]`` matrix, so local query ``i`` is
    treated as absolute position ``i``.

    >>> top_left_causal_mask(2, 2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0]], dtype=torch.int32)
    """
    _check_lengths(past_len, new_len)
    return torch.ones(new_len, past_len + new_len, dtype=torch.bool, device=device).tril()
