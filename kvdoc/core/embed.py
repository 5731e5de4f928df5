"""Token ids into vectors: the embedding lookup, refusing an id outside the vocabulary by name."""

from __future__ import annotations

import torch
from torch import nn


def embed_tokens(wte: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    """``wte(idx)``, with an id outside the vocabulary refused as a ``ValueError`` naming it.

    The lookup itself finds a bad id, so valid input costs no host sync; only a refusal
    reads the ids back to name the offender.

    >>> embed_tokens(nn.Embedding(5, 2), torch.tensor([[1, 7]]))
    Traceback (most recent call last):
    ...
    ValueError: token id 7 is outside the vocabulary 0..4
    """
    try:
        return wte(idx)  # [B, C] -> [B, C, d]
    except IndexError:
        vocab = wte.num_embeddings
        lo, hi = (int(t) for t in idx.aminmax())
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary 0..{vocab - 1}") from None
