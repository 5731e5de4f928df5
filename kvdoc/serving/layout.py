"""What a model caches per layer and position, read from its config: the shape paged storage takes.

Every decoder on the grid caches, per layer, two tensors of one layout ``[B, H, T, width]``
(:mod:`kvdoc.core.layers`): K and V of ``H_kv`` heads and one head width (GPT-2, Llama, Mistral,
Gemma 3), or an MLA layer's latent ``c_KV`` and rotary key ``k_rope``, one shared head and two
widths (:mod:`kvdoc.core.mla`). A pool of blocks (:class:`~kvdoc.serving.paged.BlockPool`) and
a prefill's hand-over payload (:mod:`kvdoc.serving.handover`) are sized from it, so neither asks
which model it serves, only what it caches. A config that states its cached shapes
(``cached_shapes``, as :class:`~kvdoc.core.mla.MLAConfig` does) is a latent; any other config
caches K and V of ``n_kv_head`` heads of ``head_dim``.

>>> from kvdoc import GPTConfig
>>> from kvdoc.core.mla import MLAConfig
>>> cache_layout(GPTConfig(n_kv_head=2))
CacheLayout(n_layer=2, heads=2, widths=(16, 16), latent=False)
>>> cache_layout(MLAConfig())                              # c_KV of 32, k_rope of 8
CacheLayout(n_layer=2, heads=1, widths=(32, 8), latent=True)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheLayout:
    """Per layer, two tensors ``[B, heads, T, widths[i]]``; ``latent``: an MLA latent (its
    cache must be a :class:`~kvdoc.core.mla.LatentCache`, which checks an MLA config)."""

    n_layer: int
    heads: int
    widths: tuple[int, int]
    latent: bool


def cache_layout(config: object) -> CacheLayout:
    """The layout of what a model with ``config`` caches (see the module docstring)."""
    if hasattr(config, "cached_shapes"):  # the config states its shapes: a latent
        (_, heads, _, width_0), (_, heads_1, _, width_1) = config.cached_shapes(1, 0)
        if heads != heads_1:
            raise ValueError(f"a layer's two cached tensors must share their heads, got "
                             f"{heads} and {heads_1}")
        return CacheLayout(config.n_layer, heads, (width_0, width_1), latent=True)
    return CacheLayout(config.n_layer, config.n_kv_head, (config.head_dim, config.head_dim),
                       latent=False)
