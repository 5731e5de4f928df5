"""A GPT-2 (or Llama-style) decoder whose one forward serves full recompute and cached decoding.

Half of the copy set (with :mod:`kvdoc.core.cache`); GPT-2's parameter names. ``B`` batch,
``C`` new tokens, ``P`` cached positions, ``T = P + C``, ``d`` width, ``H`` query heads, ``H_kv``
K/V heads, ``D_h`` head size, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .cache import (
    DynamicCache,
    KVCache,
    LayerSpec,
    StaticCache,
    check_int,
    check_positive,
    last_keys,
    offset_causal_mask,
)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT-2-style decoder; the defaults are the sources' two-layer model (97 tokens,
    512 positions, width 64, 4 heads, an untied head: 145,280 parameters). ``position="rope"``,
    ``norm="rmsnorm"``, ``mlp="swiglu"``, ``bias=False``: Llama-style (:func:`llama_config`);
    ``sliding_window=W``: query ``i`` reads keys ``i - W < j <= i``; ``n_kv_head < n_head``: GQA.

    >>> GPTConfig().head_dim, GPTConfig(n_kv_head=2).cache_layout[0]
    (16, LayerSpec(heads=2, widths=(16, 16), window=None))
    """

    vocab_size: int = 97
    n_positions: int = 512  # the longest sequence the model accepts
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_inner: int = 256  # the MLP's hidden width
    n_kv_head: int | None = None
    layer_norm_epsilon: float = 1e-5
    position: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0  # pair i of a head turns by pos * theta**(-2i / D_h)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    bias: bool = True
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    head_size: int | None = None  # D_h where it is not n_embd / n_head (Qwen3)
    qkv_bias: bool = False  # biases on Q, K and V alone (Qwen2)
    qk_norm: bool = False  # each head of Q and of K normed (as ln_1 is), before RoPE (Qwen3)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        sizes = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd", "n_inner", "n_kv_head")
        for name in (*sizes, "sliding_window", "head_size"):  # None: no window; n_embd / n_head
            if name in sizes or getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        check_positive("layer_norm_epsilon", self.layer_norm_epsilon)
        check_positive("rope_theta", self.rope_theta)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        for name, allowed in (("position", ("learned", "rope")), ("norm", ("layernorm", "rmsnorm")),
                              ("mlp", ("gelu", "swiglu"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs: head_dim={self.head_dim} must be even")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:  # all K (or all V) heads together
        return self.n_kv_head * self.head_dim

    @cached_property
    def cache_layout(self) -> tuple[LayerSpec, ...]:
        spec = LayerSpec(self.n_kv_head, (self.head_dim, self.head_dim), self.sliding_window)
        return (spec,) * self.n_layer


def llama_config(**overrides: object) -> GPTConfig:
    """A tiny Llama: RoPE, RMSNorm (eps 1e-6), SwiGLU (hidden 128), no biases, GQA 4/2."""
    return GPTConfig(**dict(n_inner=128, n_kv_head=2, layer_norm_epsilon=1e-6, position="rope",
                            norm="rmsnorm", mlp="swiglu", bias=False) | overrides)


def mistral_config(sliding_window: int = 32, **overrides: object) -> GPTConfig:
    """:func:`llama_config` with a sliding window of ``sliding_window`` keys."""
    return llama_config(sliding_window=sliding_window, **overrides)


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # (x1, x2) -> (-x2, x1) on the two halves
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@lru_cache(maxsize=64)
def _frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    pairs = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
    return theta ** -(pairs / head_dim)  # computed once: a decode step is ~100 us


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """RoPE angles ``[..., D_h]``, in float64 so that no call rounds a position differently."""
    freqs = _frequencies(head_dim, theta, positions.device)  # [D_h / 2]
    angles = positions.to(torch.float64)[..., None] * freqs
    return torch.cat((angles, angles), dim=-1)  # pairs (i, i + D_h/2) turn together


def apply_rope(x: torch.Tensor, start: int | torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` (``[B, H, C, D_h]``) as rows at ``start ..``, or at the positions a tensor
    ``start`` holds (``[C]``, or ``[B, C]`` per row). K is turned before it is cached.

    >>> x = torch.randn(2, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    >>> rows = apply_rope(x, torch.tensor([[5, 6, 7], [0, 1, 2]]))  # row 0 from 5, row 1 from 0
    >>> torch.equal(rows[0], apply_rope(x, 5)[0]), torch.equal(rows[1], apply_rope(x, 0)[1])
    (True, True)
    """
    if isinstance(start, int):  # the decode step's path, kept lean
        start = torch.arange(start, start + x.shape[2], device=x.device)
    angles = rope_angles(start, x.shape[3], theta)  # [C, D_h] or [B, C, D_h]
    if angles.dim() == 3:
        angles = angles[:, None]  # [B, 1, C, D_h]: the same for every head of a row
    return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)


def embed_tokens(wte: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    """``wte(idx)``; an id outside the vocabulary (the lookup finds it) is a ``ValueError``."""
    try:
        return wte(idx)
    except IndexError:
        lo, hi = (int(t) for t in idx.aminmax())
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                         f"0..{wte.num_embeddings - 1}") from None


def norm(config: GPTConfig, width: int | None = None) -> nn.Module:  # LayerNorm or RMSNorm
    kind = nn.RMSNorm if config.norm == "rmsnorm" else nn.LayerNorm  # ln_1, ln_2, ln_f; q/k
    return kind(width or config.n_embd, eps=config.layer_norm_epsilon)


class MLP(nn.Module):
    """``c_proj(gelu_tanh(c_fc(x)))``, or SwiGLU ``c_proj(silu(gate) * up)``: row by row."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"  # then c_fc makes gate and up in one matmul
        self.c_fc = nn.Linear(config.n_embd, (1 + self.swiglu) * config.n_inner, bias=config.bias)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, d] -> [B, C, d]
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)  # [B, C, n_inner] each
            return self.c_proj(F.silu(gate) * up)
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's "gelu_new"


class CausalSelfAttention(nn.Module):
    """Multi-head or grouped-query attention of new rows at ``start ..`` over cached + new K/V."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.head_dim
        self.window, self.qk_norm = config.sliding_window, config.qk_norm
        self.rope_theta = config.rope_theta if config.position == "rope" else None
        # Q, K and V in one matmul, split in forward; H * D_h is n_embd unless head_size is set
        width = config.n_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, width + 2 * config.kv_dim,
                                bias=config.bias or config.qkv_bias)
        self.c_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        if self.qk_norm:  # over each head's D_h features
            self.q_norm, self.k_norm = norm(config, self.head_dim), norm(config, self.head_dim)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int,
                start: int, attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, _ = x.shape
        # c_attn's columns: H query heads, then H_kv key heads, then H_kv value heads
        H, H_kv = self.n_head, self.n_kv_head
        heads = self.c_attn(x).view(B, C, H + 2 * H_kv, self.head_dim).transpose(1, 2)
        # q: [B, H, C, D_h]; k, v: [B, H_kv, C, D_h]
        q, k, v = heads.split((H, H_kv, H_kv), dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:  # Q and K turned in one call (same angles)
            at = start if positions is None else positions  # before K is cached
            qk = apply_rope(torch.cat((q, k), dim=1), at, self.rope_theta)
            q, k = qk.split((H, H_kv), dim=1)
        if cache is not None:
            # Only the new rows were projected; old K/V come from this layer's cache.
            k, v = cache.update(layer_idx, k, v, start)  # [B, H_kv, P + C, D_h]
        y = self.attend(q, k, v, start, attn_mask)  # [B, H, C, D_h]
        return self.c_proj(y.transpose(1, 2).reshape(B, C, -1))  # merge heads

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``softmax(q k^T / sqrt(D_h) + mask) v`` for queries at ``start ..``: ``[B, H, C, D_h]``,
        over ``k``, ``v`` (``[B, H_kv, T, D_h]``) that end at the last query's position."""
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [B, 1, C, T]: the same for every head
        # enable_gqa only when it is needed, as the keyword alone slows SDPA
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)

    def visible(self, start: int, C: int, T: int, attn_mask: torch.Tensor | None,
                device: torch.device) -> torch.Tensor | None:
        """Which of the ``T`` keys each of the ``C`` queries at ``start ..`` reads: ``[C, T]``,
        ``[B, C, T]``, or None when nothing is hidden. The keys end at the last query (a window
        layer returns its last ``T``): the mask keeps its last ``T`` columns. ``attn_mask``
        (``[B, C, P + C]``, True: may read) replaces it for a padded batch or a ragged step."""
        if attn_mask is not None:
            return last_keys(attn_mask[..., -T:], self.window)
        if C == 1 and self.window is None:
            return None  # one query at position P after keys 0 .. P: nothing to hide
        return offset_causal_mask(start, C, device, window=self.window)[:, -T:]


class Block(nn.Module):
    """Pre-norm decoder layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = norm(config), CausalSelfAttention(config)
        self.ln_2, self.mlp = norm(config), MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, **positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer_idx, start, attn_mask, **positions)
        return x + self.mlp(self.ln_2(x))


class DecoderOutput(NamedTuple):
    """``logits[:, i]`` (``[B, C, V]``) predicts the token after new token ``i``."""

    logits: torch.Tensor
    cache: KVCache | None  # P + C positions (None without a cache)


class Decoder(nn.Module):
    """Embeddings, ``n_layer`` pre-norm blocks, final norm, LM head; RoPE models have no ``wpe``.

    ``forward(idx)`` recomputes every position; ``forward(idx, cache)`` runs only the new tokens,
    at ``P .. P + C - 1`` with ``P = cache.seq_len``, over cached + new K/V: one function of the
    tokens (:mod:`kvdoc.proofs.compare` checks it).

    >>> model = Decoder(GPTConfig())                    # any weights
    >>> model.num_parameters()
    145280
    >>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
    >>> full = model(ids).logits                        # [1, 6, 97]
    >>> _, cache = model(ids[:, :4], DynamicCache.empty(model.config, 1))
    >>> step = model(ids[:, 4:], cache).logits          # [1, 2, 97], positions 4 and 5
    >>> torch.allclose(step, full[:, 4:], atol=1e-5)
    True
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings
        self.wpe = (nn.Embedding(config.n_positions, config.n_embd)  # learned positions
                    if config.position == "learned" else None)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight  # one [V, d] matrix embeds and predicts

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def check_input(self, idx: torch.Tensor, cache: KVCache | None,
                    positions: torch.Tensor | None = None) -> None:
        """A ``ValueError`` unless ``idx`` ``[B, C]`` can continue ``cache``; before any write."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be a [B, C] tensor of token ids, got {shape}")
        if idx.dtype not in (torch.int64, torch.int32):  # what an embedding lookup takes
            raise ValueError(f"idx must hold int64 or int32 token ids, got dtype {idx.dtype}")
        B, C = idx.shape
        if C == 0 or B == 0:
            raise ValueError(f"empty input: idx has shape {(B, C)}; every row needs a token")
        weight = self.wte.weight  # the model's device and dtype
        if idx.device != weight.device:
            raise ValueError(f"idx is on {idx.device}, model is on {weight.device}")
        if positions is not None and tuple(positions.shape) not in ((C,), (1, C), (B, C)):
            raise ValueError(f"positions must be [C] or [B, C] with (B, C) = {(B, C)}, "
                             f"got {tuple(positions.shape)}")
        if cache is not None and not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a KVCache, got {type(cache).__name__}")
        past = 0 if cache is None else cache.seq_len
        if past + C > self.config.n_positions:
            raise ValueError(f"sequence too long: {past} cached + {C} new = {past + C} positions, "
                             f"model has {self.config.n_positions}")
        if cache is not None:
            cache.check_compatible(self.config, B, weight.dtype, weight.device, C)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                last_only: bool = False, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> DecoderOutput:
        """Logits for the new tokens ``idx`` after ``cache`` (None: recompute). ``last_only``:
        the last position's alone; ``positions`` (``[B, C]`` or ``[C]``): in place of ``P ..
        P + C - 1``; ``attn_mask`` (``[B, C, P + C]``, True: may read): of the offset mask."""
        self.check_input(idx, cache, positions)
        C = idx.shape[1]
        # given to the attention only when set: one written for one start per call still serves
        rotary = {} if positions is None or self.wpe is not None else {"positions": positions}
        start, work = (0, None) if cache is None else (cache.seq_len, cache.begin())
        x = embed_tokens(self.wte, idx)  # [B, C, d]
        if self.wpe is not None:  # RoPE models turn Q and K instead
            if positions is None:
                positions = torch.arange(start, start + C, device=idx.device)  # [C]
            x = x + self.wpe(positions)
        for layer_idx, block in enumerate(self.h):
            x = block(x, work, layer_idx, start, attn_mask, **rotary)  # [B, C, d]
        if last_only:
            x = x[:, -1:, :]  # [B, 1, d]: only the last row feeds next-token prediction
        logits = self.lm_head(self.ln_f(x))  # [B, C, V]
        if work is not None:  # after the head: a call failing there leaves the cache as it was
            work.finish(start + C)
        return DecoderOutput(logits, work)

    def new_cache(self, batch_size: int, kind: str | None = None,
                  capacity: int | None = None) -> KVCache:
        """An empty ``"dynamic"``, ``"static"`` (``capacity``: default ``n_positions``) or
        ``"window"`` / ``"hybrid"`` cache (window.py's: a windowed model's default)."""
        dtype, device, config = self.wte.weight.dtype, self.wte.weight.device, self.config
        windowed = any(spec.window for spec in config.cache_layout)
        kind = kind or ("window" if windowed else "dynamic")
        if kind == "dynamic":
            return DynamicCache.empty(config, batch_size, dtype, device)
        if kind == "static":
            capacity = config.n_positions if capacity is None else capacity
            return StaticCache(config, batch_size, capacity, dtype, device)
        if kind == "window" and not windowed:
            raise ValueError("a window cache needs a model with sliding windows")
        if kind in ("window", "hybrid"):
            from .window import window_cache  # windows build on this file, not the reverse
            return window_cache(config, batch_size, dtype=dtype, device=device)
        raise ValueError(f"unknown cache kind {kind!r}; use 'dynamic', 'static' or 'window'")


@torch.no_grad()
def prefill(model: Decoder, idx: torch.Tensor, cache: KVCache | None = None) -> DecoderOutput:
    """Run the prompt ``idx`` once into ``cache`` (None: a new one): logits ``[B, 1, V]``, cache."""
    cache = model.new_cache(idx.shape[0]) if cache is None else cache
    return model(idx, cache, last_only=True)


@torch.no_grad()
def decode_step(model: Decoder, token: torch.Tensor, cache: KVCache) -> DecoderOutput:
    """One new token per row (``[B]`` or ``[B, 1]``) after ``cache``: logits ``[B, 1, V]``."""
    token = token[:, None] if token.dim() == 1 else token
    if token.dim() != 2 or token.shape[1] != 1:
        raise ValueError(f"decode_step takes one token per row, got shape {tuple(token.shape)}")
    return model(token, cache)


@torch.no_grad()
def generate(model: Decoder, idx: torch.Tensor, max_new_tokens: int,
             cache: str | KVCache | None = None) -> torch.Tensor:
    """Greedy: a prefill, then ``max_new_tokens - 1`` decode steps; the prompt and the chosen
    tokens, ``[B, P + max_new_tokens]``. ``cache``: a ``new_cache`` kind, or an empty cache.

    >>> model, prompt = Decoder(GPTConfig()), torch.tensor([[1, 2, 3]])  # any weights
    >>> out = generate(model, prompt, 5)
    >>> out.shape, torch.equal(out, generate(model, prompt, 5, cache="static"))
    (torch.Size([1, 8]), True)
    """
    model.check_input(idx, None)
    total = idx.shape[1] + check_int("max_new_tokens", max_new_tokens)
    if total > model.config.n_positions:
        raise ValueError(f"prompt of {idx.shape[1]} + {max_new_tokens} new tokens = {total} "
                         f"positions, model has {model.config.n_positions}")
    if not isinstance(cache, KVCache):
        cache = model.new_cache(idx.shape[0], cache, capacity=total)
    elif cache.seq_len:
        raise ValueError(f"generate() fills an empty cache, not one of {cache.seq_len} positions")
    logits, kv = prefill(model, idx, cache)
    chosen = [logits[:, -1].argmax(dim=-1, keepdim=True)]  # [B, 1] each
    while len(chosen) < max_new_tokens:
        logits, kv = decode_step(model, chosen[-1], kv)
        chosen.append(logits[:, -1].argmax(dim=-1, keepdim=True))
    return torch.cat([idx, *chosen], dim=1)
