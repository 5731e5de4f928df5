"""The checks every call of a decoder makes before it writes anything: the ids' shape, dtype and
device, the length against the model's positions, and the cache against the model and input.

:class:`~kvdoc.core.model.Decoder` and :class:`~kvdoc.core.fast.FastDecoder` call the same
function, so both refuse the same input with the same message. Token ids outside the vocabulary
are refused by the embedding lookup itself (:func:`~kvdoc.core.embed.embed_tokens`), which needs
no host sync.

>>> from kvdoc.core.config import GPTConfig
>>> check_call(GPTConfig(), torch.zeros(97, 64), torch.zeros(1, 3), None)
Traceback (most recent call last):
...
ValueError: idx must hold integer token ids (int64 or int32), got dtype torch.float32
"""

from __future__ import annotations

import torch

from .cache import KVCache
from .config import GPTConfig


def check_call(config: GPTConfig, weight: torch.Tensor, idx: torch.Tensor,
               cache: KVCache | None) -> None:
    """Raise ``ValueError`` unless ``idx`` (``[B, C]``) can continue ``cache`` in a model of
    ``config`` whose embedding ``weight`` sets the device and dtype (the fast step holds
    ``wte``'s weight: two module lookups saved a call)."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"idx must be a [B, C] tensor of token ids, got {shape}")
    if idx.dtype not in (torch.int64, torch.int32):  # what an embedding lookup takes
        raise ValueError("idx must hold integer token ids (int64 or int32), "
                         f"got dtype {idx.dtype}")
    B, C = idx.shape
    if C == 0 or B == 0:
        raise ValueError(f"empty input: idx has shape {tuple(idx.shape)}; "
                         "pass at least one token per row")
    if idx.device != weight.device:
        raise ValueError(f"idx is on {idx.device}, model is on {weight.device}")
    if cache is not None and not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache, got {type(cache).__name__}")
    past = 0 if cache is None else cache.seq_len
    if past + C > config.n_positions:
        raise ValueError(f"sequence too long: {past} cached + {C} new = {past + C} positions, "
                         f"model has {config.n_positions}")
    if cache is not None:
        cache.check_compatible(config, B, weight.dtype, weight.device, C)
