"""transformers' DeepSeek-V3 (dense layers) to and from :class:`kvdoc.core.mla.MLADecoder`.

The attention's weights keep transformers' names; the rest take kvdoc's, as
:mod:`kvdoc.interop.hf_weights` does for Llama.

One convention differs. DeepSeek's checkpoints store each rotary vector in interleaved pairs
``(x0, x1), (x2, x3), ..`` (``rope_interleave=True``, transformers' default for DeepseekV3);
kvdoc's RoPE (:mod:`kvdoc.core.model`) pairs ``x[i]`` with ``x[i + d_R/2]``. transformers
computes the interleaved rotation as the half-split one of ``[x0, x2, .., x1, x3, ..]``, so
permuting the rotary rows of ``q_proj`` (``q_b_proj``) and ``kv_a_proj_with_mqa`` that way makes
the two models compute the same numbers; with ``rope_interleave=False`` no rows move.

Only dense models load: every layer's MLP must be the dense one (``first_k_dense_replace`` at
least ``num_hidden_layers``); mixture-of-experts layers are not part of kvdoc. No YaRN scaling
(``rope_type`` "default") and no attention biases.

>>> from kvdoc.interop.hf_config import random_model
>>> hf = random_model(deepseek_config(MLAConfig(q_lora_rank=12)))
>>> ours = from_deepseek(hf)
>>> ids = torch.tensor([[1, 2, 3, 4, 5]])
>>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from kvdoc.core.mla import MLAConfig, MLADecoder
from kvdoc.interop.hf_config import (
    NORMS_AND_DOWN,
    OUTER,
    as_ours,
    as_theirs,
    expect_model_type,
    holding,
    load_exported,
    outer_weights,
    refuse_unsupported,
)

#: the attention's parameters, below ``self_attn.`` (transformers) and ``attn.`` (kvdoc); a
#: model maps those it has
ATTENTION = tuple(f"{name}.weight" for name in (
    "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
    "kv_b_proj", "o_proj"))

PUBLISHED: dict[str, dict[str, Any]] = {
    "DeepSeek-V3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, max_position_embeddings=163840),
    "DeepSeek-V2": dict(vocab_size=102400, hidden_size=5120, intermediate_size=12288,
                        num_hidden_layers=60, num_attention_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, max_position_embeddings=163840),
}
"""Attention sizes from the published ``config.json`` files (deepseek-ai/DeepSeek-V3 and -V2;
``intermediate_size`` is the dense layers' MLP width: the experts do not change the cache)."""


def published_config(name: str) -> MLAConfig:
    """The :class:`MLAConfig` of a :data:`PUBLISHED` model (its cache sizes; MLP dense).

    >>> cfg = published_config("DeepSeek-V3")
    >>> cfg.n_layer, cfg.latent_dim                         # 61 layers of 512 + 64 a position
    (61, 576)
    """
    if name not in PUBLISHED:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(PUBLISHED)}")
    return config_of(PUBLISHED[name])


#: the latent attention's sizes, named alike in both
_MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def config_of(c: Mapping[str, Any], cls: type = MLAConfig, *same: str) -> Any:
    """The ``cls`` (:class:`MLAConfig` or a subclass) of a DeepSeek ``config.json``: its sizes,
    the latent attention's and those named ``same``."""
    c = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0, **c}
    return as_ours(cls, SimpleNamespace(**c), *_MLA, *same, rope_theta=float(c["rope_theta"]))


def their_fields(c: MLAConfig, *same: str) -> dict[str, Any]:
    """The ``DeepseekV3Config`` (and ``DeepseekV32Config``) arguments of ``c`` (and of its
    fields ``same``): every layer dense, no dropout, no special tokens."""
    return dict(**as_theirs(c, *_MLA, *same), num_key_value_heads=c.n_head,
                first_k_dense_replace=c.n_layer,  # no MoE layer
                rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                attention_bias=False, attention_dropout=0.0, hidden_act="silu",
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def deepseek_config(config: MLAConfig, rope_interleave: bool = True) -> Any:
    """The transformers ``DeepseekV3Config`` of the same model (:func:`their_fields`).

    >>> hf_config = deepseek_config(MLAConfig())
    >>> hf_config.first_k_dense_replace >= hf_config.num_hidden_layers
    True
    >>> config_from_deepseek(hf_config) == MLAConfig()
    True
    """
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**their_fields(config), rope_interleave=rope_interleave)


def config_from_deepseek(hf_config: Any) -> MLAConfig:
    """The :class:`MLAConfig` of a transformers ``DeepseekV3Config``; a ValueError for another
    model type, MoE layers, scaled RoPE, attention biases or another activation."""
    expect_model_type(hf_config, "deepseek_v3")
    if hf_config.first_k_dense_replace < hf_config.num_hidden_layers:
        raise ValueError("DeepseekV3 config has MoE layers (first_k_dense_replace < "
                         "num_hidden_layers); kvdoc loads dense layers only")
    return dense_config(hf_config)


def dense_config(hf_config: Any, cls: type = MLAConfig, *same: str) -> Any:
    """The ``cls`` of a DeepSeek config whose layers are dense (:func:`config_of`); a ValueError
    for scaled RoPE, attention biases or another activation."""
    rope = dict(hf_config.rope_parameters or {})
    refuse_unsupported(hf_config.model_type, {
        "rope_type": (rope.get("rope_type", "default"), ("default",)),
        "attention_bias": (hf_config.attention_bias, (False,)),
        "hidden_act": (hf_config.hidden_act, ("silu",))})
    return config_of({**hf_config.to_dict(), "rope_theta": rope.get("rope_theta", 10000.0)},
                     cls, *same)


def rope_rows(config: MLAConfig, interleaved_to_split: bool) -> tuple[torch.Tensor, ...]:
    """Row orders of the query and ``kv_a_proj_with_mqa`` weights that move each head's rotary
    rows between the interleaved and the half-split layout."""
    d_r, d_qk, r = config.qk_rope_head_dim, config.qk_head_dim, config.kv_lora_rank
    perm = torch.cat((torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)))  # evens, then odds
    perm = perm if interleaved_to_split else perm.argsort()
    q = torch.arange(config.n_head * d_qk).view(config.n_head, d_qk)
    q[:, -d_r:] = q[:, -d_r:][:, perm]
    kv = torch.arange(r + d_r)
    kv[r:] = kv[r:][perm]
    return q.flatten(), kv


def _move_rope(state: dict[str, torch.Tensor], config: MLAConfig, prefix: str,
               interleaved_to_split: bool) -> None:
    q_rows, kv_rows = rope_rows(config, interleaved_to_split)
    q = prefix + ("q_proj.weight" if config.q_lora_rank is None else "q_b_proj.weight")
    state[q] = state[q][q_rows]
    state[prefix + "kv_a_proj_with_mqa.weight"] = state[prefix + "kv_a_proj_with_mqa.weight"][
        kv_rows]


def layers_by_our_names(state: Mapping[str, torch.Tensor], config: MLAConfig,
                        attention: Iterable[str], interleaved: bool) -> dict[str, torch.Tensor]:
    """A transformers DeepSeek state dict (dense layers) under kvdoc's names: the outer weights,
    the norms and MLP, and each parameter of ``attention`` (names below ``self_attn.``, those
    present) below ``attn.``; with ``interleaved``, the rotary rows moved to kvdoc's layout."""
    mapped = outer_weights(state)
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"h.{i}."
        mapped.update({dst + ours + ".weight": state[src + theirs + ".weight"]
                       for theirs, ours in NORMS_AND_DOWN.items()})
        mapped.update({f"{dst}attn.{name}": state[f"{src}self_attn.{name}"]
                       for name in attention if f"{src}self_attn.{name}" in state})
        mapped[dst + "mlp.c_fc.weight"] = torch.cat((state[src + "mlp.gate_proj.weight"],
                                                     state[src + "mlp.up_proj.weight"]))
        if interleaved:
            _move_rope(mapped, config, dst + "attn.", interleaved_to_split=True)
    return mapped


def layers_by_their_names(state: dict[str, torch.Tensor], config: MLAConfig,
                          attention: Iterable[str], interleaved: bool) -> dict[str, torch.Tensor]:
    """The inverse of :func:`layers_by_our_names` (``state``, kvdoc's, has its rotary rows moved
    in place where ``interleaved``)."""
    mapped = {theirs: state[ours] for theirs, ours in OUTER.items()}
    for i in range(config.n_layer):
        src, dst = f"h.{i}.", f"model.layers.{i}."
        if interleaved:
            _move_rope(state, config, src + "attn.", interleaved_to_split=False)
        mapped.update({dst + theirs + ".weight": state[src + ours + ".weight"]
                       for theirs, ours in NORMS_AND_DOWN.items()})
        mapped.update({f"{dst}self_attn.{name}": state[f"{src}attn.{name}"]
                       for name in attention if f"{src}attn.{name}" in state})
        gate, up = state[src + "mlp.c_fc.weight"].chunk(2)
        mapped.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up})
    return mapped


def from_deepseek(hf_model: Any) -> MLADecoder:
    """An :class:`MLADecoder` with the weights of transformers' ``DeepseekV3ForCausalLM``
    (dense layers only), in the model's dtype, in eval mode."""
    config = config_from_deepseek(hf_model.config)
    mapped = layers_by_our_names(hf_model.state_dict(), config, ATTENTION,
                                 hf_model.config.rope_interleave)
    return holding(MLADecoder(config), mapped)


def to_deepseek(model: MLADecoder, rope_interleave: bool = True) -> Any:
    """transformers' ``DeepseekV3ForCausalLM`` holding ``model``'s weights, in its dtype, in eval
    mode; the global RNG is left as it was."""
    config = model.config
    mapped = layers_by_their_names(dict(model.state_dict()), config, ATTENTION, rope_interleave)
    return load_exported(deepseek_config(config, rope_interleave), mapped, model)
