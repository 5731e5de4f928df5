"""A Gemma-3-style decoder: sliding-window and global attention layers in one model.

Each layer slides (``"sliding_attention"``: query ``i`` reads keys ``i - W < j <= i``, RoPE at
the local base ``rope_local_base_freq``) or is global (``"full_attention"``: every key
``j <= i``, RoPE at ``rope_theta``); :attr:`Gemma3Config.layer_types` says which. The rest is
Gemma 3's as transformers computes it: embeddings scaled by ``sqrt(n_embd)``, RMSNorms that
scale by ``1 + weight``, four per layer (:class:`GemmaBlock`) and one per query and key head,
a GeGLU MLP, the softmax scale ``query_pre_attn_scalar ** -0.5`` and soft-capped logits.
Parameter names inside a layer are transformers', so a checkpoint maps by key
(:mod:`kvdoc.interop.hf_gemma`). The default cache (:func:`~kvdoc.core.window.window_cache`) is
hybrid: a ring of ``W`` slots per window layer, a growing layer per global one; a dynamic or
static cache serves the model too, which is what the hybrid one is checked against.

>>> _ = torch.manual_seed(0)
>>> model = Gemma3Decoder(Gemma3Config(sliding_window=4)).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18, 3, 5]])
>>> full = model(ids).logits
>>> _, cache = model(ids[:, :6], model.new_cache(1))       # a hybrid cache, past its window
>>> cache.held(0), cache.held(1)                          # layer 0 slides, layer 1 is global
(range(2, 6), range(0, 6))
>>> torch.allclose(model(ids[:, 6:], cache).logits, full[:, 6:], atol=1e-5)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .cache import KVCache, check_int, check_positive
from .frame import (
    GLOBAL,
    SLIDING,
    BlocksDecoder,
    GatedMLP,
    HeadsAttention,
    WindowLayers,
    check_layer_indices,
    check_multiples,
    every_nth_full,
)


@dataclass(frozen=True)
class Gemma3Config(WindowLayers):
    """Sizes of a Gemma-3-style decoder (names as :class:`~kvdoc.core.model.GPTConfig`'s, or as
    Gemma 3's ``config.json`` where GPT-2 has none): ``n_inner`` the GeGLU's hidden width,
    ``head_dim`` apart from ``n_embd / n_head``; every ``sliding_window_pattern``-th layer (the
    last of each group) is global (Gemma 3: 6, Gemma 2: 2; 1: every layer), unless
    ``global_layers`` lists them; ``final_logit_softcapping`` None: no cap.

    >>> cfg = Gemma3Config()
    >>> cfg.layer_types, cfg.layer_windows
    (('sliding_attention', 'full_attention'), (32, None))
    >>> Gemma3Config(sliding_window_pattern=0)
    Traceback (most recent call last):
    ...
    ValueError: sliding_window_pattern must be a positive integer, got 0
    >>> Gemma3Config(n_layer=3, global_layers=(0,)).layer_types
    ('full_attention', 'sliding_attention', 'sliding_attention')
    >>> Gemma3Config(n_layer=3, global_layers=(3,))
    Traceback (most recent call last):
    ...
    ValueError: global_layers must be increasing layer indices below n_layer=3, got (3,)
    """

    vocab_size: int = 97
    n_positions: int = 512
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    n_inner: int = 128
    head_dim: int = 16
    query_pre_attn_scalar: int = 16
    n_layer: int = 2
    sliding_window: int = 32
    sliding_window_pattern: int = 2
    global_layers: tuple[int, ...] | None = None
    layer_norm_epsilon: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_head", "n_kv_head", "n_embd", "n_inner",
                     "head_dim", "query_pre_attn_scalar", "n_layer", "sliding_window",
                     "sliding_window_pattern"):
            check_int(name, getattr(self, name))
        if self.global_layers is not None:
            check_layer_indices("global_layers", self.global_layers, self.n_layer)
        check_multiples(self, ("n_head", "n_kv_head"))
        if self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of features: head_dim={self.head_dim} "
                             "must be even")
        for name in ("layer_norm_epsilon", "rope_theta", "rope_local_base_freq"):
            check_positive(name, getattr(self, name))
        if self.final_logit_softcapping is not None:  # None: no cap
            check_positive("final_logit_softcapping", self.final_logit_softcapping)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's type, ``"sliding_attention"`` or ``"full_attention"``."""
        if self.global_layers is None:
            return every_nth_full(self.n_layer, self.sliding_window_pattern)
        return tuple(GLOBAL if i in self.global_layers else SLIDING for i in range(self.n_layer))


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` over the last dimension; ``weight`` starts at zero.

    >>> norm = GemmaRMSNorm(2)
    >>> [round(v, 4) for v in norm(torch.tensor([3., -3.])).tolist()]
    [1.0, -1.0]
    >>> with torch.no_grad():
    ...     _ = norm.weight.fill_(1.0)                  # scales by 1 + 1
    >>> [round(v, 4) for v in norm(torch.tensor([3., -3.])).tolist()]
    [2.0, -2.0]
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.active():  # a reduction by hand, which the mode reroutes no call of
            return x * invariant.inv_rms(x, self.eps) * (1.0 + self.weight)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times ``sqrt(embedding_dim)``, that constant rounded to float32 and then
    to the weight's dtype, as transformers' Gemma does (in bfloat16 ``sqrt(3072)`` is 55.5)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embedding_dim ** 0.5, dtype=torch.float32)
        return super().forward(idx) * scale.to(self.weight.dtype)


class SoftCappedHead(nn.Linear):
    """The LM head, its logits soft-capped to ``cap * tanh(logits / cap)`` when ``cap`` is set."""

    def __init__(self, n_embd: int, vocab_size: int, cap: float | None) -> None:
        super().__init__(n_embd, vocab_size, bias=False)
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.cap is None:
            return logits
        if invariant.active():  # tanh is not exactly rounded: its vector and tail code differ,
            # and which logits fall in the tail depends on how many rows the call holds
            return invariant.per_row(self.soft_cap, logits)
        return self.soft_cap(logits)

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)``."""
        return torch.tanh(logits / self.cap) * self.cap


class GemmaAttention(HeadsAttention):
    """Gemma 3's attention of layer ``layer_idx``: its window (or none) and its RoPE base.

    >>> attn = GemmaAttention(Gemma3Config(), layer_idx=0)
    >>> attn.window, attn.rope_theta, attn(torch.zeros(2, 3, 64), None, 0, start=0).shape
    (32, 10000.0, torch.Size([2, 3, 64]))
    """

    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__(c := config)
        sliding = c.layer_types[layer_idx] == SLIDING
        self.window = c.sliding_window if sliding else None
        self.rope_theta = c.rope_local_base_freq if sliding else c.rope_theta
        self.scale = c.query_pre_attn_scalar ** -0.5
        self.q_norm = GemmaRMSNorm(c.head_dim, eps=c.layer_norm_epsilon)
        self.k_norm = GemmaRMSNorm(c.head_dim, eps=c.layer_norm_epsilon)


class GemmaBlock(nn.Module):
    """A Gemma 3 layer: ``x + post_attention(attn(input(x)))``, then
    ``x + post_feedforward(mlp(pre_feedforward(x)))``."""

    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.n_embd, config.layer_norm_epsilon
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = GatedMLP(config, partial(F.gelu, approximate="tanh"))
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, **positions: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cache, layer_idx, start, attn_mask,
                              **positions)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Decoder(BlocksDecoder):
    """A :class:`~kvdoc.core.frame.BlocksDecoder` of :class:`GemmaBlock` s (a hybrid cache).

    >>> Gemma3Decoder(Gemma3Config()).num_parameters()   # the head tied to wte
    80576
    """

    def __init__(self, config: Gemma3Config | None = None) -> None:
        c = config or Gemma3Config()
        super().__init__(c, GemmaBlock, GemmaRMSNorm, ScaledEmbedding, lambda: SoftCappedHead(
            c.n_embd, c.vocab_size, c.final_logit_softcapping))
