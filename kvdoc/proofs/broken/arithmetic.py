"""What attention sums, wrong: K/V read at FP8 in a half model (wrong the same way on every
path, within every tolerance of the paths it compares: only the ``bf16`` and ``fp16`` checks
against the FP64 value see it), a batch-invariant mode that is invariant but computes another
function; a gpt-oss sink counted once per split, left out of the window layers, or computed
outside the mode (each a copy of a :class:`~kvdoc.core.gptoss.GptOssDecoder` whose attention
modules are swapped).
"""

from __future__ import annotations

import math

import torch

from kvdoc.core import invariant
from kvdoc.core.gptoss import GptOssAttention, GptOssDecoder, sink_attention
from kvdoc.core.model import CausalSelfAttention
from kvdoc.serving.splitk import Partial, SinkSplitKAttention, all_partials, merge

from .decoders import copy_as


class FP8ReadAttention(CausalSelfAttention):
    """BROKEN: in a BF16 or FP16 model attention reads K and V rounded to FP8 e4m3."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if q.dtype in (torch.bfloat16, torch.float16):  # BUG: 3 mantissa bits of K and V
            k, v = (t.to(torch.float8_e4m3fn).to(q.dtype) for t in (k, v))
        return super().attend(q, k, v, start, attn_mask)


class InvariantTiledAttention(CausalSelfAttention):
    """BROKEN: under :func:`~kvdoc.core.invariant.batch_invariant`, query head ``h`` reads K/V
    head ``h % H_kv`` (tiled), not its group's."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if invariant.active() and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)  # BUG: h % H_kv
        return super().attend(q, k, v, start, attn_mask)


class InvariantNarrowAttention(CausalSelfAttention):
    """BROKEN: under the mode, an FP64 model attends in FP32."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if invariant.active() and q.dtype == torch.float64:  # BUG: rounds through FP32
            return super().attend(q.float(), k.float(), v.float(), start,
                                  attn_mask).to(q.dtype)
        return super().attend(q, k, v, start, attn_mask)


SINK_SPLIT = 5  # keys per chunk: the default stream of 67 spans 14 chunks


def merge_sink_per_split(parts: Partial, sinks: torch.Tensor) -> torch.Tensor:
    """BROKEN: each chunk folds the sink into its own partial, so a row's denominator holds it
    once per chunk."""
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
    """BROKEN: under ``batch_invariant()`` the sink attention runs the library's kernels."""

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
