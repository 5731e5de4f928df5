"""Where two computations part, measured (observations on particular prompts and weights, not
bounds): the first step two greedy generations choose differently, and how close the
reference's two best logits were there (:func:`precision_divergence`); how far StreamingLLM's
logits fall from full attention's once it evicts (:func:`stream_divergence`).

>>> import torch
>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> [d] = precision_divergence(Decoder(GPTConfig()).eval(), [torch.tensor([[1, 2, 3]])], 8,
...                            torch.float32)
>>> d.steps, 0 <= d.first <= 8
(8, True)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvdoc.core.cache import KVCache
from kvdoc.core.model import Decoder
from kvdoc.core.streaming import stream_logits, streaming_decoder


class Divergence(NamedTuple):
    """One pair of greedy generations of ``steps`` tokens."""

    steps: int
    first: int
    """Index of the first token that differs (``steps``: none did)."""
    margin: float | None
    """The reference's best logit minus its second best at that token (None: none differed)."""


def greedy_with_gaps(call: Callable, prompt: torch.Tensor, steps: int,
                     cache: KVCache) -> tuple[torch.Tensor, list[float]]:
    """``steps`` greedy tokens after ``prompt`` over ``cache`` and the gap between the two best
    logits at each; ``call(ids, cache, last_only=...)``: a model or a fused decoder of it."""
    logits, cache = call(prompt, cache, last_only=True)
    tokens, gaps = [], []
    for _ in range(steps):
        tokens.append(logits[:, -1].argmax(dim=-1, keepdim=True))
        top = logits[0, -1].topk(2).values
        gaps.append(float(top[0] - top[1]))
        logits, cache = call(tokens[-1], cache)
    return torch.cat(tokens, dim=1)[0], gaps


def divergence(reference: torch.Tensor, gaps: Sequence[float],
               other: torch.Tensor) -> Divergence:
    """Where ``other``'s tokens first differ from ``reference``'s (whose gaps are ``gaps``).

    >>> divergence(torch.tensor([1, 2, 3]), [0.5, 0.01, 0.2], torch.tensor([1, 4, 3]))
    Divergence(steps=3, first=1, margin=0.01)
    """
    differ = (reference != other).nonzero()
    at = int(differ[0]) if len(differ) else len(reference)
    return Divergence(len(reference), at, gaps[at] if at < len(reference) else None)


@torch.no_grad()
def precision_divergence(model: torch.nn.Module, prompts: Sequence[torch.Tensor], steps: int,
                         dtype: torch.dtype,
                         reference_dtype: torch.dtype = torch.float64) -> list[Divergence]:
    """Per prompt, greedy decoding in ``dtype`` against the same weights in ``reference_dtype``."""
    low = copy.deepcopy(model).to(dtype).eval()
    high = copy.deepcopy(low).to(reference_dtype)
    out = []
    for prompt in prompts:
        want, gaps = greedy_with_gaps(high, prompt, steps, high.new_cache(1))
        got, _ = greedy_with_gaps(low, prompt, steps, low.new_cache(1))
        out.append(divergence(want, gaps, got))
    return out


class StreamDivergence(NamedTuple):
    """``per_position`` ``[T]``: the largest ``|logit - full logit|`` over the batch and the
    vocabulary; ``before``, ``after``: its largest before and from ``evicts_at`` (the first
    position whose query reads fewer keys than full attention)."""

    per_position: torch.Tensor
    evicts_at: int
    before: float
    after: float


@torch.no_grad()
def stream_divergence(model: Decoder, ids: torch.Tensor, sinks: int,
                      window: int) -> StreamDivergence:
    """StreamingLLM with ``sinks`` and ``window`` on ``ids`` (``[B, T]``), fed a token a call,
    against ``model``'s full forward.

    >>> from kvdoc.core.model import llama_config
    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(llama_config()).eval()
    >>> ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    >>> d = stream_divergence(model, ids, sinks=2, window=8)
    >>> d.evicts_at, d.before < 1e-5, d.after > 1e-3
    (10, True, True)
    """
    full = model(ids).logits
    streamed, _ = stream_logits(streaming_decoder(model, sinks, window), ids)
    per_position = (streamed - full).abs().amax(dim=(0, 2))
    at = min(sinks + window, ids.shape[1])
    return StreamDivergence(per_position, at, float(per_position[:at].max()),
                            float(per_position[at:].max()) if ids.shape[1] > at else 0.0)
