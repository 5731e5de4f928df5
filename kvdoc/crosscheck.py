"""kvdoc against Hugging Face transformers' GPT-2 on the same random weights.

:func:`cross_check_transformers` builds a random ``GPT2LMHeadModel``, loads its weights into a
:class:`~kvdoc.model.Decoder`, and compares logits: kvdoc's full forward and cached runs against
transformers' full forward, and transformers' own cached decode against its full forward. The
verification suite runs the same comparison as its ``reference`` check for the MHA model
(:func:`kvdoc.references.transformers_reference`), on the longer stream, in FP32 and FP64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import model as _model
from .config import GPTConfig
from .verify import _max_abs, default_stream, run_cached


@dataclass(frozen=True)
class CrossCheck:
    """kvdoc against transformers' GPT-2 on the same random weights (max absolute logit errors).

    Attributes:
        n_parameters: parameter count of (kvdoc, transformers).
        full: kvdoc full forward vs transformers' full forward.
        cached: ``(kind, chunk) ->`` kvdoc cached path vs transformers' full forward.
        hf_cached: transformers' own cached decode (prefill ``prefill_len``, then one token at a
            time) vs transformers' full forward.
        prefill_len: tokens in transformers' prefill.
        logit_scale: ``max |logits|`` of transformers' full forward (the weights are not degenerate).
    """

    n_parameters: tuple[int, int]
    full: float
    cached: dict[tuple[str, int], float]
    hf_cached: float
    prefill_len: int
    logit_scale: float


@torch.no_grad()
def cross_check_transformers(seed: int = 0, ids: torch.Tensor | None = None, chunks: Sequence[int] = (1, 2, 5),
                             kinds: Sequence[str] = ("dynamic", "static"), prefill_len: int = 8,
                             dtype: torch.dtype = torch.float32) -> CrossCheck:
    """Build a random transformers ``GPT2LMHeadModel``, load its weights into kvdoc, compare logits.

    Args:
        seed: ``torch.manual_seed`` before building the transformers model.
        ids: the stream ``[B, T]`` (default :func:`default_stream`).
        chunks, kinds: kvdoc's cached runs.
        prefill_len: tokens in transformers' own prefill before one-token decode steps.

    Returns:
        A :class:`CrossCheck`.
    """
    from transformers import GPT2LMHeadModel

    from .interop import gpt2_config

    ids = default_stream() if ids is None else ids
    if not 0 < prefill_len < ids.shape[1]:
        raise ValueError(f"prefill_len must be between 1 and {ids.shape[1] - 1}, got {prefill_len}")
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(gpt2_config(GPTConfig())).to(dtype).eval()
    ours = _model.Decoder.from_gpt2(hf)
    expected = hf(ids).logits
    cached = {(kind, c): _max_abs(run_cached(ours, ids, c, kind).logits, expected) for kind in kinds for c in chunks}
    out = hf(ids[:, :prefill_len], use_cache=True)
    logits, cache = [out.logits], out.cache
    for t in range(prefill_len, ids.shape[1]):
        out = hf(ids[:, t:t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
        cache = out.cache
    return CrossCheck((sum(p.numel() for p in hf.parameters()), ours.num_parameters()),
                      _max_abs(ours(ids).logits, expected), cached,
                      _max_abs(torch.cat(logits, dim=1), expected), prefill_len,
                      float(expected.abs().max().item()))
