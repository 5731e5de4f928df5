"""Split-K attention (Flash-Decoding): keys in chunks, a partial softmax per chunk, merged exactly.

A decode step's ``B * H`` query rows are too few to fill a GPU; splitting the ``T`` cached keys
into chunks of ``S`` gives ``B * H * ceil(T / S)`` pieces, each returning its unnormalised
output, its largest score ``m`` and the sum ``l`` of ``exp(score - m)``, which merge exactly:

    m = max_c m_c,   l = sum_c l_c exp(m_c - m),   out = sum_c o_c exp(m_c - m) / l

where ``o_c = sum_j exp(s_j - m_c) v_j`` over chunk ``c``: an identity, not an approximation,
up to the rounding of another summation order. A sink logit per head (gpt-oss) enters the merge
once, as a chunk of its own (``m_s = s``, ``l_s = 1``, ``o_s = 0``), never inside each chunk's.

Shapes: ``q`` ``[B, H, C, D_h]``, ``k`` and ``v`` ``[B, H_kv, T, D_h]``, ``mask`` ``[C, T]`` bool
(True: may read) or ``[B, C, T]``. :func:`split_k_decoder` builds a copy of a model that attends
that way; under :func:`kvdoc.batch_invariant` it attends key by key, as
:func:`kvdoc.core.invariant.attention` does: a split count chosen for the chip must not change
the bits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvdoc.core import invariant
from kvdoc.core.cache import check_int
from kvdoc.core.gptoss import GptOssAttention, GptOssConfig, GptOssDecoder
from kvdoc.core.model import CausalSelfAttention, Decoder, GPTConfig


class Partial(NamedTuple):
    """One chunk's share, what a split-K kernel writes: ``out`` ``[B, H, C, D_h]`` before dividing
    by ``l`` ``[B, H, C]``; ``m`` ``[B, H, C]``, the largest visible score (none: ``-inf``)."""

    out: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the name the papers use)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None) -> Partial:
    """Attention of ``q`` over one chunk of keys, unnormalised, with its max and sum (the keys
    as :func:`all_partials`' one chunk).

    >>> q, k, v = torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 3, 2), torch.ones(1, 1, 3, 2)
    >>> part = partial_attention(q, k, v)   # three equal scores of 0
    >>> part.m.item(), part.l.item(), part.out.flatten().tolist()
    (0.0, 3.0, [3.0, 3.0])
    """
    return Partial(*(x[0] for x in all_partials(q, k, v, k.shape[2], mask)))


def merge(parts: list[Partial] | Partial,
          sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials (a list, or one :class:`Partial` with the chunks along a leading
    dimension) into the output ``[B, H, C, D_h]`` and its log-sum-exp ``[B, H, C]``; ``sinks``
    (``[H]``) join the denominator once, after the chunks.

    >>> q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    >>> out, _ = merge([partial_attention(q, k[:, :, :2], v[:, :, :2]),
    ...                 partial_attention(q, k[:, :, 2:], v[:, :, 2:])])
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> torch.allclose(out, ref, atol=1e-6)
    True
    """
    if not isinstance(parts, Partial):
        if not parts:
            raise ValueError("merge needs at least one partial")
        parts = Partial(*(torch.stack(field) for field in zip(*parts, strict=True)))
    m = parts.m.amax(dim=0)  # [B, H, C]
    if sinks is not None:  # a chunk of its own: max s, sum exp(s - s) = 1, no value
        sink = sinks.to(m.dtype).view(-1, 1).expand_as(m)
        m = torch.maximum(m, sink)
    if m.isinf().any():
        raise ValueError("a query row reads no key in any chunk; its softmax is undefined")
    w = torch.exp(parts.m - m)  # [chunks, B, H, C]; exp(-inf) = 0 for a chunk that hid everything
    l = (w * parts.l).sum(dim=0)  # noqa: E741
    if sinks is not None:
        l = l + torch.exp(sink - m)  # noqa: E741 (once, whatever the number of chunks)
    out = (w[..., None] * parts.out).sum(dim=0)
    return out / l[..., None], m + torch.log(l)


def all_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: int,
                 mask: torch.Tensor | None = None) -> Partial:
    """Every chunk's share at once (chunks first), the keys padded to whole chunks; ``mask``
    ``[C, T]``, or ``[B, C, T]`` per row."""
    B, H, C, D = q.shape
    H_kv, T = k.shape[1], k.shape[2]
    n = math.ceil(T / split)
    pad = n * split - T
    visible = torch.ones(C, T, dtype=torch.bool, device=q.device) if mask is None else mask
    visible = F.pad(visible, (0, pad))  # padded keys are never visible
    if visible.dim() == 2:  # [C, n S] -> [n, 1, C, S], against scores [B, H_kv, n, g, C, S]
        rows = visible.view(C, n, split).transpose(0, 1)[:, None]
    else:  # a mask per row: [B, C, n S] -> [B, 1, n, 1, C, S]
        rows = visible.view(B, C, n, split).transpose(1, 2)[:, None, :, None]
    k = F.pad(k, (0, 0, 0, pad)).view(B, H_kv, n, split, D)
    v = F.pad(v, (0, 0, 0, pad)).view(B, H_kv, n, split, D)
    qg = q.reshape(B, H_kv, 1, (H // H_kv) * C, D)  # a K/V head's query rows side by side
    scores = (qg @ k.transpose(-1, -2)).mul_(1.0 / math.sqrt(D))  # [B, H_kv, n, g C, S]
    scores = scores.view(B, H_kv, n, H // H_kv, C, split).masked_fill(~rows, -math.inf)
    m = scores.amax(dim=-1)  # [B, H_kv, n, g, C]
    # a chunk that hides every key from a row has m = -inf; shift by 0 there: exp gives 0, not NaN
    p = torch.exp(scores - torch.where(m.isinf(), 0.0, m)[..., None])
    out = p.view(B, H_kv, n, -1, split) @ v  # [B, H_kv, n, g C, D]

    # [B, H_kv, n, ...] -> [n, B, H, ...]
    def chunks_first(x: torch.Tensor, *tail: int) -> torch.Tensor:
        return x.movedim(2, 0).reshape(n, B, H, *tail)
    return Partial(chunks_first(out, C, D), chunks_first(m, C), chunks_first(p.sum(dim=-1), C))


def split_k_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: int,
                      mask: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D_h) + mask) v`` over chunks of ``split`` keys (which need not
    divide ``T``); with ``sinks`` (``[H]``), :func:`kvdoc.core.gptoss.sink_attention`'s.

    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(1, 4, 1, 8, generator=g)                      # one decode query, 4 heads
    >>> k, v = torch.randn(2, 1, 2, 10, 8, generator=g)               # 2 K/V heads, 10 keys
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    >>> torch.allclose(split_k_attention(q, k, v, split=3), ref, atol=1e-6)  # 3 does not divide 10
    True
    >>> from kvdoc.core.gptoss import sink_attention
    >>> sinks = torch.randn(4, generator=g)
    >>> torch.allclose(split_k_attention(q, k, v, 3, sinks=sinks),
    ...                sink_attention(q, k, v, sinks), atol=1e-6)
    True
    """
    check_int("split", split)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [B, H, C, D_h] and k, v both [B, H_kv, T, D_h], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, C, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or k.shape[1] == 0 or H % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}: batch and head size "
                         "must match, and H must be a multiple of H_kv")
    T = k.shape[2]
    if mask is not None and tuple(mask.shape) not in ((C, T), (B, C, T)):
        raise ValueError(f"mask must be [C, T] = [{C}, {T}] or [B, C, T], got {tuple(mask.shape)}")
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise ValueError(f"sinks must be [H] = [{H}], got {tuple(sinks.shape)}")
    return merge(all_partials(q, k, v, split, mask), sinks)[0]


class SplitKAttention(CausalSelfAttention):
    """The decoder's attention with softmax over chunks of ``split`` keys, merged exactly."""

    def __init__(self, config: GPTConfig, split: int) -> None:
        super().__init__(config)
        self.split = check_int("split", split)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        # the model's own mask: [C, T], [B, C, T] per row (its window applied), or None
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        if invariant.active():  # the mode fixes the order of the keys, not the split count
            return invariant.attention(q, k, v, mask)
        return split_k_attention(q, k, v, self.split, mask)


class SinkSplitKAttention(GptOssAttention):
    """gpt-oss's attention over chunks of ``split`` keys, the sinks merged once."""

    def __init__(self, config: GptOssConfig, layer_idx: int, split: int) -> None:
        super().__init__(config, layer_idx)
        self.split = check_int("split", split)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        return split_k_attention(q, k, v, self.split, mask, self.sinks)


def split_k_decoder(model: Decoder, split: int) -> Decoder:
    """A copy of ``model`` (weights, dtype, device) whose attention is :class:`SplitKAttention`
    (:class:`SinkSplitKAttention` for a :class:`~kvdoc.core.gptoss.GptOssDecoder`).

    >>> from kvdoc import GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig()).eval()
    >>> ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    >>> torch.allclose(split_k_decoder(model, 3)(ids).logits, model(ids).logits, atol=1e-5)
    True
    """
    weight = model.wte.weight
    with torch.random.fork_rng():  # the fresh weights are overwritten: leave the global RNG alone
        if isinstance(model, GptOssDecoder):
            clone = GptOssDecoder(model.config)
            for i, block in enumerate(clone.h):
                block.self_attn = SinkSplitKAttention(model.config, i, split)
        else:
            clone = Decoder(model.config)
            for block in clone.h:
                block.attn = SplitKAttention(model.config, split)
    clone.load_state_dict(model.state_dict())
    return clone.to(weight.dtype).to(weight.device).eval()
