"""DeepSeek-V4's attention layers, and a decoder of them with dense MLPs.

Each layer reads one shared head whose keys are its values (``K = V``, ``D`` wide, the trailing
``rope_head_dim`` channels turned by interleaved RoPE), over a window of the last ``W`` positions,
with a learned sink per query head (a logit in the softmax's denominator that reads no value).
A compressed layer also reads entries: a CSA layer one per block of ``csa_rate`` positions, of
which its indexer picks ``index_topk`` per query; an HCA layer one per block of ``hca_rate``, all
of them. Entry ``w`` pools its block's rows (a CSA entry also half of block ``w - 1``'s) by a
softmax over learned gates, is RMS-normalised and turned at position ``w x rate``; query ``t``
reads it once the block is finished, ``(w + 1) x rate <= t + 1``. The output's rotary channels are
turned back by the query's angle, then a grouped low-rank projection mixes the heads. The names
and the arithmetic are transformers 5.24's ``DeepseekV4Attention``
(:mod:`kvdoc.interop.hf_deepseek_v4` matches them); its MoE and hyper-connections are not here:
:class:`CompressedDecoder` is pre-norm blocks with a SwiGLU MLP and plain residuals. Its cache is
:func:`kvdoc.core.compressed.compressed_cache`.

The indexer's top-k breaks ties by position, the earlier entry first (a stable sort), so a
query's selection depends on its scores alone, whatever the call's shape.

>>> _ = torch.manual_seed(0)
>>> model = CompressedDecoder(CompressedConfig()).eval()
>>> ids = torch.randint(0, 97, (1, 21))
>>> full = model(ids).logits
>>> _, cache = model(ids[:, :13], model.new_cache(1))     # 13: no multiple of 4 or 8
>>> torch.allclose(model(ids[:, 13:], cache).logits, full[:, 13:], atol=1e-5)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, LayerSpec, check_int, check_positive, offset_causal_mask
from .compressed import compressed_cache
from .frame import BlocksDecoder
from .gptoss import sink_attention
from .indexed import index_scores, select
from .mla import LatentBlock
from .model import rope_angles

LAYER_TYPES = ("sliding", "csa", "hca")


@dataclass(frozen=True)
class CompressedConfig:
    """Sizes of a decoder of V4 attention layers (V4's names in brackets where they differ).

    ``layer_types``: one of :data:`LAYER_TYPES` per layer; ``sliding_window`` ``W``; ``csa_rate``
    and ``hca_rate`` (``compress_rates``); ``index_*``: the CSA indexer's heads, width and
    picks; ``rope_theta`` turns the window-only layers, ``compress_rope_theta`` the others.

    >>> cfg = CompressedConfig()
    >>> cfg.n_layer, cfg.layer_storage(0)["rate"], cfg.layer_storage(1)["features"]
    (3, 4, 32)
    """

    vocab_size: int = 97
    n_positions: int = 512
    layer_types: tuple[str, ...] = ("csa", "hca", "sliding")
    n_embd: int = 64
    n_head: int = 4
    head_dim: int = 16
    rope_head_dim: int = 8  # (qk_rope_head_dim)
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    n_inner: int = 128
    sliding_window: int = 16
    csa_rate: int = 4
    hca_rate: int = 8
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 2
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    layer_norm_epsilon: float = 1e-6
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_head", "head_dim", "rope_head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "n_inner", "sliding_window",
                     "csa_rate", "hca_rate", "index_n_heads", "index_head_dim", "index_topk"):
            check_int(name, getattr(self, name))
        for name in ("rope_theta", "compress_rope_theta", "layer_norm_epsilon"):
            check_positive(name, getattr(self, name))
        if not self.layer_types or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types must be a non-empty tuple of {LAYER_TYPES}, "
                             f"got {self.layer_types!r}")
        if self.rope_head_dim % 2 or self.rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"rope_head_dim={self.rope_head_dim} must be even and at most "
                             "head_dim and index_head_dim")
        if self.n_head * self.head_dim % self.o_groups:
            raise ValueError(f"n_head x head_dim = {self.n_head * self.head_dim} is not "
                             f"divisible by o_groups={self.o_groups}")

    @property
    def n_layer(self) -> int:
        return len(self.layer_types)

    @property
    def n_kv_head(self) -> int:  # one shared head, K = V
        return 1

    def rate(self, layer: int) -> int | None:
        """Positions a block of layer ``layer`` pools (None: a window-only layer)."""
        return {"csa": self.csa_rate, "hca": self.hca_rate}.get(self.layer_types[layer])

    def layer_storage(self, layer: int) -> dict:
        """:class:`~kvdoc.core.compressed.CompressedLayer`'s sizes for layer ``layer``: a CSA
        row is ``[a | b]`` halves of the compressor's K and gate and the indexer's; ``a`` is
        what the next block's entry pools, the carry."""
        D, D_I, kind = self.head_dim, self.index_head_dim, self.layer_types[layer]
        sizes = {"width": D, "window": self.sliding_window, "rate": self.rate(layer)}
        if kind == "csa":
            sizes.update(features=4 * (D + D_I), carry_width=2 * (D + D_I), entry_width=D + D_I)
        elif kind == "hca":
            sizes.update(features=2 * D)
        return sizes

    @cached_property
    def cache_layout(self) -> tuple[LayerSpec, ...]:
        spec = LayerSpec(1, (self.head_dim, self.head_dim), self.sliding_window)
        return (spec,) * self.n_layer


def rotation(positions: torch.Tensor, rope_dim: int, theta: float,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[C, rope_dim]`` of V4's interleaved RoPE at ``positions`` ``[C]``:
    one angle per pair ``(x0, x1), (x2, x3), ..``, in float64 as
    :func:`~kvdoc.core.model.rope_angles`, then cast to ``dtype``."""
    angles = rope_angles(positions, rope_dim, theta)[..., :rope_dim // 2]
    angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn the trailing ``cos.shape[-1]`` channels of ``x`` (``[..., C, width]``) in pairs; the
    inverse turn is ``rotate(x, cos, -sin)``.

    >>> x, (cos, sin) = torch.randn(1, 3, 6), rotation(torch.arange(3), 4, 1e4, torch.float32)
    >>> back = rotate(rotate(x, cos, sin), cos, -sin)
    >>> torch.allclose(back, x, atol=1e-6), torch.equal(back[..., :2], x[..., :2])
    (True, True)
    """
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = rope.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return torch.cat((nope, rope * cos + turned * sin), dim=-1)


class Pooler(nn.Module):
    """Pools each finished block of ``rate`` rows into one entry ``width`` wide (V4's
    compressor; ``overlap``: CSA's, whose entry ``w`` pools half of block ``w - 1`` too)."""

    def __init__(self, config: CompressedConfig, rate: int, width: int, overlap: bool) -> None:
        super().__init__()
        self.rate, self.width, self.overlap = rate, width, overlap
        self.theta, self.rope_dim = config.compress_rope_theta, config.rope_head_dim
        wide = 2 * width if overlap else width
        self.kv_proj = nn.Linear(config.n_embd, wide, bias=False)
        self.gate_proj = nn.Linear(config.n_embd, wide, bias=False)
        self.position_bias = nn.Parameter(0.5 * torch.randn(rate, wide))
        self.kv_norm = nn.RMSNorm(width, eps=config.layer_norm_epsilon)

    def inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The rows' compressor inputs: ``[kv, gate]``, or CSA's ``[kv_a, gate_a, kv_b,
        gate_b]`` (the ``a`` halves first: what the next entry pools)."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if not self.overlap:
            return [kv, gate]
        return [kv[..., :self.width], gate[..., :self.width], kv[..., self.width:],
                gate[..., self.width:]]

    def forward(self, parts: list[torch.Tensor], carry: list[torch.Tensor] | None,
                first_block: int) -> torch.Tensor:
        """Entries ``[B, n, width]`` of the ``n`` blocks whose inputs ``parts`` hold (as
        :meth:`inputs`, ``[B, n x rate, .]``), from block ``first_block`` on; ``carry``: the
        ``a`` halves of the block before (None: there is none, its slots weigh nothing)."""
        B, R, _ = parts[0].shape
        n, r, w = R // self.rate, self.rate, self.width
        if n == 0:
            return parts[0].new_zeros(B, 0, w)
        blocks = [p.reshape(B, n, r, -1) for p in parts]
        if self.overlap:
            kv_a, gate_a, kv_b, gate_b = blocks
            bias_a, bias_b = self.position_bias[:, :w], self.position_bias[:, w:]
            if carry is None:
                prev_kv = kv_a.new_zeros(B, 1, r, w)
                prev_gate = gate_a.new_full((B, 1, r, w), float("-inf"))
            else:
                prev_kv, prev_gate = carry[0][:, None], carry[1][:, None] + bias_a
            kv = torch.cat((torch.cat((prev_kv, kv_a[:, :-1]), dim=1), kv_b), dim=2)
            gate = torch.cat((torch.cat((prev_gate, gate_a[:, :-1] + bias_a), dim=1),
                              gate_b + bias_b), dim=2)
        else:
            kv, gate = blocks[0], blocks[1] + self.position_bias
        pooled = self.kv_norm((kv * gate.softmax(dim=2)).sum(dim=2))  # [B, n, w]
        at = (first_block + torch.arange(n, device=pooled.device)) * self.rate
        return rotate(pooled, *rotation(at, self.rope_dim, self.theta, pooled.dtype))


class Indexer(Pooler):
    """CSA's lightning indexer: its own pooled keys, and per query the ``index_topk`` entries
    of highest ``sum_h w_h relu(q_h . k)``."""

    def __init__(self, config: CompressedConfig) -> None:
        super().__init__(config, config.csa_rate, config.index_head_dim, overlap=True)
        self.heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * self.width, bias=False)
        self.weights_proj = nn.Linear(config.n_embd, self.heads, bias=False)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, keys: torch.Tensor,
               turn: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor) -> torch.Tensor:
        """``[B, C, N]`` bool: the entries each query reads of the ``visible`` ones; ``turn``:
        the queries' rotation (:func:`rotation`)."""
        B, C, _ = x.shape
        q = rotate(self.q_b_proj(q_residual).view(B, C, self.heads, self.width).transpose(1, 2),
                   *turn)
        scores = index_scores(q, keys[:, None], self.weights_proj(x))  # [B, C, N]
        return select(scores, visible, self.topk)  # indexed.select: ties to the earlier entry


class Compressor(Pooler):
    """The entries a compressed layer reads (V4's CSA or HCA compressor), and CSA's indexer."""

    def __init__(self, config: CompressedConfig, kind: str) -> None:
        rate = config.csa_rate if kind == "csa" else config.hca_rate
        super().__init__(config, rate, config.head_dim, overlap=kind == "csa")
        self.indexer = Indexer(config) if kind == "csa" else None

    def all_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, F]``: a row's inputs as a CSA cache stores them, the ``a`` halves first."""
        parts = self.inputs(x)
        if self.indexer is not None:
            i_parts = self.indexer.inputs(x)
            parts = parts[:2] + i_parts[:2] + parts[2:] + i_parts[2:]
        return torch.cat(parts, dim=-1)

    def pool(self, rows: torch.Tensor, carry: torch.Tensor | None,
             first_block: int) -> torch.Tensor:
        """Entries ``[B, n, E]`` of the finished blocks' rows (as :meth:`all_inputs`)."""
        if self.indexer is None:
            return self(list(rows.chunk(2, dim=-1)), None, first_block)
        D, D_I = self.width, self.indexer.width
        half = (D, D, D_I, D_I)
        a, b = rows.split(2 * (D + D_I), dim=-1)
        a, b = a.split(half, dim=-1), b.split(half, dim=-1)
        c = None if carry is None or carry.shape[1] == 0 else carry.split(half, dim=-1)
        keys = self([a[0], a[1], b[0], b[1]], None if c is None else c[:2], first_block)
        index = self.indexer([a[2], a[3], b[2], b[3]], None if c is None else c[2:], first_block)
        return torch.cat((keys, index), dim=-1)


class CompressedAttention(nn.Module):
    """One V4 attention layer of type ``kind`` (:data:`LAYER_TYPES`) over new rows ``x``
    (``[B, C, d]``) at ``start ..``; weights named as transformers' ``DeepseekV4Attention``."""

    def __init__(self, config: CompressedConfig, kind: str) -> None:
        super().__init__()
        self.config = c = config
        self.kind = kind
        H, D, d = c.n_head, c.head_dim, c.n_embd
        self.theta = c.rope_theta if kind == "sliding" else c.compress_rope_theta
        self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=False)
        self.q_a_norm = nn.RMSNorm(c.q_lora_rank, eps=c.layer_norm_epsilon)
        self.q_b_proj = nn.Linear(c.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(d, D, bias=False)
        self.kv_norm = nn.RMSNorm(D, eps=c.layer_norm_epsilon)
        # per group, H x D / G -> o_lora_rank (as transformers' DeepseekV4GroupedLinear)
        self.o_a_proj = nn.Linear(H * D // c.o_groups, c.o_groups * c.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, d, bias=False)
        self.sinks = nn.Parameter(torch.randn(H))
        self.compressor = None if kind == "sliding" else Compressor(c, kind)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if attn_mask is not None or positions is not None:
            raise ValueError("a compressed layer takes no attn_mask or positions: its blocks "
                             "count from position 0 of every row")
        c, (B, C, _) = self.config, x.shape
        at = torch.arange(start, start + C, device=x.device)
        turn = rotation(at, c.rope_head_dim, self.theta, x.dtype)  # for Q, K and the output
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(B, C, c.n_head, c.head_dim).transpose(1, 2)
        q = rotate(F.rms_norm(q, (c.head_dim,), eps=c.layer_norm_epsilon), *turn)  # no weight
        kv = rotate(self.kv_norm(self.kv_proj(x))[:, None], *turn)  # [B, 1, C, D]
        rows = None if self.compressor is None else self.compressor.all_inputs(x)
        if cache is None:
            window, entries = kv, None if rows is None else self.compressor.pool(
                rows[:, :C // self.compressor.rate * self.compressor.rate], None, 0)
        else:
            pending = cache.update(layer_idx, kv, kv if rows is None else rows[:, None], start)
            window, entries = pending.window, None
            if rows is not None:
                new = self.compressor.pool(pending.rows, pending.carry, pending.first_block)
                entries = cache.layers[layer_idx].append(new)
        mask = offset_causal_mask(start, C, x.device, window=c.sliding_window)
        keys, mask = window, mask[:, -window.shape[2]:].expand(B, C, -1)
        if entries is not None:
            keys, mask = self.with_entries(x, q_residual, keys, mask, entries, at, turn)
        y = rotate(self.attend(q, keys, mask), turn[0], -turn[1])  # [B, H, C, D], turned back
        groups = y.transpose(1, 2).reshape(B, C, c.o_groups, -1)
        w = self.o_a_proj.weight.view(c.o_groups, c.o_lora_rank, -1)
        mixed = torch.cat([F.linear(groups[:, :, g], w[g]) for g in range(c.o_groups)], dim=-1)
        return self.o_b_proj(mixed)

    def with_entries(self, x: torch.Tensor, q_residual: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor, entries: torch.Tensor, at: torch.Tensor,
                     turn: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's keys and mask ``[B, C, R]`` with the entries a query reads appended."""
        N, D = entries.shape[1], self.config.head_dim
        finished = (at[:, None] + 1) // self.compressor.rate  # blocks done by each query
        visible = torch.arange(N, device=x.device) < finished  # [C, N]
        visible = visible.expand(x.shape[0], -1, -1)
        if self.compressor.indexer is not None:
            # a CSA layer turns at the compressors' base: the indexer's queries take Q's turn
            visible = self.compressor.indexer.select(x, q_residual, entries[..., D:], turn,
                                                     visible)
        keys = torch.cat((keys, entries[:, None, :, :D]), dim=2)
        return keys, torch.cat((mask, visible), dim=-1)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax over the readable keys (each both key and value) and one sink logit per
        head, which reads no value (gpt-oss's :func:`~kvdoc.core.gptoss.sink_attention`)."""
        return sink_attention(q, keys, keys, self.sinks, mask)


class CompressedDecoder(BlocksDecoder):
    """A :class:`~kvdoc.core.frame.BlocksDecoder` of :class:`~kvdoc.core.mla.LatentBlock` s
    around a :class:`CompressedAttention` each, cached in a compressed cache.

    >>> CompressedDecoder().new_cache(1, "dynamic")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: a compressed model's cache is 'compressed' (its window, entries and buffer), ...
    """

    def __init__(self, config: CompressedConfig | None = None) -> None:
        super().__init__(config or CompressedConfig(), lambda c, i: LatentBlock(
            c, partial(CompressedAttention, kind=c.layer_types[i])))

    def new_cache(self, batch_size: int, kind: str | None = None,
                  capacity: int | None = None) -> KVCache:
        if kind not in (None, "compressed"):
            raise ValueError(f"a compressed model's cache is 'compressed' (its window, entries "
                             f"and buffer), not {kind!r}")
        return compressed_cache(self.config, batch_size, self.wte.weight.dtype,
                                self.wte.weight.device)
