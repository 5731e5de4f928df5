"""transformers' Qwen3.5 (text, dense) to and from :class:`kvdoc.core.deltanet.DeltaNetDecoder`.

Inside a layer the weights keep transformers' names; only the prefixes move (``model.layers.i.``
is ``h.i.``). The layer types come from ``layer_types``; RoPE's base and rotary fraction from
``rope_parameters`` (a text model's three M-RoPE sections turn the same text positions, so they
are plain RoPE here). Qwen3-Next (``qwen3_next``) loads through :func:`from_qwen35` where every
layer is dense: its layers compute what Qwen3.5's do, its Gated DeltaNet from two projections
whose rows interleave the heads (``in_proj_qkvz``, ``in_proj_ba``: :func:`_split_next`). A
Qwen3-Next with sparse-MoE layers (transformers 5.24's ``Qwen3NextSparseMoeBlock``: every
published checkpoint, and the config's default) is refused by name, as kvdoc has no experts.

>>> from kvdoc.interop.hf_config import random_model
>>> hf = random_model(qwen35_config(DeltaNetConfig(chunk_size=4)))
>>> ours = from_qwen35(hf)
>>> ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
>>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
True
"""

from __future__ import annotations

from typing import Any

import torch

from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder
from kvdoc.interop.hf_config import (
    as_ours,
    as_theirs,
    by_our_names,
    by_their_names,
    holding,
    load_exported,
    refuse_unsupported,
)

#: the Gated DeltaNet's sizes, named alike in both
_LINEAR = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
           "linear_num_key_heads", "linear_num_value_heads")


def qwen35_config(config: DeltaNetConfig) -> Any:
    """The transformers ``Qwen3_5TextConfig`` of the same model (no dropout, no special tokens).

    >>> config_from_qwen35(qwen35_config(DeltaNetConfig())) == DeltaNetConfig()
    True
    """
    from transformers import Qwen3_5TextConfig

    c = config
    return Qwen3_5TextConfig(
        **as_theirs(c, "head_dim", *_LINEAR), hidden_act="silu", layer_types=list(c.layer_types),
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                         "partial_rotary_factor": c.partial_rotary_factor},
        attention_bias=False, attention_dropout=0.0,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)


def config_from_qwen35(hf_config: Any, chunk_size: int = 64) -> DeltaNetConfig:
    """The :class:`DeltaNetConfig` of a transformers ``Qwen3_5TextConfig`` (or of a
    ``Qwen3_5Config``'s ``text_config``); a ValueError for another model type or a variant kvdoc
    lacks.

    >>> from transformers import Qwen3NextConfig
    >>> config_from_qwen35(Qwen3NextConfig(num_hidden_layers=2))
    Traceback (most recent call last):
    ...
    ValueError: qwen3_next layers [0, 1] are sparse mixtures of experts ...
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "qwen3_5":
        hf_config, model_type = hf_config.text_config, hf_config.text_config.model_type
    if model_type == "qwen3_next":
        c = hf_config  # transformers' Qwen3NextDecoderLayer's test, layer by layer
        moe = [i for i in range(c.num_hidden_layers) if i not in c.mlp_only_layers
               and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0]
        if moe:
            raise ValueError(
                f"qwen3_next layers {moe} are sparse mixtures of experts (Qwen3NextSparseMoeBlock),"
                " which kvdoc does not implement; a Qwen3-Next loads where every layer is dense "
                "(num_experts=0, or every layer in mlp_only_layers)")
    elif model_type != "qwen3_5_text":
        raise ValueError(f"expected a qwen3_5_text or qwen3_next config, got {model_type!r}")
    rope = dict(hf_config.rope_parameters or {})
    refuse_unsupported("qwen3_5_text", {
        "rope_type": (rope.get("rope_type", "default"), ("default",)),
        "hidden_act": (hf_config.hidden_act, ("silu",)),
        "attention_bias": (hf_config.attention_bias, (False,)),
    })
    return as_ours(
        DeltaNetConfig, hf_config, "head_dim", *_LINEAR, layer_types=tuple(hf_config.layer_types),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        rope_theta=float(rope["rope_theta"]), chunk_size=chunk_size)


def from_qwen35(hf_model: Any, chunk_size: int = 64) -> DeltaNetDecoder:
    """A :class:`DeltaNetDecoder` with the weights of transformers' ``Qwen3_5ForCausalLM``, in
    the model's dtype, in eval mode (``chunk_size``: kvdoc's prefill chunk)."""
    mapped = by_our_names(hf_model.state_dict())
    config = config_from_qwen35(hf_model.config, chunk_size)
    for key in [k for k in mapped if k.endswith(".in_proj_qkvz.weight")]:  # Qwen3-Next
        prefix = key.removesuffix("in_proj_qkvz.weight")
        mapped.update(_split_next(config, mapped.pop(key), mapped.pop(prefix + "in_proj_ba.weight"),
                                  prefix))
    return holding(DeltaNetDecoder(config), mapped)


def _split_next(config: DeltaNetConfig, qkvz: torch.Tensor, ba: torch.Tensor,
                prefix: str) -> dict[str, torch.Tensor]:
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` rows as Qwen3.5's four projections.

    Qwen3-Next lays the rows out per key head: its query, its key, then the values and the gates
    of the ``H_v / H_k`` value heads it serves (``fix_query_key_value_ordering``); Qwen3.5 lays
    every query head, then every key head, then every value head, and the gates apart."""
    c, d = config, qkvz.shape[1]
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    per = c.linear_num_value_heads // hk  # value heads a key head serves
    q, k, v, z = qkvz.view(hk, -1, d).split((dk, dk, per * dv, per * dv), dim=1)
    b, a = ba.view(hk, 2 * per, d).split((per, per), dim=1)
    rows = [t.reshape(-1, d) for t in (q, k, v)]
    return {prefix + "in_proj_qkv.weight": torch.cat(rows), prefix + "in_proj_z.weight":
            z.reshape(-1, d), prefix + "in_proj_b.weight": b.reshape(-1, d),
            prefix + "in_proj_a.weight": a.reshape(-1, d)}


def to_qwen35(model: DeltaNetDecoder) -> Any:
    """transformers' ``Qwen3_5ForCausalLM`` holding ``model``'s weights (the inverse of
    :func:`from_qwen35`), in the model's dtype, in eval mode; the global RNG is left as it was."""
    return load_exported(qwen35_config(model.config), by_their_names(model.state_dict()), model)
