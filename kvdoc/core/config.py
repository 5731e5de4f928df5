"""The model configuration: one frozen dataclass, validated on construction.

The defaults are GPT-2. Five switches turn it into a Llama-style decoder (:func:`llama_config`):
rotary positions instead of learned ones, RMSNorm instead of LayerNorm, a SwiGLU MLP, no biases,
and optionally a tied LM head; ``sliding_window`` makes it Mistral-style (:func:`mistral_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value``, if it is an integer (not a bool) of at least ``minimum``; else a ``ValueError``.

    The one check behind every size, length and count kvdoc takes.

    >>> check_int("batch_size", 2)
    2
    >>> check_int("past_len", -1, minimum=0)
    Traceback (most recent call last):
    ...
    ValueError: past_len must be a non-negative integer, got -1
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kinds = {0: "a non-negative integer", 1: "a positive integer"}
        kind = kinds.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


def check_positive(name: str, value: object) -> object:
    """``value``, if it is a positive number; else a ``ValueError`` naming ``name``.

    The one check behind every epsilon, RoPE base and cap kvdoc takes.

    >>> check_positive("rope_theta", 1e4)
    10000.0
    >>> check_positive("layer_norm_epsilon", 0.0)
    Traceback (most recent call last):
    ...
    ValueError: layer_norm_epsilon must be positive, got 0.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return value


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT-2-style decoder.

    The defaults are the two-layer model of the source documents: it is GPT-2 with a
    97-token vocabulary, 512 positions, width 64 and 4 heads, an untied LM head and no
    dropout, and it has 145,280 parameters.

    Args:
        vocab_size: number of token ids; valid ids are ``0 .. vocab_size - 1``.
        n_positions: learned absolute positions; the longest sequence the model accepts.
        n_layer: decoder blocks, each with its own K/V cache.
        n_head: query heads.
        n_embd: model width ``d_model``; must divide evenly into ``n_head`` heads.
        n_inner: hidden width of the MLP (GPT-2 uses ``4 * n_embd``).
        n_kv_head: K/V heads. ``None`` means ``n_head`` (multi-head attention); fewer gives
            grouped-query attention, 1 gives multi-query attention. Must divide ``n_head``.
        layer_norm_epsilon: the epsilon of every LayerNorm (or RMSNorm).
        position: ``"learned"`` adds a learned position embedding ``wpe`` (GPT-2);
            ``"rope"`` rotates Q and K by their absolute positions instead (Llama).
        rope_theta: the RoPE base; head-dimension pair ``i`` turns by ``pos * theta**(-2i / D_h)``.
        norm: ``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (Llama: no mean, no bias).
        mlp: ``"gelu"`` (GPT-2: GELU-tanh) or ``"swiglu"`` (Llama: ``silu(gate) * up``).
        bias: whether the attention and MLP projections have biases (Llama has none).
        tie_word_embeddings: the LM head reuses ``wte``'s weight.
        sliding_window: ``W``; query ``i`` reads keys ``j`` with ``i - W < j <= i`` (W keys,
            its own included, as in transformers' Mistral). ``None``: every earlier key.

    Raises:
        ValueError: a size is not a positive integer, ``n_embd`` is not divisible by
            ``n_head``, ``n_head`` is not divisible by ``n_kv_head``, RoPE with an odd
            head size, or an unknown choice.

    >>> cfg = GPTConfig()
    >>> cfg.head_dim, cfg.n_kv_head
    (16, 4)
    >>> GPTConfig(n_embd=60, n_head=8)
    Traceback (most recent call last):
    ...
    ValueError: n_embd=60 is not divisible by n_head=8
    """

    vocab_size: int = 97
    n_positions: int = 512
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_inner: int = 256
    n_kv_head: int | None = field(default=None)
    layer_norm_epsilon: float = 1e-5
    position: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    bias: bool = True
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        for name in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd", "n_inner",
                     "n_kv_head"):
            check_int(name, getattr(self, name))
        for name in ("layer_norm_epsilon", "rope_theta"):
            check_positive(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        for name, allowed in (("position", ("learned", "rope")), ("norm", ("layernorm", "rmsnorm")),
                              ("mlp", ("gelu", "swiglu"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError("RoPE rotates pairs of features: "
                             f"head_dim={self.head_dim} must be even")
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window)

    @property
    def head_dim(self) -> int:
        """Width of one head, ``D_h = n_embd // n_head``."""
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of all K (or all V) heads together, ``n_kv_head * head_dim``."""
        return self.n_kv_head * self.head_dim


def llama_config(**overrides: object) -> GPTConfig:
    """A tiny Llama-style configuration: RoPE, RMSNorm (eps 1e-6), SwiGLU, no biases, GQA 4/2.

    Same width, depth, heads and vocabulary as the default GPT-2 of :class:`GPTConfig`; the
    SwiGLU MLP has hidden width 128. ``overrides`` replace any field (e.g. ``n_kv_head=1`` for
    multi-query attention, ``n_kv_head=4`` for multi-head).

    >>> cfg = llama_config()
    >>> cfg.position, cfg.norm, cfg.mlp, cfg.n_head, cfg.n_kv_head
    ('rope', 'rmsnorm', 'swiglu', 4, 2)
    >>> llama_config(n_kv_head=1).n_kv_head
    1
    """
    base = GPTConfig(n_inner=128, n_kv_head=2, layer_norm_epsilon=1e-6, position="rope",
                     norm="rmsnorm", mlp="swiglu", bias=False)
    return replace(base, **overrides)


def mistral_config(sliding_window: int = 32, **overrides: object) -> GPTConfig:
    """:func:`llama_config` with a sliding window of ``sliding_window`` keys (Mistral-style).

    >>> mistral_config().sliding_window
    32
    """
    return llama_config(sliding_window=sliding_window, **overrides)
