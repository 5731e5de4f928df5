"""A Mamba-2 hybrid decoder (Bamba's layout): Mamba-2 mixer layers and attention layers in one
model, each followed by a SwiGLU MLP.

A mixer layer keeps no K/V. What its next token needs from the past is two fixed-size tensors
per sequence: the last ``d_conv - 1`` inputs of its causal depthwise convolution (the *conv
state*, ``[B, conv_dim, d_conv - 1]``) and the SSD state ``S`` (``[B, H, P, N]``: per head a
``P x N`` matrix, a decayed sum over every earlier token). Per head ``h`` and position ``t``,
with ``dt_t = clamp(softplus(dt_raw_t + dt_bias))`` and ``A = -exp(A_log)``::

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t + D x_t

:func:`ssd_step` is that recurrence (a decode step); :func:`ssd_chunked` computes the same
function a chunk at a time (prefill and chunks: the intra-chunk part as a masked,
attention-like product, the state carried between chunks). ``y`` is gated
(``y * silu(z)``), RMS-normed per group, and projected out.

transformers 5.24.0's ``BambaForCausalLM`` is the reference (:mod:`kvdoc.interop.hf_bamba`,
which also says why its own decode steps depart from its forward); parameter names inside a
layer are its names, and its RoPE turns the first half of each attention head only.

>>> _ = torch.manual_seed(0)
>>> model = MambaDecoder(Mamba2Config()).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18, 3, 5]])
>>> full = model(ids).logits
>>> _, cache = model(ids[:, :5], model.new_cache(1))
>>> _, cache = model(ids[:, 5:6], cache)                   # a recurrent step
>>> torch.allclose(model(ids[:, 6:], cache).logits, full[:, 6:], atol=1e-5)
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from .cache import LayerSpec, check_int, check_positive
from .frame import (
    GLOBAL,
    LINEAR,
    GatedMLP,
    HeadsAttention,
    HybridDecoder,
    PreNormBlock,
    check_layer_indices,
    check_multiples,
)
from .state import RecurrentMixer, StateSpec


@dataclass(frozen=True)
class Mamba2Config:
    """Sizes of a Mamba-2 hybrid (names as :class:`~kvdoc.core.model.GPTConfig`'s, or as
    ``BambaConfig``'s where GPT-2 has none). ``attn_layers``: the attention layers' indices, the
    others Mamba-2; ``mamba_n_heads`` heads of ``mamba_expand * n_embd / mamba_n_heads``
    channels, ``mamba_n_groups`` groups sharing B and C; ``mamba_d_state``: ``N``;
    ``chunk_size``: positions per chunk of :func:`ssd_chunked`; ``time_step_limit``: the clamp
    of ``dt``.

    >>> c = Mamba2Config()
    >>> c.layer_types, c.mamba_head_dim, c.conv_dim, c.rotary_dim
    (('full_attention', 'linear_attention'), 16, 160, 8)
    >>> Mamba2Config(mamba_n_heads=5)
    Traceback (most recent call last):
    ...
    ValueError: mamba_inner=128 must be a multiple of mamba_n_heads=5
    """

    vocab_size: int = 97
    n_positions: int = 512
    n_layer: int = 2
    attn_layers: tuple[int, ...] = (0,)
    n_embd: int = 64
    n_inner: int = 128  # the MLP's hidden width
    n_head: int = 4
    n_kv_head: int = 2
    mamba_n_heads: int = 8
    mamba_n_groups: int = 1
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    chunk_size: int = 16
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    layer_norm_epsilon: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_layer", "n_embd", "n_inner", "n_head",
                     "n_kv_head", "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
                     "mamba_expand", "chunk_size"):
            check_int(name, getattr(self, name))
        check_int("mamba_d_conv", self.mamba_d_conv, minimum=2)  # a state of d_conv - 1 inputs
        check_layer_indices("attn_layers", self.attn_layers, self.n_layer)
        check_positive("layer_norm_epsilon", self.layer_norm_epsilon)
        check_positive("rope_theta", self.rope_theta)
        lo, hi = self.time_step_limit
        if not 0.0 <= lo < hi:
            raise ValueError(f"time_step_limit must be (lo, hi) with 0 <= lo < hi, got {(lo, hi)}")
        check_multiples(self, ("n_embd", "n_head"), ("n_head", "n_kv_head"),
                        ("mamba_inner", "mamba_n_heads"), ("mamba_n_heads", "mamba_n_groups"))
        if self.head_dim % 4:
            raise ValueError(f"RoPE turns pairs of the first half of a head: head_dim="
                             f"{self.head_dim} must be a multiple of 4")

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(GLOBAL if i in self.attn_layers else LINEAR for i in range(self.n_layer))

    @property
    def head_dim(self) -> int:  # an attention head
        return self.n_embd // self.n_head

    @property
    def rotary_dim(self) -> int:  # Bamba turns the first half of each head
        return self.head_dim // 2

    @property
    def mamba_inner(self) -> int:  # I: the channels of all heads, x and the gate z each
        return self.mamba_expand * self.n_embd

    @property
    def mamba_head_dim(self) -> int:  # P
        return self.mamba_inner // self.mamba_n_heads

    @property
    def conv_dim(self) -> int:  # x, B and C go through the convolution together
        return self.mamba_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @cached_property
    def cache_layout(self) -> tuple[LayerSpec | StateSpec, ...]:
        """K and V of ``n_kv_head`` heads per attention layer, the conv and SSD state
        (:meth:`state_shapes`) per Mamba layer."""
        kv = LayerSpec(self.n_kv_head, (self.head_dim, self.head_dim))
        state = StateSpec(tuple(self.state_shapes().items()))
        return tuple(kv if t == GLOBAL else state for t in self.layer_types)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """A Mamba layer's state per sequence: the last ``d_conv - 1`` inputs of the convolution
        and the SSD state ``[H, P, N]``."""
        return {"conv": (self.conv_dim, self.mamba_d_conv - 1),
                "recurrent": (self.mamba_n_heads, self.mamba_head_dim, self.mamba_d_state)}


# --- the SSD recurrence, two ways ------------------------------------------------------------

def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One position: ``x`` ``[b, H, P]``, ``dt`` ``[b, H]``, ``A``, ``D`` ``[H]``, ``B``, ``C``
    ``[b, H, N]`` (a group's copied to its heads), ``state`` ``[b, H, P, N]`` -> ``y``
    ``[b, H, P]`` and the next state."""
    decay = torch.exp(dt * A)[..., None, None]  # [b, H, 1, 1]
    state = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, C) + D[:, None] * x
    return y, state


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssd_step` over ``T`` positions (``x`` ``[b, T, H, P]``, ``dt`` ``[b, T, H]``,
    ``B``, ``C`` ``[b, T, H, N]``), ``chunk`` at a time: within a chunk ``y_t`` sums
    ``exp(a_s+1 + .. + a_t) (C_t . B_s) dt_s x_s`` over ``s <= t`` (``a = dt A``) plus the
    entering state decayed to ``t``; the state leaves decayed to the chunk's end.

    >>> g = torch.Generator().manual_seed(0)
    >>> b, T, H, P, N = 2, 9, 3, 4, 5
    >>> x, B, C = (torch.randn(b, T, H, n, generator=g, dtype=torch.float64) for n in (P, N, N))
    >>> dt = torch.rand(b, T, H, generator=g, dtype=torch.float64)
    >>> A, D = -torch.rand(H, dtype=torch.float64, generator=g), torch.ones(H, dtype=torch.float64)
    >>> s0 = torch.randn(b, H, P, N, generator=g, dtype=torch.float64)
    >>> y, s = ssd_chunked(x, dt, A, B, C, D, s0, chunk=4)
    >>> ys, step = [], s0
    >>> for t in range(T):
    ...     y_t, step = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], D, step)
    ...     ys.append(y_t)
    >>> [float((a - b).abs().max()) < 1e-12 for a, b in ((y, torch.stack(ys, 1)), (s, step))]
    [True, True]
    """
    ys = []
    for lo in range(0, x.shape[1], chunk):
        xc, dtc, Bc, Cc = (t[:, lo:lo + chunk] for t in (x, dt, B, C))
        L = xc.shape[1]
        cum = torch.cumsum(dtc * A, dim=1)  # [b, L, H]: log-decay from the chunk's start
        seg = cum[:, :, None, :] - cum[:, None, :, :]  # [b, t, s, H]: from s to t
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], -math.inf))
        scores = torch.einsum("bthn,bshn->btsh", Cc, Bc) * decay
        xdt = xc * dtc[..., None]  # [b, L, H, P]
        y = torch.einsum("btsh,bshp->bthp", scores, xdt)
        y = y + torch.einsum("bthn,bhpn->bthp", Cc, state) * torch.exp(cum)[..., None]
        to_end = torch.exp(cum[:, -1:] - cum)  # [b, L, H]: from s to the chunk's end
        state = (state * torch.exp(cum[:, -1])[..., None, None]
                 + torch.einsum("bshp,bshn->bhpn", xdt * to_end[..., None], Bc))
        ys.append(y + D[:, None] * xc)
    return torch.cat(ys, dim=1), state


# --- the layers ------------------------------------------------------------------------------

class GatedRMSNorm(nn.Module):
    """``rmsnorm(y * silu(z))`` over each of ``groups`` groups of channels, times ``weight``."""

    def __init__(self, width: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = y * F.silu(z)
        g = y.view(*y.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(y.shape)


class Mamba2Mixer(RecurrentMixer):
    """Bamba's Mamba-2 mixer: ``in_proj`` to (z, xBC, dt), the causal depthwise ``conv1d`` and
    SiLU on xBC, the SSD over (x, B, C, dt), ``norm(y, z)``, ``out_proj``. A call of one token
    runs :attr:`step`, a longer one :attr:`scan`."""

    step, scan = staticmethod(ssd_step), staticmethod(ssd_chunked)

    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        c = config
        self.config = c
        H, inner = c.mamba_n_heads, c.mamba_inner
        self.in_proj = nn.Linear(c.n_embd, inner + c.conv_dim + H, bias=c.proj_bias)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.mamba_d_conv, groups=c.conv_dim,
                                bias=c.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = GatedRMSNorm(inner, c.mamba_n_groups, c.layer_norm_epsilon)
        self.out_proj = nn.Linear(inner, c.n_embd, bias=c.proj_bias)

    def mix(self, u: torch.Tensor, conv_state: torch.Tensor,
            ssm_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``u`` ``[b, C, d]`` after the given states -> ``[b, C, d]``, conv and SSD states."""
        c = self.config
        b, C, _ = u.shape
        H, P, G, N = c.mamba_n_heads, c.mamba_head_dim, c.mamba_n_groups, c.mamba_d_state
        z, xBC, dt = self.in_proj(u).split((c.mamba_inner, c.conv_dim, H), dim=-1)
        xBC, conv_state = self.conv(xBC, conv_state)
        x, B, Cm = xBC.split((c.mamba_inner, G * N, G * N), dim=-1)
        x = x.view(b, C, H, P)
        # head h reads group h // (H / G)'s B and C
        B, Cm = (t.view(b, C, G, N).repeat_interleave(H // G, dim=2) for t in (B, Cm))
        dt = F.softplus(dt + self.dt_bias).clamp(*c.time_step_limit)
        A = -torch.exp(self.A_log)
        if C == 1:  # a decode step: the recurrence itself
            y, ssm_state = self.step(x[:, 0], dt[:, 0], A, B[:, 0], Cm[:, 0], self.D, ssm_state)
            y = y[:, None]
        else:
            y, ssm_state = self.scan(x, dt, A, B, Cm, self.D, ssm_state, c.chunk_size)
        y = self.norm(y.reshape(b, C, -1), z)
        return self.out_proj(y), conv_state, ssm_state

    def final_state(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and SSD states after ``u`` ``[b, C, d]``, from zero states in one call."""
        return self.mix(u, *self.zero_state(u))[1:]

    def zero_state(self, u: torch.Tensor) -> list[torch.Tensor]:  # what an empty cache holds
        return [u.new_zeros(u.shape[0], *shape) for shape in self.config.state_shapes().values()]


class HybridAttention(HeadsAttention):
    """Bamba's attention: RoPE on the first ``rotary_dim`` features of each head (as Qwen3.5's),
    no q/k norms, no gate."""

    def __init__(self, config: Mamba2Config) -> None:
        super().__init__(c := config)
        self.rotary_dim, self.rope_theta = c.rotary_dim, c.rope_theta


class HybridBlock(PreNormBlock):
    """``x + mixer(input_layernorm(x))`` (``mamba`` or ``self_attn``), then
    ``x + mlp(pre_ff_layernorm(x))`` (Bamba's ``feed_forward``: Qwen3.5's MLP)."""

    def __init__(self, config: Mamba2Config, layer_idx: int) -> None:
        c, mixer = config, "mamba" if config.layer_types[layer_idx] == LINEAR else "self_attn"
        super().__init__(
            ("input_layernorm", mixer, "pre_ff_layernorm", "mlp"),
            input_layernorm=nn.RMSNorm(c.n_embd, eps=c.layer_norm_epsilon),
            **{mixer: Mamba2Mixer(c) if mixer == "mamba" else HybridAttention(c)},
            pre_ff_layernorm=nn.RMSNorm(c.n_embd, eps=c.layer_norm_epsilon), mlp=GatedMLP(c))


class MambaDecoder(HybridDecoder):
    """A :class:`~kvdoc.core.frame.HybridDecoder` of :class:`HybridBlock` s.

    >>> MambaDecoder(Mamba2Config()).num_parameters()  # 2 x (MLP 24576 + norms 128) + mixer
    102264
    """

    rows_refused = ("a Mamba-2 layer folds every position into its state: padded batches "
                    "(attn_mask) and per-row positions are not supported")
    cache_owner = "a Mamba-2 hybrid's"

    def __init__(self, config: Mamba2Config | None = None) -> None:
        super().__init__(config or Mamba2Config(), HybridBlock)
