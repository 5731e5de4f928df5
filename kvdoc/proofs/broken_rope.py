"""Deliberately wrong RoPE caches, kept so that the equivalence check can be seen to fail.

Two ways to get rotary positions wrong with a cache, each a small change to a correct
Llama-style :class:`~kvdoc.core.model.Decoder` (same weights), in the style of :mod:`kvdoc.proofs.broken`:

* ``unrotated-k-cache``: K goes into the cache *before* RoPE, and only the rows a call has just
  computed are rotated; keys read back from the cache were never turned.
* ``rope-restart``: each call rotates its new Q and K at positions ``0 .. C - 1``, as if the chunk
  began the sequence, instead of at ``P .. P + C - 1``.

A full forward (one call from position 0) is correct for both, so only the cached path is wrong.

>>> import torch
>>> from kvdoc import Decoder
>>> from kvdoc.core.config import llama_config
>>> _ = torch.manual_seed(0)
>>> model = Decoder(llama_config()).eval()
>>> broken = unrotated_k(model)
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
>>> with torch.no_grad():
...     same = (broken(ids).logits - model(ids).logits).abs().max().item()
...     _, cache = broken(ids[:, :4], broken.new_cache(1))
...     wrong = broken(ids[:, 4:], cache).logits
...     right = model(ids).logits[:, 4:]
>>> same, bool((wrong - right).abs().max() > 1e-3)
(0.0, True)
"""

from __future__ import annotations

import torch

from .broken import copy_as, with_attention
from kvdoc.core.cache import KVCache
from kvdoc.core.model import CausalSelfAttention, Decoder
from kvdoc.core.rope import Rotary


class UnrotatedKeyAttention(CausalSelfAttention):
    """BROKEN: caches K before RoPE, then rotates only this call's rows of what the cache returns."""

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, C, d = x.shape
        heads = self.c_attn(x).view(B, C, self.n_head + 2 * self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k, v = heads.split((self.n_head, self.n_kv_head, self.n_kv_head), dim=1)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)  # BUG: K is stored unrotated
        q, new_k = self.rotary(q, k[:, :, -C:], start)   # the cached rows are never turned
        k = torch.cat((k[:, :, :-C], new_k), dim=2)
        y = self.attend(q, k, v, start, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, C, d))


class RopeRestartRotary(Rotary):
    """BROKEN: rotates the new rows at positions ``0 .. C - 1`` whatever the cache holds."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(q, k, 0)  # BUG: should be `start`


def unrotated_k(model: Decoder) -> Decoder:
    """A copy of a RoPE ``model`` whose attention caches K before rotating it."""
    _require_rope(model)
    return with_attention(model, UnrotatedKeyAttention)


def rope_restart(model: Decoder) -> Decoder:
    """A copy of a RoPE ``model`` whose every call rotates its rows from position 0."""
    _require_rope(model)
    clone = copy_as(model, Decoder)
    for block in clone.h:
        block.attn.rotary = RopeRestartRotary(block.attn.rotary.theta)
    return clone


def _require_rope(model: Decoder) -> None:
    if model.config.position != "rope":
        raise ValueError("this variant breaks RoPE: build it from a model with position='rope'")
