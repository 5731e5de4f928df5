"""The cost model of a decode: positions counted on real tensors, modelled FLOPs, bytes read:
facts about the computation, not the machine (the savings page asserts them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvdoc.core.mla import MLAConfig
from kvdoc.core.model import Decoder, GPTConfig


def projected_positions_full(prefix_len: int, new_tokens: int) -> int:
    """Positions full recompute pushes through each layer over ``G`` steps: ``G P + G (G + 1) / 2``.

    >>> projected_positions_full(256, 16)
    4232
    """
    return new_tokens * prefix_len + new_tokens * (new_tokens + 1) // 2


class RowCounter:
    """Forward hooks that count the rows (positions) passing through chosen linear layers.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig()).eval()
    >>> with RowCounter(model) as rows:
    ...     _ = model(torch.tensor([[1, 2, 3]]))
    >>> rows.counts
    {'c_attn': 3, 'lm_head': 3}
    """

    def __init__(self, model: Decoder) -> None:
        self.model = model
        self.counts = {"c_attn": 0, "lm_head": 0}
        self._handles: list[Any] = []

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Linear, inputs: Any, output: torch.Tensor) -> None:
            self.counts[name] += output.numel() // module.out_features  # rows = B * positions
        return hook

    def __enter__(self) -> RowCounter:
        self._handles = [self.model.h[0].attn.c_attn.register_forward_hook(self._hook("c_attn")),
                         self.model.lm_head.register_forward_hook(self._hook("lm_head"))]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


def step_flops(config: GPTConfig, past: int, new: int, last_only: bool = False,
               causal: bool = False) -> dict[str, float]:
    """Multiply-add FLOPs (2 per MAC) of one forward, ``new`` tokens after ``past`` cached ones:
    ``linear`` (every layer's projections and MLP), ``attention`` (``Q K^T`` and ``P V``, every
    query against every key, masked ones included, as an explicit mask computes; ``causal``:
    only the keys each query reads) and ``lm_head``; norms and softmax left out.

    >>> step_flops(GPTConfig(), 0, 4, causal=True)["attention"] * 2 == (
    ...     step_flops(GPTConfig(), 0, 4)["attention"] * (1 + 2 + 3 + 4) * 2 // 16)
    True

    >>> f = step_flops(GPTConfig(), past=0, new=1)
    >>> f["attention"] == 2 * 2 * 1 * 1 * 64 * 2       # 2 layers, QK^T and PV, 1 query, 1 key
    True
    >>> from kvdoc.core.model import llama_config
    >>> c = llama_config()
    >>> step_flops(c, 0, 1)["linear"] == 2 * 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
    True
    """
    d, t = config.n_embd, past + new
    q = config.n_head * config.head_dim  # all query heads: d unless head_size is set (Qwen3)
    mlp_matrices = 3 if config.mlp == "swiglu" else 2
    per_token_linear = d * (q + 2 * config.kv_dim) + q * d + mlp_matrices * d * config.n_inner
    linear = 2.0 * config.n_layer * new * per_token_linear
    keys = new * past + new * (new + 1) // 2 if causal else new * t  # score-value pairs
    attention = 2.0 * config.n_layer * 2 * keys * q  # H heads x D_h, for QK^T and for PV
    lm_head = 2.0 * (1 if last_only else new) * d * config.vocab_size
    return {"linear": linear, "attention": attention, "lm_head": lm_head,
            "total": linear + attention + lm_head}


def run_flops(config: GPTConfig, prefix_len: int, new_tokens: int,
              causal: bool = False) -> dict[str, float]:
    """FLOPs of the ``G`` decode steps after a ``P``-token prompt, by path and part."""
    steps = range(1, new_tokens + 1)
    runs = {"full_all": [step_flops(config, 0, prefix_len + j, causal=causal) for j in steps],
            "full_last": [step_flops(config, 0, prefix_len + j, True, causal) for j in steps],
            "cached": [step_flops(config, prefix_len + j - 1, 1, causal=causal) for j in steps]}
    return {name if part == "total" else f"{name}_{part}": sum(p[part] for p in parts)
            for name, parts in runs.items() for part in ("linear", "attention", "lm_head", "total")}


def kv_per_sequence(config: GPTConfig, context: int, size: int) -> int:
    """K/V bytes one sequence adds to a step that attends over ``context + 1`` positions.

    >>> kv_per_sequence(GPTConfig(), 9, 4)  # 2 (K, V) x 2 layers x 10 positions x 64 x 4 bytes
    10240
    """
    return 2 * config.n_layer * (context + 1) * config.kv_dim * size


def step_bytes(model: Decoder, context: int) -> int:
    """Bytes one decode step reads at ``context`` cached positions: every weight (one row of
    each embedding table) and K and V of every layer over ``context + 1`` positions.

    >>> from kvdoc.core.model import llama_config
    >>> step_bytes(Decoder(llama_config()), 0) > 0    # no wpe: positions turn inside attention
    True
    """
    cfg, size = model.config, model.wte.weight.element_size()
    params = {id(p): p for p in model.parameters()}
    tables = [t.weight for t in (model.wte, model.wpe) if t is not None]
    embeddings = {id(t) for t in tables}
    weights = sum(p.numel() for i, p in params.items() if i not in embeddings)
    if model.lm_head.weight is model.wte.weight:  # tied: the head reads the whole table
        weights += model.wte.weight.numel()
    weights += len(tables) * cfg.n_embd  # one embedding row each
    return weights * size + kv_per_sequence(cfg, context, size)


def attention_macs_per_key(config: MLAConfig, absorbed: bool) -> int:
    """Multiply-adds a decode step spends per cached position and layer, all heads: plain,
    up-projecting the latent first; absorbed, over the latent itself (``W_UK``, ``W_UV`` cost
    per query, not per key).

    >>> from kvdoc.core.mla import MLAConfig
    >>> cfg = MLAConfig()
    >>> attention_macs_per_key(cfg, absorbed=False), attention_macs_per_key(cfg, absorbed=True)
    (4256, 288)
    """
    c = config
    if absorbed:
        return c.n_head * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
    up = c.kv_lora_rank * c.n_head * (c.qk_nope_head_dim + c.v_head_dim)
    return up + c.n_head * (c.qk_head_dim + c.v_head_dim)
