"""transformers' Gemma 3 (text) to and from :class:`kvdoc.core.gemma.Gemma3Decoder`.

Inside a layer the weights keep transformers' names; only the prefixes move (``model.layers.i.``
is ``h.i.``). Both RoPE bases come from ``rope_parameters``, the window layers from
``layer_types``: a ``sliding_window_pattern`` where they follow one (every published Gemma 2 and
3 does), else the global layers' indices. The export writes a pattern as the pattern, so that
transformers derives the layer types itself: a reference built that way does not share kvdoc's
derivation.

Not loaded: scaled RoPE (the larger Gemma 3 checkpoints scale the global base linearly),
attention biases, bidirectional attention, and ``attn_logit_softcapping`` (Gemma 2's; transformers'
Gemma 3 never applies it, so a config that sets it would not mean what it says).

>>> import torch
>>> from kvdoc.interop.hf_config import random_model
>>> hf = random_model(gemma_config(Gemma3Config(sliding_window=4)))
>>> ours = from_gemma(hf)
>>> ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
>>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
True
"""

from __future__ import annotations

from typing import Any

from kvdoc.core.frame import GLOBAL, SLIDING, every_nth_full
from kvdoc.core.gemma import Gemma3Config, Gemma3Decoder
from kvdoc.interop.hf_config import (
    as_ours,
    as_theirs,
    by_our_names,
    by_their_names,
    expect_model_type,
    holding,
    load_exported,
    refuse_unsupported,
)


def gemma_config(config: Gemma3Config) -> Any:
    """The transformers ``Gemma3TextConfig`` of the same model: no dropout, no special tokens.

    >>> config_from_gemma(gemma_config(Gemma3Config())) == Gemma3Config()
    True
    """
    from transformers import Gemma3TextConfig

    c = config
    return Gemma3TextConfig(
        **as_theirs(c, "head_dim", "query_pre_attn_scalar", "sliding_window",
                    "final_logit_softcapping"), **_layout(c),
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={GLOBAL: {"rope_type": "default", "rope_theta": c.rope_theta},
                         SLIDING: {"rope_type": "default", "rope_theta": c.rope_local_base_freq}},
        attention_bias=False, attention_dropout=0.0, attn_logit_softcapping=None,
        use_bidirectional_attention=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def config_from_gemma(hf_config: Any) -> Gemma3Config:
    """The :class:`Gemma3Config` of a transformers ``Gemma3TextConfig``; a ValueError for
    another model type or a variant kvdoc lacks."""
    expect_model_type(hf_config, "gemma3_text")
    rope = {kind: dict((hf_config.rope_parameters or {}).get(kind) or {})
            for kind in (GLOBAL, SLIDING)}
    refuse_unsupported("gemma3_text", {
        "rope_type": (tuple(r.get("rope_type", "default") for r in rope.values()),
                      (("default", "default"),)),
        "hidden_activation": (hf_config.hidden_activation, ("gelu_pytorch_tanh",)),
        "attention_bias": (hf_config.attention_bias, (False,)),
        "attn_logit_softcapping": (hf_config.attn_logit_softcapping, (None,)),
        "use_bidirectional_attention": (bool(hf_config.use_bidirectional_attention), (False,)),
    })
    return as_ours(
        Gemma3Config, hf_config, "head_dim", "sliding_window", "final_logit_softcapping",
        query_pre_attn_scalar=int(hf_config.query_pre_attn_scalar),
        **_layout_from(list(hf_config.layer_types)),
        rope_theta=float(rope[GLOBAL].get("rope_theta", 1_000_000.0)),
        rope_local_base_freq=float(rope[SLIDING].get("rope_theta", 10_000.0)))


def _layout(config: Gemma3Config) -> dict[str, Any]:
    """The ``Gemma3TextConfig`` arguments that place ``config``'s global layers: the pattern
    itself, which transformers turns into ``layer_types`` its own way, or the explicit list.

    >>> _layout(Gemma3Config(sliding_window_pattern=3))
    {'sliding_window_pattern': 3}
    >>> _layout(Gemma3Config(global_layers=(0,)))
    {'layer_types': ['full_attention', 'sliding_attention']}
    """
    if config.global_layers is None:
        return {"sliding_window_pattern": config.sliding_window_pattern}
    return {"layer_types": [GLOBAL if i in config.global_layers else SLIDING
                            for i in range(config.n_layer)]}


def _layout_from(layer_types: list[str]) -> dict[str, Any]:
    """The :class:`Gemma3Config` arguments of transformers' ``layer_types``: the
    ``sliding_window_pattern`` that gives them, else the global layers' indices.

    >>> _layout_from(["sliding_attention", "sliding_attention", "full_attention"])
    {'sliding_window_pattern': 3}
    >>> _layout_from(["full_attention", "sliding_attention", "sliding_attention"])
    {'global_layers': (0,)}
    >>> _layout_from(["sliding_attention", "causal"])
    Traceback (most recent call last):
    ...
    ValueError: layer_types holds 'causal'; kvdoc knows sliding_attention and full_attention
    """
    for kind in layer_types:
        if kind not in (SLIDING, GLOBAL):
            raise ValueError(f"layer_types holds {kind!r}; kvdoc knows {SLIDING} and {GLOBAL}")
    n = len(layer_types)
    pattern = layer_types.index(GLOBAL) + 1 if GLOBAL in layer_types else n + 1
    if list(every_nth_full(n, pattern)) == layer_types:
        return {"sliding_window_pattern": pattern}
    return {"global_layers": tuple(i for i, kind in enumerate(layer_types) if kind == GLOBAL)}


def from_gemma(hf_model: Any) -> Gemma3Decoder:
    """A :class:`Gemma3Decoder` with the weights of transformers' ``Gemma3ForCausalLM``, in the
    model's dtype, in eval mode."""
    return holding(Gemma3Decoder(config_from_gemma(hf_model.config)),
                   by_our_names(hf_model.state_dict()))


def to_gemma(model: Gemma3Decoder) -> Any:
    """transformers' ``Gemma3ForCausalLM`` holding ``model``'s weights (the inverse of
    :func:`from_gemma`), in the model's dtype, in eval mode; the global RNG is left as it was."""
    return load_exported(gemma_config(model.config), by_their_names(model.state_dict()), model)
