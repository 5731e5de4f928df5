"""Multi-head latent attention (MLA, DeepSeek-V2/V3): a decoder that caches a latent, not K and V.

Each layer projects a token down to a latent ``c_KV`` of ``kv_lora_rank`` values (RMS-normalised)
and one rotary key ``k_rope`` of ``qk_rope_head_dim`` values shared by every head. Those two are
all the cache holds. Per-head keys and values are up-projections of the latent: the key of head
``h`` is ``[W_UK[h] c_KV, k_rope]`` (``qk_nope_head_dim + qk_rope_head_dim`` wide), its value
``W_UV[h] c_KV`` (``v_head_dim`` wide); queries are split the same way, and only the rotary
part of a query or key is turned by RoPE (:mod:`kvdoc.core.model`, half-split pairs). The softmax
scale is ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, DeepSeek-V3's without YaRN scaling.

A cached call attends one of two ways, which compute the same function:

* plain (``absorb=False``): up-project every cached latent to K and V, then ordinary attention;
* absorbed (``absorb=True``): fold ``W_UK`` into the query (``q_nope W_UK[h]`` is a query in
  latent space) and apply ``W_UV`` after attention, so attention runs over the cached latent
  itself: multi-query attention with one K head ``[c_KV, k_rope]`` and one V head ``c_KV``.

A full forward (no cache) always up-projects, so the grid's cached-versus-full comparison
checks the absorbed path against the plain one. :class:`MLADecoder`'s blocks attend this way,
with Llama's RMSNorm and SwiGLU MLP; each cache layer holds ``c_KV`` ``[B, 1, T, kv_lora_rank]``
and ``k_rope`` ``[B, 1, T, qk_rope_head_dim]``: the ``[B, H_kv, T, D_h]`` layout with one shared
"head" of two widths (as transformers' DeepseekV3 stores it).

>>> _ = torch.manual_seed(0)
>>> model = MLADecoder(MLAConfig()).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
>>> full = model(ids).logits
>>> _, cache = model(ids[:, :4], model.new_cache(1))
>>> [tuple(t.shape) for t in cache.layer(0)]             # c_KV and k_rope of layer 0
[(1, 1, 4, 32), (1, 1, 4, 8)]
>>> torch.allclose(model(ids[:, 4:], cache).logits, full[:, 4:], atol=1e-5)
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, LayerSpec, check_int, check_positive
from .frame import BlocksDecoder, PreNormBlock
from .model import MLP, CausalSelfAttention, GPTConfig, apply_rope

LATENT_NORM_EPS = 1e-6
"""Epsilon of the RMSNorms on the latents (transformers' DeepseekV3RMSNorm default there)."""


@dataclass(frozen=True)
class MLAConfig:
    """Sizes of an MLA decoder (DeepSeek-V3's dense layers; names as in its ``config.json``, or
    as :class:`~kvdoc.core.model.GPTConfig`'s): ``q_lora_rank`` None projects the query in one
    matrix, not through a normed low-rank bottleneck; ``absorb``: cached calls attend in latent
    space (see the module docstring).

    >>> cfg = MLAConfig()
    >>> cfg.qk_head_dim, cfg.latent_dim, round(cfg.softmax_scale, 4)
    (24, 40, 0.2041)
    >>> MLAConfig(qk_rope_head_dim=3)
    Traceback (most recent call last):
    ...
    ValueError: RoPE rotates pairs of features: qk_rope_head_dim=3 must be even
    """

    vocab_size: int = 97
    n_positions: int = 512
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_inner: int = 128
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32  # r: the width of the cached latent c_KV
    qk_nope_head_dim: int = 16  # a head's query and key part without position
    qk_rope_head_dim: int = 8  # the rotary part: one rotary key for every head
    v_head_dim: int = 16
    layer_norm_epsilon: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    absorb: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd", "n_inner",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            check_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError("RoPE rotates pairs of features: "
                             f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        for name in ("layer_norm_epsilon", "rope_theta"):
            check_positive(name, getattr(self, name))

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per layer and token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``1 / sqrt(qk_head_dim)``: the absorbed path's wider dot products keep this scale."""
        return self.qk_head_dim ** -0.5

    @cached_property
    def cache_layout(self) -> tuple[LayerSpec, ...]:
        """Each layer caches one shared head of two widths: ``c_KV`` and ``k_rope``."""
        return (LayerSpec(1, (self.kv_lora_rank, self.qk_rope_head_dim)),) * self.n_layer

    def cached_shapes(self, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one layer's cached ``c_KV`` and ``k_rope`` after ``length`` positions."""
        return ((batch, 1, length, self.kv_lora_rank), (batch, 1, length, self.qk_rope_head_dim))


# --- the model -----------------------------------------------------------------------------------

class LatentAttention(nn.Module):
    """MLA for new rows ``x`` (``[B, C, d]``) at positions ``start ..``, reading a latent cache.

    Weights (names as transformers' DeepseekV3Attention): ``q_proj`` (or ``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj``), ``kv_a_proj_with_mqa`` (``d -> r + d_R``: the latent's
    down-projection ``W_DKV`` and the rotary key's ``W_KR``), ``kv_a_layernorm``, ``kv_b_proj``
    (``r -> H x (d_nope + d_v)``: per head ``W_UK`` then ``W_UV``) and ``o_proj``.

    >>> attn = LatentAttention(MLAConfig())
    >>> attn(torch.zeros(2, 3, 64), None, layer_idx=0, start=0).shape
    torch.Size([2, 3, 64])
    """

    window = None  # every earlier key: for visible
    visible = CausalSelfAttention.visible

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = c = config
        H, d = c.n_head, c.n_embd
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        B, C, _ = x.shape
        # the query's own latent (RMS-normalised), which an indexed layer's indexer also reads
        q_latent = None if c.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)
        q = q.view(B, C, c.n_head, c.qk_head_dim).transpose(1, 2)  # [B, H, C, d_nope + d_R]
        q_nope, q_rope = q.split((c.qk_nope_head_dim, c.qk_rope_head_dim), dim=-1)
        at = start if positions is None else positions  # start .. start + C - 1, or per row
        q_rope = apply_rope(q_rope, at, c.rope_theta)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split((c.kv_lora_rank, c.qk_rope_head_dim),
                                                        dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)[:, None]  # [B, 1, C, r]: one head, shared by all
        k_rope = apply_rope(k_rope[:, None], at, c.rope_theta)  # [B, 1, C, d_R], turned once
        if cache is not None:
            c_kv, k_rope = cache.update(layer_idx, c_kv, k_rope, start)  # [B, 1, P + C, .]
        mask = self.read_mask(x, q_latent, cache, layer_idx, start, at, c_kv.shape[2], attn_mask)
        attend = self.attend_absorbed if c.absorb and cache is not None else self.attend_plain
        y = attend(q_nope, q_rope, c_kv, k_rope, mask)  # [B, H, C, d_v]
        return self.o_proj(y.transpose(1, 2).reshape(B, C, c.n_head * c.v_head_dim))

    def read_mask(self, x: torch.Tensor, q_latent: torch.Tensor | None, cache: KVCache | None,
                  layer_idx: int, start: int, at: int | torch.Tensor, T: int,
                  attn_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The keys each new query reads, as the mask attention takes (``[C, T]``, None, or
        ``[B, 1, C, T]``): here every earlier one (:class:`~kvdoc.core.model.CausalSelfAttention`'s
        mask); an indexed layer (:mod:`kvdoc.core.indexed`) selects among them."""
        mask = self.visible(start, x.shape[1], T, attn_mask, x.device)
        return mask[:, None] if mask is not None and mask.dim() == 3 else mask

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` ``[H, d_nope, r]`` and ``W_UV`` ``[H, d_v, r]``: views of ``kv_b_proj``."""
        c = self.config
        w = self.kv_b_proj.weight.view(c.n_head, c.qk_nope_head_dim + c.v_head_dim,
                                       c.kv_lora_rank)
        return w.split((c.qk_nope_head_dim, c.v_head_dim), dim=1)

    def attend_plain(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor,
                     k_rope: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Up-project every cached latent to per-head K and V, then attend: ``[B, H, C, d_v]``."""
        c = self.config
        B, _, T, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv[:, 0]).view(B, T, c.n_head, -1).transpose(1, 2)
        k_nope, v = kv.split((c.qk_nope_head_dim, c.v_head_dim), dim=-1)  # [B, H, T, .]
        k = torch.cat((k_nope, k_rope.expand(B, c.n_head, T, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c.softmax_scale)

    def attend_absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor,
                        k_rope: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention over the latent itself: ``W_UK`` folded into the query, ``W_UV`` applied to
        each head's latent output. ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, and the weighted
        sum of ``W_UV c_j`` is ``W_UV`` times the weighted sum of ``c_j``."""
        w_uk, w_uv = self.up_projections()
        q_latent = per_head(q_nope, w_uk.mT)  # [B, H, C, r]: each head's W_UK^T q_nope
        q = torch.cat((q_latent, q_rope), dim=-1)  # [B, H, C, r + d_R]
        k = torch.cat((c_kv, k_rope), dim=-1)  # [B, 1, T, r + d_R]: one K head for all H
        out = F.scaled_dot_product_attention(q, k, c_kv, attn_mask=mask, enable_gqa=True,
                                             scale=self.config.softmax_scale)  # [B, H, C, r]
        return per_head(out, w_uv)  # [B, H, C, d_v]


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x[:, h] w[h]^T`` for each head ``h`` (``x`` ``[B, H, C, n]``, ``w`` ``[H, m, n]``):
    ``[B, H, C, m]``, by one ``F.linear`` per head, which :func:`kvdoc.batch_invariant` runs row
    by row (an einsum or matmul it would leave to the library's order).

    >>> x, w = torch.randn(2, 3, 4, 5), torch.randn(3, 6, 5)
    >>> torch.allclose(per_head(x, w), torch.einsum("bhcn,hmn->bhcm", x, w), atol=1e-5)
    True
    """
    return torch.stack([F.linear(x[:, h], w[h]) for h in range(x.shape[1])], dim=1)


class LatentBlock(PreNormBlock):
    """Pre-norm decoder layer with latent attention: ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``
    (SwiGLU); ``attention(config)`` builds the attention (DeepSeek-V4's
    :class:`~kvdoc.core.v4.CompressedAttention` too)."""

    def __init__(self, config: Any, attention: Callable[[Any], nn.Module] = LatentAttention
                 ) -> None:
        d, eps = config.n_embd, config.layer_norm_epsilon
        super().__init__(
            ("ln_1", "attn", "ln_2", "mlp"), ln_1=nn.RMSNorm(d, eps=eps), attn=attention(config),
            ln_2=nn.RMSNorm(d, eps=eps),  # Llama's SwiGLU MLP, sized by a GPTConfig of this width
            mlp=MLP(GPTConfig(n_embd=d, n_head=1, n_inner=config.n_inner, mlp="swiglu",
                              bias=False)))


class MLADecoder(BlocksDecoder):
    """A :class:`~kvdoc.core.frame.BlocksDecoder` of :class:`LatentBlock` s.

    >>> MLADecoder(MLAConfig()).num_parameters()
    95744
    """

    attention: type[LatentAttention] = LatentAttention  # what each block attends with

    def __init__(self, config: MLAConfig | None = None) -> None:
        super().__init__(config or MLAConfig(), lambda c, _: LatentBlock(c, self.attention))
