"""Whether transformers' DeepSeek-V3.2 computes one function on its cached and full paths: its
logits three ways, so a page can measure where they part and show that the tie rule is why.

transformers 5.24.0's ``DeepseekV32Indexer.forward`` picks each query's keys with
``index_scores.topk(...)``; ``torch.topk`` orders exactly tied scores by an order that depends on
the length of the row it ranks (:mod:`kvdoc.core.indexed` cites the lines). The full forward ranks
row ``i`` among ``T`` keys, a one-token decode step and a forward of the first ``i + 1`` tokens
among ``i + 1``: where the k-th place is tied they can read different keys.
:func:`kvdoc.interop.hf_deepseek_v32.earliest_ties` breaks ties as kvdoc does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from kvdoc.interop.hf_float64 import float64_islands_lifted
from kvdoc.proofs.compare import max_abs
from kvdoc.teach import crosscheck


def hf_logits(hf: Any, ids: torch.Tensor, chunks: Sequence[int] | None = None) -> torch.Tensor:
    """:func:`kvdoc.teach.crosscheck.hf_logits`, an FP64 model with its float32 islands lifted
    (:func:`~kvdoc.interop.hf_float64.float64_islands_lifted`)."""
    lift = (float64_islands_lifted(hf) if hf.dtype == torch.float64
            else contextlib.nullcontext())
    with torch.no_grad(), lift:
        return crosscheck.hf_logits(hf, ids, chunks)


def prefix_logits(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of a forward of the first ``i + 1`` tokens alone, for every ``i``: what the full
    forward's row ``i`` equals if no row depends on a later token."""
    return torch.cat([hf_logits(hf, ids[:, :i + 1])[:, -1:] for i in range(ids.shape[1])], dim=1)


def path_gaps(hf: Any, ids: torch.Tensor) -> dict[str, float]:
    """``max |path - full forward|`` of transformers' one-token decode and of its forwards of
    each prefix, over ``ids`` ``[B, T]``.

    >>> from kvdoc.core.indexed import IndexedConfig
    >>> from kvdoc.interop.hf_config import random_model
    >>> from kvdoc.interop.hf_deepseek_v32 import v32_config
    >>> hf = random_model(v32_config(IndexedConfig(index_topk=64)),  # k >= T: no choice
    ...                   dtype=torch.float64)
    >>> gaps = path_gaps(hf, torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))
    >>> sorted(gaps), max(gaps.values()) < 1e-12
    (['decode', 'prefix'], True)
    """
    full = hf_logits(hf, ids)
    return {"decode": max_abs(hf_logits(hf, ids, [1] * ids.shape[1]), full),
            "prefix": max_abs(prefix_logits(hf, ids), full)}


def ties_at_k(scores: torch.Tensor, k: int) -> int:
    """Rows of ``scores`` (``[..., T]``, ``-inf`` where a key may not be read) whose k-th and
    (k+1)-th best scores are equal and finite: the rows where a tie rule decides what is read.

    >>> ties_at_k(torch.tensor([[3., 0., 0., -float('inf')], [3., 2., 1., 0.]]), 2)
    1
    """
    if scores.shape[-1] <= k:
        return 0
    ranked = scores.sort(dim=-1, descending=True).values
    return int(((ranked[..., k - 1] == ranked[..., k]) & ranked[..., k].isfinite()).sum())
