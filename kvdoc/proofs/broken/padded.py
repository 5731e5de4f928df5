"""BROKEN padded batches: ``generate_padded`` without the pad mask on decode steps, and split-K
attention that shows one split the pad keys."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdoc.core.model import Decoder
from kvdoc.serving.batching import (
    PaddedGeneration,
    left_pad,
    padded_mask,
    padded_positions,
)
from kvdoc.serving.splitk import SplitKAttention, split_k_attention

from .decoders import with_attention


@torch.no_grad()
def generate_padded_unmasked_decode(model: Decoder, prompts: Sequence[Sequence[int]],
                                    max_new_tokens: int, pad_id: int = 0) -> PaddedGeneration:
    """BROKEN: ``generate_padded`` whose decode steps pass positions but no pad mask."""
    batch = left_pad(prompts, pad_id)
    device = model.wte.weight.device
    ids, pad = batch.ids.to(device), batch.pad.to(device)
    cache, start, chosen, logits = model.new_cache(ids.shape[0]), 0, [], []
    for step in range(max_new_tokens):
        C = ids.shape[1]
        mask = padded_mask(pad, start, C) if step == 0 else None  # BUG: decode steps unmasked
        out, cache = model(ids, cache, last_only=True, positions=padded_positions(pad, start, C),
                           attn_mask=mask)
        logits.append(out[:, -1])
        ids = out[:, -1].argmax(dim=-1, keepdim=True)
        chosen.append(ids)
        start += C
    return PaddedGeneration(torch.cat(chosen, dim=1), torch.stack(logits, dim=1))


PAD_LEAK_SPLIT = 3  # keys per chunk: a pad of 4 slots spans two chunks


class PadLeakSplitKAttention(SplitKAttention):
    """BROKEN: split-K attention whose first chunk of keys takes the union of the rows' masks,
    so a padded row reads the pad keys there."""

    def __init__(self, config) -> None:
        super().__init__(config, PAD_LEAK_SPLIT)

    def attend(self, q, k, v, start, attn_mask=None):
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        if mask is not None and mask.dim() == 3:  # a mask per row: a padded batch
            mask = mask.clone()
            first = mask[:, :, :self.split]
            mask[:, :, :self.split] = first.any(dim=0)  # BUG: one chunk's mask for all rows
        return split_k_attention(q, k, v, self.split, mask)


def pad_leak_split_k(model: Decoder) -> Decoder:
    return with_attention(model, PadLeakSplitKAttention)
