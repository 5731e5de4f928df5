"""kvdoc against Hugging Face transformers on the same random weights.

:func:`match_transformers` compares logits over one stream: kvdoc's full forward and cached
runs against transformers' full forward, and transformers' own cached decode against the same.
The verification suite's ``reference`` check runs the same comparison.

Whether transformers' DeepSeek-V3.2 computes one function on its cached and full paths
(:func:`path_gaps`): its ``DeepseekV32Indexer.forward`` (transformers 5.24.0) picks each query's
keys with ``index_scores.topk(...)``, and ``torch.topk`` orders exactly tied scores by an order
that depends on the length of the row it ranks (:mod:`kvdoc.core.indexed` cites the lines). The
full forward ranks row ``i`` among ``T`` keys, a one-token decode step and a forward of the first
``i + 1`` tokens among ``i + 1``: where the k-th place is tied they can read different keys.
:func:`kvdoc.interop.hf_deepseek_v32.earliest_ties` breaks ties as kvdoc does.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from kvdoc.interop.hf_float64 import float64_islands_lifted
from kvdoc.interop.hf_weights import from_transformers
from kvdoc.proofs.compare import DTYPE_NAMES, max_abs, run_cached


@dataclass(frozen=True)
class TransformersMatch:
    """kvdoc against one transformers model on one stream: the largest logit differences of
    kvdoc's ``full`` forward and its ``cached`` runs (by cache kind and chunk) against
    transformers' full forward, and of transformers' own cache (``hf_cached``: ``prefill_len``
    tokens, then one at a time) against the same. ``lifted``: transformers ran with its float32
    RMSNorm/RoPE lifted to the model's dtype."""

    family: str
    dtype: str
    n_parameters: tuple[int, int]
    full: float
    cached: dict[tuple[str, int], float]
    hf_cached: float
    logit_scale: float
    lifted: bool
    prefill_len: int

    def worst(self) -> float:
        """The largest error of kvdoc's paths, full and cached."""
        return max(self.full, *self.cached.values())


def hf_logits(hf_model: Any, ids: torch.Tensor,
              chunks: Sequence[int] | None = None) -> torch.Tensor:
    """transformers' logits of ``ids`` (``[B, T]``): one full forward, or its own
    cache fed ``chunks`` (token counts, in order)."""
    if chunks is None:
        return hf_model(ids).logits
    logits, cache, start = [], None, 0
    for n in chunks:
        out = hf_model(ids[:, start:start + n], cache=cache, use_cache=True)
        logits.append(out.logits)
        cache, start = out.cache, start + n
    return torch.cat(logits, dim=1)


@torch.no_grad()
def match_transformers(hf_model: Any, ids: torch.Tensor, chunks: Sequence[int] = (1, 5),
                       kinds: Sequence[str] | None = None, prefill_len: int = 8,
                       lift: bool | None = None) -> TransformersMatch:
    """Load ``hf_model`` (a transformers model ``from_transformers`` takes, FP32
    or FP64) into kvdoc and compare logits over ``ids`` (``[B, T]``): kvdoc's cached
    runs in chunks of ``chunks`` for each of ``kinds`` (default dynamic, static, and
    window with a window); transformers with its float32 islands lifted
    (:func:`~kvdoc.interop.hf_float64.float64_islands_lifted`) if ``lift``
    (default: in FP64).

    >>> from transformers import MistralForCausalLM
    >>> from kvdoc.core.model import mistral_config
    >>> from kvdoc.interop.hf_config import transformers_config
    >>> _ = torch.manual_seed(0)
    >>> config = transformers_config(mistral_config(sliding_window=4))
    >>> hf = MistralForCausalLM(config).eval()
    >>> ids = torch.tensor([[5, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    >>> m = match_transformers(hf, ids, prefill_len=3)
    >>> sorted(kind for kind, chunk in m.cached if chunk == 1), m.worst() < 1e-5
    (['dynamic', 'static', 'window'], True)
    """
    if not 0 < prefill_len < ids.shape[1]:
        raise ValueError(f"prefill_len must be between 1 and {ids.shape[1] - 1}, "
                         f"got {prefill_len}")
    ours = from_transformers(hf_model)
    dtype = ours.wte.weight.dtype
    lift = dtype == torch.float64 if lift is None else lift
    if kinds is None:
        windowed = ours.config.sliding_window is not None
        kinds = ("dynamic", "static") + (("window",) if windowed else ())
    with float64_islands_lifted(hf_model) if lift else nullcontext():
        steps = [prefill_len] + [1] * (ids.shape[1] - prefill_len)  # as served: prefill, decode
        expected, hf_cached = hf_logits(hf_model, ids), hf_logits(hf_model, ids, steps)
    cached = {(kind, c): max_abs(run_cached(ours, ids, c, kind).logits, expected)
              for kind in kinds for c in chunks}
    family = hf_model.config.model_type
    n_hf = sum(p.numel() for p in hf_model.parameters())
    return TransformersMatch(
        family, DTYPE_NAMES[dtype], (n_hf, ours.num_parameters()),
        max_abs(ours(ids).logits, expected), cached,
        max_abs(hf_cached, expected),
        float(expected.abs().max().item()), lift and family != "gpt2",
        prefill_len)


def lifted_logits(hf: Any, ids: torch.Tensor, chunks: Sequence[int] | None = None
                  ) -> torch.Tensor:
    """:func:`hf_logits` without autograd, an FP64 model with its float32 islands lifted
    (:func:`~kvdoc.interop.hf_float64.float64_islands_lifted`)."""
    lift = float64_islands_lifted(hf) if hf.dtype == torch.float64 else nullcontext()
    with torch.no_grad(), lift:
        return hf_logits(hf, ids, chunks)


def path_gaps(hf: Any, ids: torch.Tensor) -> dict[str, float]:
    """``max |path - full forward|`` of transformers' one-token decode and of its forwards of
    each prefix alone (row ``i`` of a forward of the first ``i + 1`` tokens: what the full
    forward's row ``i`` equals if no row depends on a later token), over ``ids`` ``[B, T]``.

    >>> from kvdoc.core.indexed import IndexedConfig
    >>> from kvdoc.interop.hf_config import random_model
    >>> from kvdoc.interop.hf_deepseek_v32 import v32_config
    >>> hf = random_model(v32_config(IndexedConfig(index_topk=64)),  # k >= T: no choice
    ...                   dtype=torch.float64)
    >>> gaps = path_gaps(hf, torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))
    >>> sorted(gaps), max(gaps.values()) < 1e-12
    (['decode', 'prefix'], True)
    """
    full = lifted_logits(hf, ids)
    prefixes = torch.cat([lifted_logits(hf, ids[:, :i + 1])[:, -1:] for i in range(ids.shape[1])],
                         dim=1)
    return {"decode": max_abs(lifted_logits(hf, ids, [1] * ids.shape[1]), full),
            "prefix": max_abs(prefixes, full)}
