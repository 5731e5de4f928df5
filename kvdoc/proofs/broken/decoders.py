"""Deliberately wrong decoders: positions, masks, grouped-query attention, generation, padded
batches (split-K reading pad keys too), a stale fast step. Each changes the real
:class:`~kvdoc.core.model.Decoder` through its public interface only (the ``positions=``
keyword, ``attend``, the fast step's staleness test).

>>> import torch
>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> full, split = cached_only(copy_as(model, PositionsRestartDecoder), model)
>>> full, split > 1e-2   # the cached call numbers its tokens 0, 1 instead of 4, 5
(0.0, True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvdoc.core import invariant
from kvdoc.core.cache import KVCache, check_int
from kvdoc.core.fast import FastDecoder
from kvdoc.core.model import CausalSelfAttention, Decoder, DecoderOutput
from kvdoc.serving.splitk import SplitKAttention, split_k_attention

from . import LONG_STREAM


def copy_as(model: Decoder, cls: type[Decoder], config: object = None) -> Decoder:
    """A new ``cls`` with ``model``'s weights, dtype and device, in eval mode, and its config
    (or ``config``, one with the same sizes)."""
    weight = model.wte.weight
    with torch.random.fork_rng():  # the fresh weights are overwritten: leave the global RNG alone
        clone = cls(config or model.config).to(weight.dtype).to(weight.device)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def with_attention(model: Decoder, cls: type[CausalSelfAttention]) -> Decoder:
    """A copy of ``model`` whose every attention module is a ``cls`` holding the same weights."""
    clone = copy_as(model, Decoder)
    weight = model.wte.weight
    for block in clone.h:
        attn = cls(model.config).to(weight.dtype).to(weight.device)
        attn.load_state_dict(block.attn.state_dict())
        block.attn = attn
    return clone


def with_mixer(cls: type[torch.nn.Module], attr: str) -> Callable[[Decoder], Decoder]:
    """A build: a copy of the model whose every block's ``attr`` module (a recurrent mixer) is a
    ``cls``, a subclass of its own that adds no parameters: the class is swapped in place."""
    def build(model: Decoder) -> Decoder:
        clone = copy_as(model, type(model))
        for block in clone.h:
            if hasattr(block, attr):
                getattr(block, attr).__class__ = cls  # same parameters, the broken method
        return clone
    return build


@torch.no_grad()
def cached_only(broken: Decoder, model: Decoder, cut: int = 4,
                ids: torch.Tensor | None = None) -> tuple[float, float]:
    """``broken``'s largest logit error against ``model`` in one full forward of ``ids`` (six
    tokens by default), and at positions ``cut`` on when the first ``cut`` went through a cache
    first: a bug of the cached path only shows as ``(0.0, large)``."""
    ids = torch.tensor([[12, 7, 31, 4, 9, 18]]) if ids is None else ids
    right = model(ids).logits
    full = (broken(ids).logits - right).abs().max().item()
    _, cache = broken(ids[:, :cut], broken.new_cache(ids.shape[0]))
    return full, (broken(ids[:, cut:], cache).logits - right[:, cut:]).abs().max().item()


# --- wrong positions ---------------------------------------------------------------------------
class _CountedDecoder(Decoder):
    """Numbers a call's new tokens by :meth:`count`; a padded batch's own positions pass."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                **options: object) -> DecoderOutput:
        if options.get("positions") is not None:
            return super().forward(idx, cache, **options)
        counted = self.count(0 if cache is None else cache.seq_len, idx.shape[1], idx.device)
        return super().forward(idx, cache, positions=counted.expand_as(idx), **options)


class PositionsRestartDecoder(_CountedDecoder):
    """BROKEN: each call numbers its new tokens ``0 .. C - 1``, as if it began the sequence."""

    def count(self, start: int, n: int, device) -> torch.Tensor:
        return torch.arange(n, device=device)  # BUG: not start .. start + n - 1


class ClampedPositionsDecoder(_CountedDecoder):
    """BROKEN, in code both paths share: positions past 31 are clamped to 31."""

    def count(self, start: int, n: int, device) -> torch.Tensor:
        return torch.arange(start, start + n, device=device).clamp(max=LONG_STREAM - 1)  # BUG


class PositionCounterDecoder(_CountedDecoder):
    """BROKEN: numbers new tokens from a counter on the model (reset by a call from position 0),
    not from the cache's length: right only for one stream fed in order."""

    def count(self, start: int, n: int, device) -> torch.Tensor:
        first = 0 if start == 0 else getattr(self, "_counter", 0)  # BUG: ignores start
        self._counter = first + n
        return torch.arange(first, self._counter, device=device)


# --- wrong masks ----------------------------------------------------------------------------
def top_left_causal_mask(past_len: int, new_len: int,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """WRONG whenever ``past_len > 0``: ``is_causal=True``'s mask, ``tril`` of ``[C, P + C]``, so
    query ``i`` reads keys ``0 .. i`` only; kept for contrast with
    :func:`kvdoc.core.cache.offset_causal_mask`.

    >>> top_left_causal_mask(2, 2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0]], dtype=torch.int32)
    """
    check_int("past_len", past_len, minimum=0)
    check_int("new_len", new_len)
    return torch.ones(new_len, past_len + new_len, dtype=torch.bool, device=device).tril()


class _MaskAttention(CausalSelfAttention):
    """Attention whose ``attend`` gets the mask :meth:`mask` makes (``[C, T]``, every row)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().attend(q, k, v, start, self.mask(start, q.shape[2], k.shape[2],
                                                        q.device)[None])


class TopLeftMaskAttention(_MaskAttention):
    """BROKEN: :func:`top_left_causal_mask`, also in one-token decode."""

    def mask(self, start, C, T, device):
        return top_left_causal_mask(start, C, device)  # BUG: no offset by start


class NoMaskAttention(_MaskAttention):
    """BROKEN: no mask: a chunk reads its own future (right for one token without a window)."""

    def mask(self, start, C, T, device):
        return torch.ones(C, T, dtype=torch.bool, device=device)  # BUG: every key visible


class OffByOneMaskAttention(_MaskAttention):
    """BROKEN: ``j <= P + i + 1``: each query of a chunk also reads the token after it."""

    def mask(self, start, C, T, device):
        query_pos = start + torch.arange(C, device=device)
        key_pos = torch.arange(start + C, device=device)
        return key_pos[None, :] <= query_pos[:, None] + 1  # BUG: one key too many


# --- grouped-query attention ----------------------------------------------------------------
class TiledGQAAttention(CausalSelfAttention):
    """BROKEN: on cached calls query head ``h`` reads K/V head ``h % H_kv``, not its group's."""

    shared = False  # True: the same bug in the full forward too

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        self._tile = cache is not None or self.shared
        return super().forward(x, cache, layer_idx, start, attn_mask, positions=positions)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self._tile:
            group = self.n_head // self.n_kv_head
            # BUG: repeat, not repeat_interleave
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        return super().attend(q, k, v, start, attn_mask)


class SharedTiledGQAAttention(TiledGQAAttention):
    """BROKEN: :class:`TiledGQAAttention`'s head sharing in every forward, cached or not."""

    shared = True


# --- generation, padded batches, a fast step that keeps its first copy of the weights ----------
class LastOnlyFirstRowDecoder(Decoder):
    """BROKEN: ``last_only=True`` returns the first new position's logits, not the last one's."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                last_only: bool = False, **options: object) -> DecoderOutput:
        logits, cache = super().forward(idx, cache, **options)
        return DecoderOutput(logits[:, :1] if last_only else logits, cache)  # BUG: row 0, not -1


class DecodeWithoutPadMaskDecoder(Decoder):
    """BROKEN: the pad mask is dropped on one-token decode steps."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                **options: object) -> DecoderOutput:
        if cache is not None and idx.shape[1] == 1:
            options.pop("attn_mask", None)  # BUG: a decode step without the pad mask
        return super().forward(idx, cache, **options)


class _PaddingBlindFast(FastDecoder):
    def __call__(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                 last_only: bool = False, **padding: object) -> DecoderOutput:
        return super().__call__(idx, cache, last_only=last_only)  # BUG: padding dropped


class PaddingBlindFastDecoder(Decoder):
    """BROKEN: one-token calls after a cache go through a fast step that ignores the padding."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                last_only: bool = False, **padding: object) -> DecoderOutput:
        if cache is None or idx.shape[1] != 1:
            return super().forward(idx, cache, last_only=last_only, **padding)
        if "_fast" not in self.__dict__:
            self.__dict__["_fast"] = _PaddingBlindFast(self)
        return self.__dict__["_fast"](idx, cache, last_only=last_only, **padding)


PAD_LEAK_SPLIT = 3  # keys per chunk: a pad of 4 slots spans two chunks


class PadLeakSplitKAttention(SplitKAttention):
    """BROKEN: split-K attention whose first chunk of keys takes the union of the rows' masks."""

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


class SnapshotFastDecoder(FastDecoder):
    """BROKEN: the weights copied at construction are used for good."""

    def _stale(self) -> bool:
        return False  # BUG: never compares the model's weights with the copies


class SnapshotFastStepDecoder(Decoder):
    """One-token cached calls run :class:`SnapshotFastDecoder`'s step, made on the first."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                **options: object) -> DecoderOutput:
        # last_only, positions or a pad mask: the model's own path (tensors have no truth value)
        # and under the batch-invariant mode, which the fast step hands back to the model
        if (cache is None or idx.dim() != 2 or idx.shape[1] != 1 or invariant.active()
                or any(v is not None and v is not False for v in options.values())):
            return super().forward(idx, cache, **options)
        if getattr(self, "_fast", None) is None:
            self._fast = SnapshotFastDecoder(self)  # its other calls come back to super().forward
        return self._fast(idx, cache)


def stale_prefix(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The prefix before an edit, ``ids`` with token 0 of every row changed: the stale-cache
    scenario fills the cache from it, then continues with the current tokens."""
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must be a non-empty [B, T] tensor, got {tuple(ids.shape)}")
    old = ids.clone()
    old[:, 0] = (ids[:, 0] + 1) % vocab_size
    return old
