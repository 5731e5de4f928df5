"""A Qwen3.5-style hybrid decoder: Gated DeltaNet layers with gated full-attention layers.

Each layer is of one of two types (``config.layer_types``, as transformers names them; by
default every second layer is full attention):

* ``"linear_attention"``, a Gated DeltaNet: one projection gives Q, K and V for every head, a
  causal depthwise convolution of ``K_conv`` taps (then SiLU) mixes each channel with its last
  ``K_conv - 1`` inputs, and a state ``S`` (``[H_v, D_k, D_v]``) folds every earlier token by
  the gated delta rule (:mod:`kvdoc.core.delta_rule`: a token at a time in a decode step,
  ``chunk_size`` at a time in a longer call), then a per-head RMSNorm gated by ``silu(z)``. The
  cache keeps the conv window and ``S``: a :class:`~kvdoc.core.state.StateLayer`;
* ``"full_attention"``: softmax attention with q/k RMSNorms, RoPE on the first
  ``partial_rotary_factor`` of each head's features, and the heads' output times
  ``sigmoid(gate)``, a gate per head from ``q_proj``.

Every other RMSNorm scales by ``1 + weight`` (:class:`~kvdoc.core.gemma.GemmaRMSNorm`); the MLP
is SwiGLU. Parameter names inside a layer are transformers', so a checkpoint maps by key
(:mod:`kvdoc.interop.hf_qwen35`).

>>> _ = torch.manual_seed(0)
>>> model = DeltaNetDecoder(DeltaNetConfig()).eval()
>>> model.config.layer_types
('linear_attention', 'full_attention')
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18, 3, 5]])
>>> full = model(ids).logits
>>> _, cache = model(ids[:, :6], model.new_cache(1))       # a state layer, then a K/V layer
>>> cache.held(0), cache.held(1)
(range(6, 6), range(0, 6))
>>> torch.allclose(model(ids[:, 6:], cache).logits, full[:, 6:], atol=1e-5)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, LayerSpec, check_int, check_positive
from .delta_rule import chunked_delta_rule, l2norm, recurrent_delta_rule
from .frame import (
    GLOBAL,
    LINEAR,
    GatedMLP,
    HeadsAttention,
    HybridDecoder,
    PreNormBlock,
    check_layer_types,
    check_multiples,
    every_nth_full,
)
from .gemma import GemmaRMSNorm
from .state import RecurrentMixer, StateSpec


@dataclass(frozen=True)
class DeltaNetConfig:
    """Sizes of a Qwen3.5-style hybrid (names as :class:`~kvdoc.core.model.GPTConfig`'s, or as
    Qwen3.5's ``config.json`` where GPT-2 has none). ``chunk_size`` is kvdoc's: the tokens
    :func:`~kvdoc.core.delta_rule.chunked_delta_rule` takes at once (not a property of the
    model).

    >>> DeltaNetConfig(n_layer=4).layer_types[-1], DeltaNetConfig().cache_layout[0].shapes
    ('full_attention', (('conv', (64, 3)), ('recurrent', (4, 8, 8))))
    >>> DeltaNetConfig(linear_num_value_heads=3)
    Traceback (most recent call last):
    ...
    ValueError: linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2
    """

    vocab_size: int = 97
    n_positions: int = 512
    n_embd: int = 64
    n_inner: int = 128
    n_layer: int = 2
    layer_types: tuple[str, ...] | None = None  # None: every_nth_full(n_layer, 2, LINEAR)
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 16
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000.0
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 8
    linear_value_head_dim: int = 8
    linear_conv_kernel_dim: int = 4
    layer_norm_epsilon: float = 1e-6
    tie_word_embeddings: bool = False
    chunk_size: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_inner", "n_layer",
                     "n_head", "n_kv_head", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "chunk_size"):
            check_int(name, getattr(self, name))
        check_int("linear_conv_kernel_dim", self.linear_conv_kernel_dim, minimum=2)
        for name in ("rope_theta", "layer_norm_epsilon", "partial_rotary_factor"):
            check_positive(name, getattr(self, name))
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", every_nth_full(self.n_layer, 2, LINEAR))
        check_layer_types(self.layer_types, self.n_layer, (LINEAR, GLOBAL))
        check_multiples(self, ("n_head", "n_kv_head"),
                        ("linear_num_value_heads", "linear_num_key_heads"))
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"RoPE rotates pairs: head_dim x partial_rotary_factor = "
                             f"{self.rotary_dim} must be even and within head_dim")

    @property
    def rotary_dim(self) -> int:  # the leading features of a head RoPE turns, as transformers'
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:  # Q, K and V channels of a DeltaNet layer, convolved together
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @cached_property
    def cache_layout(self) -> tuple[LayerSpec | StateSpec, ...]:
        """A :class:`~kvdoc.core.state.StateSpec` per DeltaNet layer (``conv``: the last
        ``K_conv - 1`` inputs of each channel; ``recurrent``: ``S``), K/V per attention layer."""
        state = StateSpec((("conv", (self.conv_dim, self.linear_conv_kernel_dim - 1)),
                           ("recurrent", (self.linear_num_value_heads, self.linear_key_head_dim,
                                          self.linear_value_head_dim))))
        kv = LayerSpec(self.n_kv_head, (self.head_dim, self.head_dim))
        return tuple(state if t == LINEAR else kv for t in self.layer_types)


class GatedDeltaNet(RecurrentMixer):
    """A Gated DeltaNet layer (transformers' ``Qwen3_5GatedDeltaNet``, its parameter names), its
    conv window and state kept in ``cache``'s layer ``layer_idx``."""

    def __init__(self, config: DeltaNetConfig) -> None:
        super().__init__()
        c = config
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.chunk_size, self.taps = c.chunk_size, c.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, self.taps, groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, c.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.hv * self.dv, c.n_embd, bias=False)
        self.in_proj_qkv = nn.Linear(c.n_embd, c.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.n_embd, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(c.n_embd, self.hv, bias=False)
        self.in_proj_a = nn.Linear(c.n_embd, self.hv, bias=False)

    def zero_state(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv window and state before the first token: zeros."""
        B = x.shape[0]
        return (x.new_zeros(B, self.conv1d.in_channels, self.taps - 1),
                x.new_zeros(B, self.hv, self.dk, self.dv))

    def final_state(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv window and state after the layer's inputs ``x`` (``[B, T, d]``) from zeros,
        a token at a time (what a cache of this layer should hold after ``T`` positions)."""
        return self.mix(x, *self.zero_state(x), recurrent=True)[1:]

    def mix(self, x: torch.Tensor, window: torch.Tensor, state: torch.Tensor,
            recurrent: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's outputs ``[B, C, d]`` for inputs ``x`` after ``window`` and ``state``, and
        the window and state after them; the delta rule in its recurrent form (a token at a
        time) or its chunked one, by default the recurrent one for one token (a decode step)."""
        B, C, _ = x.shape
        mixed, window = self.conv(self.in_proj_qkv(x), window)
        q, k, v = mixed.split((self.hk * self.dk,) * 2 + (self.hv * self.dv,), -1)

        def heads(t: torch.Tensor, n: int, width: int) -> torch.Tensor:  # -> [B, H_v, C, width]
            # each Q/K head serves H_v / H_k consecutive value heads
            return t.view(B, C, n, width).transpose(1, 2).repeat_interleave(self.hv // n, dim=1)

        q = l2norm(heads(q, self.hk, self.dk)) * self.dk ** -0.5
        k, v = l2norm(heads(k, self.hk, self.dk)), heads(v, self.hv, self.dv)
        beta = self.in_proj_b(x).sigmoid().transpose(1, 2)  # [B, H_v, C]
        g = (-self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)).transpose(1, 2)
        recurrent = C == 1 if recurrent is None else recurrent
        if recurrent:
            out, state = recurrent_delta_rule(q, k, v, g, beta, state)
        else:
            out, state = chunked_delta_rule(q, k, v, g, beta, state, self.chunk_size)
        z = self.in_proj_z(x).view(B, C, self.hv, self.dv)
        out = self.norm(out.transpose(1, 2), z)  # [B, C, H_v, D_v]
        return self.out_proj(out.reshape(B, C, -1)), window, state


class GatedRMSNorm(nn.Module):
    """``x / rms(x) * weight * silu(gate)`` (``weight`` starts at one, as transformers'
    ``Qwen3_5RMSNormGated``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed * F.silu(gate)


class GatedAttention(HeadsAttention):
    """Qwen3.5's full attention: q/k norms, partial RoPE, and an output gate per feature."""

    def __init__(self, config: DeltaNetConfig) -> None:
        super().__init__(c := config, q_per_head=2)  # each head's query and gate
        self.rotary_dim, self.rope_theta = c.rotary_dim, c.rope_theta
        self.q_norm = GemmaRMSNorm(c.head_dim, c.layer_norm_epsilon)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, _ = x.shape
        D = self.head_dim
        q, gate = self.q_proj(x).view(B, C, self.n_head, 2 * D).split(D, dim=-1)
        at = start if positions is None else positions
        q = self.rope(self.q_norm(q.transpose(1, 2)), at)  # [B, H, C, D_h]
        k = self.rope(self.k_norm(self.heads(self.k_proj, x)), at)
        v = self.heads(self.v_proj, x)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, start)
        y = self.attend(q, k, v, start, attn_mask).transpose(1, 2)
        return self.o_proj((y * gate.sigmoid()).reshape(B, C, -1))


class DeltaNetBlock(PreNormBlock):
    """``x + mixer(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``; the
    mixer a :class:`GatedDeltaNet` (``linear_attn``) or a :class:`GatedAttention`
    (``self_attn``)."""

    def __init__(self, config: DeltaNetConfig, layer_idx: int) -> None:
        c, mixer = config, "linear_attn" if config.layer_types[layer_idx] == LINEAR else "self_attn"
        super().__init__(
            ("input_layernorm", mixer, "post_attention_layernorm", "mlp"),
            **{mixer: GatedDeltaNet(c) if mixer == "linear_attn" else GatedAttention(c)},
            mlp=GatedMLP(c), input_layernorm=GemmaRMSNorm(c.n_embd, c.layer_norm_epsilon),
            post_attention_layernorm=GemmaRMSNorm(c.n_embd, c.layer_norm_epsilon))


class DeltaNetDecoder(HybridDecoder):
    """A :class:`~kvdoc.core.frame.HybridDecoder` of :class:`DeltaNetBlock` s.

    >>> DeltaNetDecoder(DeltaNetConfig()).num_parameters()
    87280
    """

    rows_refused = ("a recurrent state folds every row of a call in order: a DeltaNet "
                    "model takes no attn_mask or positions (no padded batches)")
    cache_owner = "a DeltaNet model's"

    def __init__(self, config: DeltaNetConfig | None = None) -> None:
        super().__init__(config or DeltaNetConfig(), DeltaNetBlock, GemmaRMSNorm)
