"""The source's 4 + 2 experiment: feed a prompt as some tokens, then the rest, and measure how
far the new positions' logits move from one full forward, for the model or a broken variant.

>>> from kvdoc.proofs.compare import default_model, default_stream
>>> model, ids = default_model(), default_stream(batch=1, length=6)
>>> split_error(model, ids, 4) < 1e-5, split_error(model, ids, 4, "positions-restart") > 1e-2
(True, True)
"""

from __future__ import annotations

import torch

from kvdoc.core.model import Decoder
from kvdoc.proofs.broken.decoders import stale_prefix
from kvdoc.proofs.compare import max_abs, run_cached
from kvdoc.proofs.variants import VARIANTS


@torch.no_grad()
def split_error(model: Decoder, ids: torch.Tensor, cached: int, variant: str | None = None,
                kind: str = "dynamic") -> float:
    """Max logit error of the new positions when ``ids`` ``[B, T]`` is fed as ``cached`` tokens,
    then the rest (the source's 4 + 2 experiment), by the model or a broken ``variant``."""
    if not 0 < cached < ids.shape[1]:
        raise ValueError(f"cached must be between 1 and {ids.shape[1] - 1}, got {cached}")
    broken = None if variant is None else VARIANTS[variant]
    under_test = model if broken is None else broken.build(model)
    stale = broken is not None and broken.stale_prefix
    first = stale_prefix(ids, model.config.vocab_size) if stale else None
    run = run_cached(under_test, ids, [cached, ids.shape[1] - cached], kind, first_chunk_ids=first)
    return max_abs(run.logits[:, cached:], model(ids).logits[:, cached:])
