"""What attention sums, wrong: a reduction that depends on the chunk, K/V read at FP8 in a half
model, a batch-invariant mode that is invariant but computes another function; a gpt-oss sink
counted once per split, left out of the window layers, or computed outside the mode (each a copy
of a :class:`~kvdoc.core.gptoss.GptOssDecoder` whose attention modules are swapped).

The first two are within every tolerance of the paths they compare: the bits of the first
follow the chunking (only the bitwise ``invariance`` check sees it), the second is wrong the same
way on every path (only the ``bf16`` and ``fp16`` checks against the FP64 value see it).

>>> import torch
>>> from kvdoc import Decoder, GPTConfig, batch_invariant
>>> from kvdoc.proofs.broken.decoders import with_attention
>>> _ = torch.manual_seed(0)
>>> model = with_attention(Decoder(GPTConfig()).eval(), ChunkSplitAttention)
>>> ids = torch.randint(0, 97, (1, 12))
>>> with torch.no_grad(), batch_invariant():
...     full = model(ids).logits
...     _, cache = model(ids[:, :5], model.new_cache(1))
...     rest = model(ids[:, 5:], cache).logits
>>> torch.equal(rest, full[:, 5:]), torch.allclose(rest, full[:, 5:], atol=1e-5, rtol=0)
(False, True)
"""

from __future__ import annotations

import math

import torch

from kvdoc.core import invariant
from kvdoc.core.gptoss import GptOssAttention, GptOssDecoder, sink_attention
from kvdoc.core.model import CausalSelfAttention
from kvdoc.serving.splitk import (
    Partial,
    SinkSplitKAttention,
    all_partials,
    merge,
    partial_attention,
)

from .decoders import copy_as


class ChunkSplitAttention(CausalSelfAttention):
    """BROKEN: cached keys and the chunk's keys as two partial softmaxes, merged as split-K does."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        C, T = q.shape[2], k.shape[2]
        if T == C:  # nothing cached: one pass, as the real attention
            return super().attend(q, k, v, start, attn_mask)
        mask = self.visible(start, C, T, attn_mask, q.device)
        mask = torch.ones(C, T, dtype=torch.bool, device=q.device) if mask is None else mask
        dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)  # no rounding to see
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
        parts = [partial_attention(q, k[:, :, keys], v[:, :, keys], mask[..., keys])
                 for keys in (slice(None, T - C), slice(T - C, None))]  # the split: the chunk
        return merge(parts)[0].to(dtype)


class FP8ReadAttention(CausalSelfAttention):
    """BROKEN: in a BF16 or FP16 model attention reads K and V rounded to FP8 e4m3."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if q.dtype in (torch.bfloat16, torch.float16):  # BUG: 3 mantissa bits of K and V
            k, v = (t.to(torch.float8_e4m3fn).to(q.dtype) for t in (k, v))
        return super().attend(q, k, v, start, attn_mask)


class InvariantTiledAttention(CausalSelfAttention):
    """BROKEN: under :func:`~kvdoc.core.invariant.batch_invariant`, query head ``h`` reads K/V
    head ``h % H_kv`` (tiled), not its group's. One order on every call: bitwise invariant, and
    the same function as outside the mode wherever every head has its own K/V."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if invariant.active() and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)  # BUG: h % H_kv
        return super().attend(q, k, v, start, attn_mask)


class InvariantNarrowAttention(CausalSelfAttention):
    """BROKEN: under the mode, an FP64 model attends in FP32 (every call alike: bitwise
    invariant, and within FP32's tolerance of the function)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if invariant.active() and q.dtype == torch.float64:  # BUG: rounds through FP32
            return super().attend(q.float(), k.float(), v.float(), start,
                                  attn_mask).to(q.dtype)
        return super().attend(q, k, v, start, attn_mask)


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
