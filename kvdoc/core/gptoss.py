"""A gpt-oss-style decoder: a learned sink logit per head in every softmax, window and full layers.

Each query head ``h`` has one learned logit ``s_h``, the *sink*, that joins the softmax's
denominator and nothing else: the weight of key ``j`` is
``exp(a_j) / (exp(s_h) + sum_k exp(a_k))`` over the keys the query reads, so a head may attend
to nothing (its weights sum to less than 1; the rest goes to a value of zero). The sink is a
parameter, not a cached row: a cache holds K and V as for any attention, and a window layer keeps
its last ``W`` rows (:func:`~kvdoc.core.window.window_cache`, the hybrid cache Gemma's decoder
uses), while the sink stays in the denominator of every query, however many keys it reads.

The rest is gpt-oss's, as transformers 5.24's ``GptOssForCausalLM`` computes it: window and
full layers alternating, the window layers first; biases on Q, K, V and the output; RoPE, by
default YaRN-scaled (:func:`yarn_frequencies`); RMSNorms before the attention and the MLP; and
for the MLP a mixture of experts (:class:`GptOssMLP`). Parameter names inside a layer are
transformers', so a checkpoint maps by key (:mod:`kvdoc.interop.hf_gptoss`); the default cache
is hybrid.

>>> _ = torch.manual_seed(0)
>>> model = GptOssDecoder(GptOssConfig(sliding_window=4)).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18, 3, 5]])
>>> full = model(ids).logits
>>> _, cache = model(ids[:, :6], model.new_cache(1))       # hybrid: layer 0 slides
>>> cache.held(0), cache.held(1)
(range(2, 6), range(0, 6))
>>> torch.allclose(model(ids[:, 6:], cache).logits, full[:, 6:], atol=1e-5)
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .cache import check_int, check_positive
from .frame import (
    GLOBAL,
    SLIDING,
    BlocksDecoder,
    HeadsAttention,
    PreNormBlock,
    WindowLayers,
    check_layer_types,
    check_multiples,
    every_nth_full,
)
from .model import rotate_half


@dataclass(frozen=True)
class GptOssConfig(WindowLayers):
    """Sizes of a gpt-oss-style decoder (names as :class:`~kvdoc.core.model.GPTConfig`'s, or as
    gpt-oss's ``config.json`` where GPT-2 has none).

    ``layer_types`` None: window layers at even indices, full ones at odd (gpt-oss's).
    ``yarn_factor`` None: plain RoPE at ``rope_theta``; else YaRN with ``yarn_factor``,
    ``yarn_original_positions`` (``original_max_position_embeddings``), ``yarn_beta_fast``,
    ``yarn_beta_slow`` and ``yarn_truncate`` (:func:`yarn_frequencies`). ``n_inner`` is an
    expert's hidden width; ``experts_per_token`` of ``n_experts`` serve each token.

    >>> GptOssConfig().types, GptOssConfig().layer_windows
    (('sliding_attention', 'full_attention'), (32, None))
    >>> GptOssConfig(experts_per_token=5)
    Traceback (most recent call last):
    ...
    ValueError: experts_per_token=5 must be at most n_experts=4
    """

    vocab_size: int = 97
    n_positions: int = 512
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    head_dim: int = 16
    n_inner: int = 32
    n_experts: int = 4
    experts_per_token: int = 2
    n_layer: int = 2
    sliding_window: int = 32
    layer_types: tuple[str, ...] | None = None
    layer_norm_epsilon: float = 1e-5
    rope_theta: float = 150000.0
    yarn_factor: float | None = 32.0
    yarn_original_positions: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_head", "n_kv_head", "n_embd", "head_dim",
                     "n_inner", "n_experts", "experts_per_token", "n_layer", "sliding_window",
                     "yarn_original_positions"):
            check_int(name, getattr(self, name))
        for name in ("layer_norm_epsilon", "rope_theta", "yarn_beta_fast", "yarn_beta_slow",
                     "swiglu_alpha", "swiglu_limit"):
            check_positive(name, getattr(self, name))
        if self.yarn_factor is not None:
            check_positive("yarn_factor", self.yarn_factor)
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be at most "
                             f"n_experts={self.n_experts}")
        check_multiples(self, ("n_head", "n_kv_head"))
        if self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs: head_dim={self.head_dim} must be even")
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.n_layer, (SLIDING, GLOBAL))

    @property
    def types(self) -> tuple[str, ...]:
        """``layer_types``, or where it is None gpt-oss's alternation, a window layer first."""
        return self.layer_types or every_nth_full(self.n_layer, 2)


def yarn_frequencies(config: GptOssConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[D_h / 2]`` (float64) and the factor cos and sin are multiplied by.

    YaRN keeps the fast-turning pairs (more than ``beta_fast`` turns over the original context)
    at their frequency, divides the slow ones (fewer than ``beta_slow`` turns) by ``factor``, and
    ramps linearly between; the attention factor is ``0.1 ln(factor) + 1``. This is
    transformers' ``_compute_yarn_parameters`` (``modeling_rope_utils.py``), in float64.

    >>> freq, scale = yarn_frequencies(GptOssConfig(yarn_factor=None, rope_theta=100.0,
    ...                                             head_dim=4))
    >>> freq.tolist(), scale
    ([1.0, 0.1], 1.0)
    """
    c, dim = config, config.head_dim
    base = c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if c.yarn_factor is None:
        return 1.0 / base, 1.0

    def turns_dim(turns: float) -> float:  # the pair index that turns ``turns`` times
        return dim * math.log(c.yarn_original_positions / (turns * 2 * math.pi)) / (
            2 * math.log(c.rope_theta))

    low, high = turns_dim(c.yarn_beta_fast), turns_dim(c.yarn_beta_slow)
    if c.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv = ramp / (c.yarn_factor * base) + (1 - ramp) / base
    scale = 0.1 * math.log(c.yarn_factor) + 1.0 if c.yarn_factor > 1 else 1.0
    return inv, scale


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """``softmax([q k^T * scale + mask, s_h]) v`` without the sink's column: ``[B, H, C, D_h]``.

    ``q`` ``[B, H, C, D_h]``; ``k``, ``v`` ``[B, H_kv, T, D_h]``; ``sinks`` ``[H]``; ``mask``
    ``[C, T]`` or ``[B, C, T]`` (True: may read). A row that reads no key gives zeros.

    >>> q, k, v = torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 3, 2), torch.ones(1, 1, 3, 2)
    >>> out = sink_attention(q, k, v, torch.tensor([math.log(3.0)]))  # 3 keys of e^0, e^ln 3
    >>> [round(x, 6) for x in out[0, 0, 0].tolist()]               # 3 / (3 + 3)
    [0.5, 0.5]
    """
    if invariant.active():  # the mode's fixed order, the sink first in each denominator
        return invariant.attention(q, k, v, mask, scale, sinks)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~(mask if mask.dim() == 2 else mask[:, None]), -math.inf)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]  # the sink dropped
    return weights @ v


class GptOssAttention(HeadsAttention):
    """gpt-oss's attention of layer ``layer_idx``: its window (or none), a sink per query head.

    >>> attn = GptOssAttention(GptOssConfig(), layer_idx=0)
    >>> attn.window, tuple(attn.sinks.shape), attn(torch.zeros(2, 3, 64), None, 0, 0).shape
    (32, (4,), torch.Size([2, 3, 64]))
    """

    def __init__(self, config: GptOssConfig, layer_idx: int) -> None:
        super().__init__(c := config, bias=True)
        self.window = c.layer_windows[layer_idx]
        self.sinks = nn.Parameter(torch.randn(c.n_head))  # N(0, 1): a fresh model's sinks count
        # float64 whatever the model's dtype: not a buffer, which ``.to(dtype)`` would round
        self.inv_freq, self.rope_scale = yarn_frequencies(c)

    def rope(self, x: torch.Tensor, at: int | torch.Tensor) -> torch.Tensor:
        """RoPE at positions ``at ..`` (or the positions a tensor holds, ``[C]`` or ``[B, C]``),
        the angles in float64, cos and sin times YaRN's factor."""
        if isinstance(at, int):
            at = torch.arange(at, at + x.shape[2], device=x.device)
        angles = at.to(torch.float64)[..., None] * self.inv_freq.to(at.device)
        angles = torch.cat((angles, angles), dim=-1)  # [C, D_h] or [B, C, D_h]
        if angles.dim() == 3:
            angles = angles[:, None]
        cos, sin = (f(angles) * self.rope_scale for f in (torch.cos, torch.sin))
        return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        return sink_attention(q, k, v, self.sinks, mask)


class GptOssExperts(nn.Module):
    """``n_experts`` clamped-SwiGLU MLPs, weights stacked as transformers stores them (inputs by
    outputs, gate and up interleaved in ``gate_up_proj``'s columns)."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        E, d, inner = config.n_experts, config.n_embd, config.n_inner
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.randn(E, d, 2 * inner) * d ** -0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * inner) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, inner, d) * inner ** -0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(E, d) * 0.1)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``(clamp(up, -L, L) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, L)``.

        >>> experts = GptOssExperts(GptOssConfig())
        >>> experts.swiglu(torch.tensor([100.0, 0.0])).item() == 7.0 * torch.sigmoid(
        ...     torch.tensor(7.0 * 1.702)).item()                 # the gate clamped at 7
        True
        """
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, d] -> [E, N, d], every expert
        hidden = self.swiglu(torch.einsum("nd,edf->enf", x, self.gate_up_proj)
                             + self.gate_up_proj_bias[:, None])
        return torch.einsum("enf,efd->end", hidden, self.down_proj) + self.down_proj_bias[:, None]


class GptOssRouter(nn.Module):
    """Router logits ``x W^T + b`` over the experts."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        # logits about N(0, 1) for a normed row: the top k seldom near a tie
        self.weight = nn.Parameter(torch.randn(config.n_experts, config.n_embd)
                                   * config.n_embd ** -0.5)
        self.bias = nn.Parameter(torch.randn(config.n_experts) * 0.1)


class GptOssMLP(nn.Module):
    """Each token's top ``k`` experts, weighted by a softmax over their router logits. Row ``t``
    needs row ``t`` only; every expert runs on every row (the sizes here are small), the ones
    not picked weighted by zero."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.router = GptOssRouter(config)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, d]
        # under the mode a row alone: the experts' einsums and the softmax over the picked
        # logits reduce in library code, whose order would follow the number of rows
        out = invariant.per_row(self.mix, rows) if invariant.active() else self.mix(rows)
        return out.view(x.shape)

    def mix(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N, d] -> [N, d]``: each row's picked experts, weighted."""
        logits = F.linear(rows, self.router.weight, self.router.bias)  # [N, E]
        top, picked = logits.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(logits).scatter(-1, picked, top.softmax(dim=-1))
        return torch.einsum("ne,end->nd", weights, self.experts(rows))


class GptOssBlock(PreNormBlock):
    """``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, config: GptOssConfig, layer_idx: int) -> None:
        d, eps = config.n_embd, config.layer_norm_epsilon
        super().__init__(("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"),
                         input_layernorm=nn.RMSNorm(d, eps=eps),
                         self_attn=GptOssAttention(config, layer_idx),
                         post_attention_layernorm=nn.RMSNorm(d, eps=eps), mlp=GptOssMLP(config))


class GptOssDecoder(BlocksDecoder):
    """A :class:`~kvdoc.core.frame.BlocksDecoder` of :class:`GptOssBlock` s (a hybrid cache).

    >>> GptOssDecoder(GptOssConfig()).num_parameters()   # 4 experts of 32 in each layer
    88400
    """

    def __init__(self, config: GptOssConfig | None = None) -> None:
        super().__init__(config or GptOssConfig(), GptOssBlock)
