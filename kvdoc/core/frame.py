"""The decoder frame the models beyond GPT-2's share: layer types, attention, MLP, block, decoder.

Gemma 3, gpt-oss, MLA, indexed attention, DeepSeek-V4 and the hybrids (Qwen3.5's DeltaNet,
Bamba's Mamba-2) build on these: :class:`BlocksDecoder` (a
:class:`~kvdoc.core.model.Decoder` of other blocks) and :class:`HybridDecoder` (one whose cache
holds recurrent states too), :class:`PreNormBlock` (``x + mixer(norm(x))``, then
``x + mlp(norm(x))``), :class:`HeadsAttention` (transformers' ``q_proj`` .. ``o_proj``, read
through :class:`~kvdoc.core.model.CausalSelfAttention`'s masks), :class:`GatedMLP`, the
checks of a layout of layer types, and :class:`WindowLayers` (each layer's window and K/V layout
for a config of window and full attention layers).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, LayerSpec, check_int
from .model import CausalSelfAttention, Decoder, apply_rope
from .state import hybrid_cache

SLIDING, GLOBAL, LINEAR = "sliding_attention", "full_attention", "linear_attention"
"""Layer types as transformers' configs name them: a window, every key, a recurrent state."""


def every_nth_full(n_layer: int, interval: int, other: str = SLIDING) -> tuple[str, ...]:
    """Layer types where every ``interval``-th layer is ``"full_attention"`` (the last of each
    group) and the others ``other``, as transformers reads Gemma's ``sliding_window_pattern``
    (Gemma 3: 6, Gemma 2: 2) and Qwen3.5's ``full_attention_interval`` (its default: 4; ``other``
    ``"linear_attention"``).

    >>> every_nth_full(4, 2)
    ('sliding_attention', 'full_attention', 'sliding_attention', 'full_attention')
    """
    check_int("n_layer", n_layer)
    check_int("interval", interval)
    return tuple(other if (i + 1) % interval else GLOBAL for i in range(n_layer))


class WindowLayers:
    """Each layer's window and K/V cache layout for the config (a frozen dataclass with
    ``sliding_window``, ``n_kv_head`` and ``head_dim``) of a decoder of window and full attention
    layers: Gemma 3's, gpt-oss's."""

    @property
    def types(self) -> tuple[str, ...]:
        """Each layer's type, ``"sliding_attention"`` or ``"full_attention"``: ``layer_types``
        (a config where that field may be None resolves it here)."""
        return self.layer_types

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer ``sliding_window`` for a window layer, None for a full one."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.types)

    @cached_property
    def cache_layout(self) -> tuple[LayerSpec, ...]:
        """K and V of ``n_kv_head`` heads of ``head_dim`` per layer, with the layer's window."""
        widths = (self.head_dim, self.head_dim)
        return tuple(LayerSpec(self.n_kv_head, widths, w) for w in self.layer_windows)


def check_layer_types(types: Any, n_layer: int, allowed: tuple[str, ...]) -> None:
    """A ValueError unless ``types`` is a tuple of ``n_layer`` of the ``allowed`` types.

    >>> check_layer_types((LINEAR,), 2, (LINEAR, GLOBAL))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: layer_types must be a tuple of 2 of 'linear_attention' and 'full_attention', ...
    """
    if (not isinstance(types, tuple) or len(types) != n_layer
            or any(t not in allowed for t in types)):
        raise ValueError(f"layer_types must be a tuple of {n_layer} of "
                         f"{' and '.join(map(repr, allowed))}, got {types!r}")


def check_layer_indices(name: str, indices: Any, n_layer: int) -> None:
    """A ValueError unless ``indices`` (the config's field ``name``) is a tuple of increasing
    layer indices below ``n_layer``."""
    if (not isinstance(indices, tuple) or list(indices) != sorted(set(indices))
            or any(type(i) is not int or not 0 <= i < n_layer for i in indices)):
        raise ValueError(f"{name} must be increasing layer indices below n_layer={n_layer}, "
                         f"got {indices!r}")


def check_multiples(config: Any, *pairs: tuple[str, str]) -> None:
    """A ValueError for the first ``(big, small)`` of ``config``'s sizes where ``big`` is not a
    multiple of ``small``."""
    for big, small in pairs:
        if getattr(config, big) % getattr(config, small):
            raise ValueError(f"{big}={getattr(config, big)} must be a multiple of "
                             f"{small}={getattr(config, small)}")


def partial_rope(x: torch.Tensor, at: int | torch.Tensor, theta: float,
                 rotary_dim: int) -> torch.Tensor:
    """:func:`~kvdoc.core.model.apply_rope` on the first ``rotary_dim`` features of ``x``, the
    rest as they are (Qwen3.5's and Bamba's attention, the V3.2 indexer's key)."""
    turned, kept = x.split((rotary_dim, x.shape[-1] - rotary_dim), dim=-1)
    return torch.cat((apply_rope(turned, at, theta), kept), dim=-1)


class HeadsAttention(nn.Module):
    """Attention through transformers' ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (each with
    ``bias`` or none) of ``n_head`` query and ``n_kv_head`` K/V heads of ``head_dim``: :meth:`qkv`
    gives the turned heads, the cache takes K and V, :meth:`attend` reads them with
    :class:`~kvdoc.core.model.CausalSelfAttention`'s masks (SDPA at ``scale``)."""

    window: int | None = None
    scale: float | None = None  # None: 1 / sqrt(head_dim)
    rope_theta: float  # each layer's RoPE base
    rotary_dim: int | None = None  # None: RoPE turns every feature of a head
    visible = CausalSelfAttention.visible

    def __init__(self, c: Any, bias: bool = False, q_per_head: int = 1) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.q_proj = nn.Linear(c.n_embd, q_per_head * c.n_head * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=bias)

    def heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``proj(x)`` as heads: ``[B, C, n D_h] -> [B, n, C, D_h]``."""
        return proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def rope(self, x: torch.Tensor, at: int | torch.Tensor) -> torch.Tensor:
        """RoPE at ``rope_theta`` on the first ``rotary_dim`` features (all: None)."""
        if self.rotary_dim is None:
            return apply_rope(x, at, self.rope_theta)
        return partial_rope(x, at, self.rope_theta, self.rotary_dim)

    def qkv(self, x: torch.Tensor, at: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Q and K of the new rows turned at ``at`` (after ``q_norm`` and ``k_norm`` where the
        layer has them), and V."""
        q, k = self.heads(self.q_proj, x), self.heads(self.k_proj, x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, at), self.rope(k, at), self.heads(self.v_proj, x)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        # positions start .. start + C - 1, or per row
        q, k, v = self.qkv(x, start if positions is None else positions)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)  # a window layer returns its last rows
        y = self.attend(q, k, v, start, attn_mask)
        return self.o_proj(y.transpose(1, 2).flatten(2))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [B, 1, C, T]: the same for every head
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **gqa)


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: SwiGLU (``act`` SiLU: Qwen3.5's, Bamba's) or
    GeGLU (GELU's tanh form: Gemma's)."""

    def __init__(self, config: Any, act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(config.n_embd, config.n_inner, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.n_inner, bias=False)
        self.down_proj = nn.Linear(config.n_inner, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PreNormBlock(nn.Module):
    """``x + mixer(norm(x))``, then ``x + mlp(mlp_norm(x))``. ``modules`` keep their names
    (transformers'), registered in the order given; ``roles`` names norm, mixer, mlp_norm and
    mlp among them. A mixer takes ``(x, cache, layer_idx, start, attn_mask, **positions)``."""

    def __init__(self, roles: tuple[str, str, str, str], **modules: nn.Module) -> None:
        super().__init__()
        self.roles = roles
        for name, module in modules.items():
            setattr(self, name, module)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, **positions: torch.Tensor) -> torch.Tensor:
        norm, mixer, mlp_norm, mlp = (getattr(self, name) for name in self.roles)
        x = x + mixer(norm(x), cache, layer_idx, start, attn_mask, **positions)
        return x + mlp(mlp_norm(x))


class BlocksDecoder(Decoder):
    """A :class:`~kvdoc.core.model.Decoder` (its forward, input checks and caches) of
    ``block(config, i)`` per layer ``i``, not GPT-2's: ``wte`` an ``embedding``, no ``wpe`` (RoPE
    inside the attention), ``ln_f`` a ``norm(n_embd, eps=layer_norm_epsilon)``, ``lm_head`` from
    ``head`` (a bias-free linear when None), tied to ``wte`` by ``tie_word_embeddings``."""

    def __init__(self, config: Any, block: Callable[[Any, int], nn.Module],
                 norm: Callable[..., nn.Module] = nn.RMSNorm,
                 embedding: type[nn.Embedding] = nn.Embedding,
                 head: Callable[[], nn.Module] | None = None) -> None:
        nn.Module.__init__(self)  # not Decoder.__init__: it would build GPT-2 blocks
        self.config = config
        self.wte = embedding(config.vocab_size, config.n_embd)
        self.wpe = None
        self.h = nn.ModuleList(block(config, i) for i in range(config.n_layer))
        self.ln_f = norm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = head() if head else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight


class HybridDecoder(BlocksDecoder):
    """A decoder of state layers beside attention layers (DeltaNet's, Mamba-2's) whose cache
    (:meth:`new_cache`) holds a state per state layer and growing K/V per attention layer. A
    state folds every row of a call in order, so padded batches (``attn_mask``) and per-row
    ``positions`` are refused with :attr:`rows_refused`."""

    rows_refused: str
    """The ValueError's message for an ``attn_mask`` or ``positions``."""
    cache_owner: str
    """Whose cache :meth:`new_cache` names in its refusal of another kind."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                last_only: bool = False, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> object:
        if positions is not None or attn_mask is not None:
            raise ValueError(self.rows_refused)
        return super().forward(idx, cache, last_only=last_only)

    def new_cache(self, batch_size: int, kind: str | None = None,
                  capacity: int | None = None) -> KVCache:
        """An empty cache (``kind`` ``"state"``, the only one: a static or window cache has no
        place for a state): :func:`~kvdoc.core.state.hybrid_cache` of the config's layout;
        ``capacity`` is not used."""
        if kind not in (None, "state"):
            raise ValueError(f"{self.cache_owner} cache is 'state' (state and K/V layers), "
                             f"not {kind!r}")
        w = self.wte.weight
        return hybrid_cache(self.config.cache_layout, batch_size, w.dtype, w.device)
