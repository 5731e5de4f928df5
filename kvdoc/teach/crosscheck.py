"""kvdoc against Hugging Face transformers on the same random weights.

:func:`match_transformers` compares logits over one stream: kvdoc's full forward and cached
runs against transformers' full forward, and transformers' own cached decode against the same.
The verification suite's ``reference`` check runs the same comparison.
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
