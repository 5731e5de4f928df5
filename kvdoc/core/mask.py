"""The causal mask for a chunk of new queries that continues a cache.

A call that continues a cache of ``P`` positions with ``C`` new tokens has ``C`` queries at
absolute positions ``P .. P + C - 1`` and ``P + C`` keys at ``0 .. P + C - 1``. Query ``i`` may
read key ``j`` iff ``j <= P + i``: the diagonal is shifted right by ``P``.

PyTorch's ``scaled_dot_product_attention(is_causal=True)`` (and ``torch.tril`` on the
``[C, P + C]`` score matrix) aligns the triangle to the top-left corner instead: it lets query
``i`` read keys ``0 .. i``, i.e. it assumes ``P = 0``, and with one new token lets that token
read key 0 only. That is right for a full forward and wrong whenever ``P > 0``, which is
why the attention builds this mask instead of passing ``is_causal=True``.

A sliding window of ``W`` keys (Mistral) also hides keys that are too old: query ``i`` reads
key ``j`` iff ``P + i - W < j <= P + i``, the convention of transformers' Mistral.
"""

from __future__ import annotations

import torch

from .config import check_int


def offset_causal_mask(past_len: int, new_len: int, device: torch.device | str | None = None,
                       *, window: int | None = None) -> torch.Tensor:
    """Which keys each of ``new_len`` new queries may read after ``past_len`` cached keys.

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
    check_int("past_len", past_len, minimum=0)
    check_int("new_len", new_len)
    if window is not None:
        check_int("window", window)
    query_pos = past_len + torch.arange(new_len, device=device)  # the queries' absolute positions
    key_pos = torch.arange(past_len + new_len, device=device)
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window
    return allowed

def last_keys(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """``mask`` (``[..., C, T]`` bool, True: may read) with each query reading only the last
    ``window`` of the keys it may read (all of them for None).

    A row's readable keys are a run of consecutive positions ending at the query's own (its
    padding or another row's columns hidden), so its last ``W`` are the window ``p - W < j <= p``
    whatever column each position sits in.

    >>> last_keys(torch.tensor([[False, True, True, True]]), window=2).int()
    tensor([[0, 0, 1, 1]], dtype=torch.int32)
    """
    if window is None:
        return mask
    from_right = mask.flip(-1).cumsum(-1).flip(-1)  # readable keys at or after each column
    return mask & (from_right <= window)

