"""Deliberately wrong rotary positions: a correct RoPE model (same weights) whose attention
modules are a subclass with one mistake. The first two leave the full forward right and only the
cached path wrong; the others are wrong in code both paths share (a table grown wrongly, the
default base, a Gemma window layer at the global base).

>>> import torch
>>> from kvdoc import Decoder
>>> from kvdoc.core.model import llama_config
>>> _ = torch.manual_seed(0)
>>> model = Decoder(llama_config()).eval()
>>> full, split = cached_only(unrotated_k(model), model)
>>> full, split > 1e-3
(0.0, True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvdoc.core.cache import KVCache
from kvdoc.core.gemma import Gemma3Decoder
from kvdoc.core.model import CausalSelfAttention, Decoder, apply_rope, rope_angles, rotate_half

from .decoders import cached_only, copy_as, with_attention  # noqa: F401 (the doctest)


class _Rotated(CausalSelfAttention):
    """Attention whose Q and K are turned by :meth:`rotate` before K is cached."""

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, C, _ = x.shape
        H, H_kv = self.n_head, self.n_kv_head
        heads = self.c_attn(x).view(B, C, H + 2 * H_kv, self.head_dim).transpose(1, 2)
        q, k, v = heads.split((H, H_kv, H_kv), dim=1)
        if self.qk_norm:  # as the model does, before any rotation
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, _ = x.shape
        q, k, v = self.heads(x)
        q, k = self.rotate(q, k, start if positions is None else positions, x)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)
        y = self.attend(q, k, v, start, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, C, -1))


class UnrotatedKeyAttention(_Rotated):
    """BROKEN: caches K before RoPE, then rotates only this call's rows of what it returns."""

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, _ = x.shape
        q, k, v = self.heads(x)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)  # BUG: K is stored unrotated
        at = start if positions is None else positions
        q = apply_rope(q, at, self.rope_theta)
        new_k = apply_rope(k[:, :, -C:], at, self.rope_theta)  # cached rows are never turned
        k = torch.cat((k[:, :, :-C], new_k), dim=2)
        y = self.attend(q, k, v, start, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, C, -1))


class RopeRestartAttention(_Rotated):
    """BROKEN: rotates the new rows at positions ``0 .. C - 1`` whatever the cache holds."""

    def rotate(self, q, k, at, x):
        return apply_rope(q, 0, self.rope_theta), apply_rope(k, 0, self.rope_theta)  # BUG: not at


class GrowingTableAttention(_Rotated):
    """BROKEN: RoPE's cos and sin come from a table built on the first call and grown when a
    later call needs more, the grown rows from position 0."""

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

    def rotate(self, q, k, at, x):
        if not torch.is_tensor(at):
            cos, sin = (t[at:at + q.shape[2]] for t in self._table(at + q.shape[2], x))
        else:  # each row's own positions, [B, 1, C, D_h]: read off the same table
            cos, sin = (t[at][:, None] for t in self._table(int(at.max()) + 1, x))
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class DefaultBaseAttention(_Rotated):
    """BROKEN: RoPE turns at the default base 10000 whatever ``config.rope_theta`` says."""

    def rotate(self, q, k, at, x):
        return apply_rope(q, at), apply_rope(k, at)  # BUG: no self.rope_theta


def rope_variant(cls: type[CausalSelfAttention]) -> Callable[[Decoder], Decoder]:
    """``model ->`` a copy of a RoPE ``model`` whose every attention module is a ``cls``."""
    def build(model: Decoder) -> Decoder:
        if model.config.position != "rope":
            raise ValueError("this variant breaks RoPE: build it from a model with "
                             "position='rope'")
        return with_attention(model, cls)
    return build


unrotated_k = rope_variant(UnrotatedKeyAttention)
rope_restart = rope_variant(RopeRestartAttention)
growing_table = rope_variant(GrowingTableAttention)
default_base = rope_variant(DefaultBaseAttention)


def local_global_base(model: Gemma3Decoder) -> Gemma3Decoder:
    """A copy of a Gemma ``model`` whose window layers turn at the global RoPE base."""
    if not isinstance(model, Gemma3Decoder):
        raise ValueError("this variant breaks a Gemma model's local RoPE base: build it from a "
                         "Gemma3Decoder")
    clone = copy_as(model, Gemma3Decoder)
    for block in clone.h:
        block.self_attn.rope_theta = model.config.rope_theta  # BUG: window layers too
    return clone
