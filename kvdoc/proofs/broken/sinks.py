"""BROKEN sinks: split-K attention that counts the sink once per split, a gpt-oss model whose
window layers attend without their sink, and one whose sink attention ignores the batch-invariant
mode.

Each is a copy of a :class:`~kvdoc.core.gptoss.GptOssDecoder` (weights, dtype, device) whose
attention modules are swapped for a subclass that gets one thing wrong.
"""

from __future__ import annotations

import math

import torch

from kvdoc.core import invariant
from kvdoc.core.gptoss import GptOssAttention, GptOssDecoder, sink_attention
from kvdoc.serving.splitk import Partial, SinkSplitKAttention, all_partials, merge

from .decoders import copy_as

SINK_SPLIT = 5  # keys per chunk: the default stream of 67 spans 14 chunks


def merge_sink_per_split(parts: Partial, sinks: torch.Tensor) -> torch.Tensor:
    """BROKEN: each chunk folds the sink into its own partial (as a kernel that adds the sink
    where it finishes a chunk would), so a row's denominator holds it once per chunk."""
    sink = sinks.to(parts.m.dtype).view(-1, 1).expand_as(parts.m)  # [chunks, B, H, C]
    m = torch.maximum(parts.m, sink)
    kept = torch.exp(parts.m - m)
    folded = Partial(parts.out * kept[..., None], m, parts.l * kept + torch.exp(sink - m))
    return merge(folded)[0]


class SinkPerSplitAttention(SinkSplitKAttention):
    """BROKEN: :class:`~kvdoc.serving.splitk.SinkSplitKAttention` whose sink enters every
    chunk's partial (:func:`merge_sink_per_split`)."""

    def attend(self, q, k, v, start, attn_mask=None):
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        return merge_sink_per_split(all_partials(q, k, v, self.split, mask), self.sinks)


class WindowWithoutSinkAttention(GptOssAttention):
    """BROKEN: a window layer's softmax has no sink (a sink of ``-inf``); full layers keep it."""

    def attend(self, q, k, v, start, attn_mask=None):
        if self.window is None:
            return super().attend(q, k, v, start, attn_mask)
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        return sink_attention(q, k, v, torch.full_like(self.sinks, -math.inf), mask)


class SinkOutsideModeAttention(GptOssAttention):
    """BROKEN: under ``batch_invariant()`` the sink attention still runs the library's batched
    matmul and softmax (the right function; its bits follow the call's shape)."""

    def attend(self, q, k, v, start, attn_mask=None):
        before, invariant._ACTIVE = invariant._ACTIVE, False  # BUG: the mode not read here
        try:
            return super().attend(q, k, v, start, attn_mask)
        finally:
            invariant._ACTIVE = before


def _with(model: GptOssDecoder, make) -> GptOssDecoder:
    """A copy of ``model`` whose attention of layer ``i`` is ``make(config, i)``."""
    clone = copy_as(model, GptOssDecoder)
    weight = model.wte.weight
    for i, block in enumerate(clone.h):
        with torch.random.fork_rng():
            attn = make(model.config, i).to(weight.dtype).to(weight.device)
        attn.load_state_dict(block.self_attn.state_dict())
        block.self_attn = attn
    return clone


def sink_per_split(model: GptOssDecoder) -> GptOssDecoder:
    return _with(model, lambda config, i: SinkPerSplitAttention(config, i, SINK_SPLIT))


def window_without_sink(model: GptOssDecoder) -> GptOssDecoder:
    return _with(model, WindowWithoutSinkAttention)


def sink_outside_mode(model: GptOssDecoder) -> GptOssDecoder:
    return _with(model, SinkOutsideModeAttention)
