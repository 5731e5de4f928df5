"""Batched generation of prompts of different lengths: left padding, a pad mask, per-row positions.

Left padding lines every prompt's last token up in the last column. Each row is the function
of its prompt alone (:func:`kvdoc.teach.serving_checks.compare_with_alone` checks it): slot
``t`` of row ``b`` is at **position** ``t - pad[b]``, and the **mask** lets a real query read
slots ``pad[b] .. t`` only (a pad query the pad slots before it, so no softmax row is empty).

>>> from kvdoc import Decoder, GPTConfig, generate
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> batch = left_pad([[5, 6, 7], [8]])
>>> batch.ids.tolist(), batch.pad.tolist()
([[5, 6, 7], [0, 0, 8]], [0, 2])
>>> out = generate_padded(model, [[5, 6, 7], [8]], max_new_tokens=4)
>>> torch.equal(out.tokens[1], generate(model, torch.tensor([[8]]), 4)[0, 1:])  # as if alone
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder


@dataclass(frozen=True)
class PaddedBatch:
    """Prompts padded on the left: ``ids`` ``[B, L]``, row ``b`` starting with ``pad[b]`` pads."""

    ids: torch.Tensor
    pad: torch.Tensor


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> PaddedBatch:
    """Pad ``prompts`` (non-empty lists of token ids) on the left to the longest one.

    >>> left_pad([[1, 2], [3, 4, 5]], pad_id=9).ids.tolist()
    [[9, 1, 2], [3, 4, 5]]
    """
    if len(prompts) == 0:
        raise ValueError("left_pad needs at least one prompt")
    rows = [list(p) for p in prompts]
    if any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    if any(isinstance(t, bool) or not isinstance(t, int) for r in rows for t in r):
        raise ValueError("prompts must be lists of integer token ids")
    width = max(len(r) for r in rows)
    pad = [width - len(r) for r in rows]
    ids = torch.tensor([[pad_id] * n + r for n, r in zip(pad, rows, strict=True)])
    return PaddedBatch(ids, torch.tensor(pad))


def padded_positions(pad: torch.Tensor, start: int, new_len: int) -> torch.Tensor:
    """``[B, C]`` positions of slots ``start .. start + C - 1``: slot minus the row's pad, at
    least 0.

    >>> padded_positions(torch.tensor([0, 2]), start=1, new_len=3).tolist()
    [[1, 2, 3], [0, 0, 1]]
    """
    slots = torch.arange(start, start + new_len, device=pad.device)
    return (slots[None, :] - pad[:, None]).clamp(min=0)


def padded_mask(pad: torch.Tensor, start: int, new_len: int) -> torch.Tensor:
    """``[B, C, start + C]`` bool: the key slots each new query slot may read.

    >>> padded_mask(torch.tensor([1]), start=0, new_len=3).int()[0]
    tensor([[1, 0, 0],
            [0, 1, 0],
            [0, 1, 1]], dtype=torch.int32)
    """
    query = torch.arange(start, start + new_len, device=pad.device)  # slots of the new queries
    key = torch.arange(start + new_len, device=pad.device)
    causal = key[None, :] <= query[:, None]  # [C, T]
    real_key = key[None, None, :] >= pad[:, None, None]  # [B, 1, T]
    real_query = query[None, :, None] >= pad[:, None, None]  # [B, C, 1]
    return causal & (real_key == real_query)


@dataclass(frozen=True)
class PaddedGeneration:
    """``tokens`` ``[B, N]`` chosen greedily for each row, and the ``logits`` ``[B, N, V]``."""

    tokens: torch.Tensor
    logits: torch.Tensor


@torch.no_grad()
def generate_padded(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    pad_id: int = 0) -> PaddedGeneration:
    """Greedy generation of ``max_new_tokens`` per row for prompts of different lengths.

    >>> from kvdoc import Decoder, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> out = generate_padded(Decoder(GPTConfig()).eval(), [[1, 2, 3], [4]], 2)
    >>> tuple(out.tokens.shape), tuple(out.logits.shape)
    ((2, 2), (2, 2, 97))
    """
    batch = left_pad(prompts, pad_id)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    device = model.wte.weight.device
    ids, pad = batch.ids.to(device), batch.pad.to(device)
    if ids.shape[1] + max_new_tokens > model.config.n_positions:
        raise ValueError(f"{ids.shape[1]} slots + {max_new_tokens} new tokens exceed the model's "
                         f"{model.config.n_positions} positions")
    cache, start, chosen, logits = model.new_cache(ids.shape[0]), 0, [], []
    for _ in range(max_new_tokens):
        C = ids.shape[1]
        out, cache = model(ids, cache, last_only=True, positions=padded_positions(pad, start, C),
                           attn_mask=padded_mask(pad, start, C))
        logits.append(out[:, -1])
        ids = out[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]: the next call's input
        chosen.append(ids)
        start += C
    return PaddedGeneration(torch.cat(chosen, dim=1), torch.stack(logits, dim=1))
