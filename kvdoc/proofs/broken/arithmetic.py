"""Precision bugs: a reduction that depends on the chunk, K/V read at FP8 in a half model, and a
batch-invariant mode that is invariant but computes another function.

Both are within every tolerance of the paths they compare: the bits of the first follow the
chunking (only the bitwise ``invariance`` check sees it), the second is wrong the same way on
every path (only the ``bf16`` and ``fp16`` checks against the FP64 value see it).

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

import torch

from kvdoc.core import invariant
from kvdoc.core.model import CausalSelfAttention
from kvdoc.serving.splitk import merge, partial_attention


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
