"""The model configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        layer_norm_epsilon: the epsilon of every LayerNorm.

    Raises:
        ValueError: a size is not a positive integer, ``n_embd`` is not divisible by
            ``n_head``, or ``n_head`` is not divisible by ``n_kv_head``.

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

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        for name in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd", "n_inner", "n_kv_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")

    @property
    def head_dim(self) -> int:
        """Width of one head, ``D_h = n_embd // n_head``."""
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of all K (or all V) heads together, ``n_kv_head * head_dim``."""
        return self.n_kv_head * self.head_dim
