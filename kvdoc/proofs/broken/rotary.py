"""Deliberately wrong RoPE caches, kept so that the equivalence check can be seen to fail.

Two ways to get rotary positions wrong with a cache, each a correct Llama-style
:class:`~kvdoc.core.model.Decoder` (same weights) whose attention modules are replaced by a
subclass with one mistake in its ``forward``, in the style of :mod:`kvdoc.proofs.broken.decoders`:

* ``unrotated-k-cache``: K goes into the cache *before* RoPE, and only the rows a call has just
  computed are rotated; keys read back from the cache were never turned.
* ``rope-restart``: each call rotates its new Q and K at positions ``0 .. C - 1``, as if the
  chunk began the sequence, instead of at ``P .. P + C - 1``.

A full forward (one call from position 0) is correct for both, so only the cached path is wrong.
Two more are wrong in code both paths share:

* ``rope-table-growth``: cos and sin come from a table built on the first call and grown later,
  and the grown rows restart at position 0; right whenever the first call was the longest.
* ``rope-default-base``: RoPE turns at the default base 10000, not the config's; right on any
  model whose base is the default.
* ``gemma-local-global-base``: a Gemma model's window layers turn at the global base
  ``rope_theta``, not ``rope_local_base_freq``; right on a model whose two bases are equal.

>>> import torch
>>> from kvdoc import Decoder
>>> from kvdoc.core.model import llama_config
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

from collections.abc import Callable

import torch

from kvdoc.core.cache import KVCache
from kvdoc.core.gemma import Gemma3Decoder
from kvdoc.core.model import CausalSelfAttention, Decoder
from kvdoc.core.model import apply_rope, rope_angles, rotate_half

from .decoders import copy_as, with_attention


def _split_heads(attn: CausalSelfAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Unrotated Q ``[B, H, C, D_h]``, K and V ``[B, H_kv, C, D_h]`` of the rows ``x``
    (``[B, C, d]``), split from ``attn.c_attn`` as the real attention splits them."""
    B, C, _ = x.shape
    H, H_kv = attn.n_head, attn.n_kv_head
    heads = attn.c_attn(x).view(B, C, H + 2 * H_kv, attn.head_dim).transpose(1, 2)
    return heads.split((H, H_kv, H_kv), dim=1)


class UnrotatedKeyAttention(CausalSelfAttention):
    """BROKEN: caches K before RoPE, then rotates only this call's rows of what the cache
    returns."""

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, d = x.shape
        q, k, v = _split_heads(self, x)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)  # BUG: K is stored unrotated
        at = start if positions is None else positions
        q = apply_rope(q, at, self.rope_theta)
        new_k = apply_rope(k[:, :, -C:], at, self.rope_theta)  # cached rows are never turned
        k = torch.cat((k[:, :, :-C], new_k), dim=2)
        y = self.attend(q, k, v, start, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, C, d))


class RopeRestartAttention(CausalSelfAttention):
    """BROKEN: rotates the new rows at positions ``0 .. C - 1`` whatever the cache holds."""

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, d = x.shape
        q, k, v = _split_heads(self, x)
        q = apply_rope(q, 0, self.rope_theta)  # BUG: should be `start` (or `positions`)
        k = apply_rope(k, 0, self.rope_theta)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)
        y = self.attend(q, k, v, start, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, C, d))


class GrowingTableAttention(CausalSelfAttention):
    """BROKEN: RoPE's cos and sin come from a table built on the first call for the positions it
    needs, and grown when a later call needs more; the grown rows are computed from position 0,
    not from where the table ended. Right as long as the first call was the longest, as a full
    forward over the whole stream is."""

    def _table(self, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        have = 0 if getattr(self, "_cos", None) is None else self._cos.shape[0]
        if end > have:
            # BUG: restarts at 0; the new rows are positions have .. end - 1
            positions = torch.arange(end - have, device=like.device)
            angles = rope_angles(positions, self.head_dim, self.rope_theta)
            cos, sin = angles.cos().to(like.dtype), angles.sin().to(like.dtype)
            grown = have > 0
            self._cos = torch.cat((self._cos, cos)) if grown else cos  # [end, D_h]
            self._sin = torch.cat((self._sin, sin)) if grown else sin
        return self._cos, self._sin

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, d = x.shape
        q, k, v = _split_heads(self, x)
        if positions is None:
            cos, sin = (t[start:start + C] for t in self._table(start + C, x))
        else:  # each row's own positions, [B, 1, C, D_h]: read off the same table
            table = self._table(int(positions.max()) + 1, x)
            cos, sin = (t[positions][:, None] for t in table)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)
        y = self.attend(q, k, v, start, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, C, d))


class DefaultBaseAttention(CausalSelfAttention):
    """BROKEN: calls ``apply_rope`` without the model's base, so RoPE turns at the default 10000
    whatever ``config.rope_theta`` says, in every call, full or cached."""

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, d = x.shape
        q, k, v = _split_heads(self, x)
        at = start if positions is None else positions
        q, k = apply_rope(q, at), apply_rope(k, at)  # BUG: no self.rope_theta
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)
        y = self.attend(q, k, v, start, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, C, d))


def _require_rope(model: Decoder) -> None:
    if model.config.position != "rope":
        raise ValueError("this variant breaks RoPE: build it from a model with position='rope'")


def rope_variant(cls: type[CausalSelfAttention]) -> Callable[[Decoder], Decoder]:
    """``model ->`` a copy of a RoPE ``model`` whose every attention module is a ``cls``."""
    def build(model: Decoder) -> Decoder:
        _require_rope(model)
        return with_attention(model, cls)
    return build


unrotated_k = rope_variant(UnrotatedKeyAttention)
"""A copy of a RoPE model whose attention caches K before rotating it."""
rope_restart = rope_variant(RopeRestartAttention)
"""A copy of a RoPE model whose every call rotates its rows from position 0."""
growing_table = rope_variant(GrowingTableAttention)
"""A copy of a RoPE model whose rotation table grows wrongly after its first call."""
default_base = rope_variant(DefaultBaseAttention)
"""A copy of a RoPE model that turns at the default base, not ``config.rope_theta``."""


def local_global_base(model: Gemma3Decoder) -> Gemma3Decoder:
    """A copy of a Gemma ``model`` whose window layers turn at the global RoPE base."""
    if not isinstance(model, Gemma3Decoder):
        raise ValueError("this variant breaks a Gemma model's local RoPE base: build it from a "
                         "Gemma3Decoder")
    clone = copy_as(model, Gemma3Decoder)
    for block in clone.h:
        block.self_attn.rope_theta = model.config.rope_theta  # BUG: window layers too
    return clone
