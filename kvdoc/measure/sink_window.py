"""How far StreamingLLM's logits fall from full attention's: a measurement, not a check.

:mod:`kvdoc.core.streaming` computes another function than the model once a stream evicts its
first token; :func:`divergence` says by how much, position by position, on one stream.

>>> import torch
>>> from kvdoc.core.model import Decoder, llama_config
>>> _ = torch.manual_seed(0)
>>> model = Decoder(llama_config()).eval()
>>> ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
>>> d = divergence(model, ids, sinks=2, window=8)
>>> d.evicts_at, d.before < 1e-5, d.after > 1e-3
(10, True, True)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvdoc.core.model import Decoder
from kvdoc.core.streaming import stream_logits, streaming_decoder


class Divergence(NamedTuple):
    """``per_position`` ``[T]``: the largest ``|logit - full logit|`` over the batch and the
    vocabulary; ``before``, ``after``: its largest before and from ``evicts_at`` (the first
    position whose query reads fewer keys than full attention)."""

    per_position: torch.Tensor
    evicts_at: int
    before: float
    after: float


@torch.no_grad()
def divergence(model: Decoder, ids: torch.Tensor, sinks: int, window: int) -> Divergence:
    """StreamingLLM with ``sinks`` and ``window`` (:func:`kvdoc.core.streaming.streaming_decoder`)
    on ``ids`` (``[B, T]``), fed a token a call, against ``model``'s full forward."""
    full = model(ids).logits
    streamed, _ = stream_logits(streaming_decoder(model, sinks, window), ids)
    per_position = (streamed - full).abs().amax(dim=(0, 2))
    at = min(sinks + window, ids.shape[1])
    return Divergence(per_position, at, float(per_position[:at].max()),
                      float(per_position[at:].max()) if ids.shape[1] > at else 0.0)
