"""transformers' Bamba (a Mamba-2 hybrid) to and from :class:`kvdoc.core.mamba2.MambaDecoder`.

Of the Mamba-2 hybrids transformers 5.24.0 ships (Bamba, Falcon-H1, Nemotron-H, Granite 4
hybrid), Bamba's PyTorch path is the plainest: one dense SwiGLU MLP after every layer, no MoE
(Granite), no per-block multipliers and muP scales (Falcon-H1), no MLP-only or MoE layer types
(Nemotron-H). Inside a layer the weights keep transformers' names; only the prefixes move
(``model.layers.i.`` is ``h.i.``, ``model.final_layernorm`` is ``ln_f``) and
``feed_forward`` is ``mlp``.

Refused by name: attention or MLP biases, another activation than SiLU, scaled RoPE.

transformers' own cached path departs from its full forward, and kvdoc does not follow it
(``tests/test_mamba2.py`` measures each, in FP64): ``BambaModel.forward`` turns a step's Q and K
at position 0 unless given ``position_ids`` (``generate()`` gives them; about 1e-3 off from the
first step); given them, its float32 islands round the two forms 1e-8 to 1e-7 apart (lifted by
:func:`~kvdoc.interop.hf_float64.float64_islands_lifted`); and where ``time_step_limit`` binds,
its recurrent branch (``mamba2_selective_state_update``) does not clamp ``dt`` as its chunked
scan does (kvdoc clamps in both). Its cache keeps ``d_conv`` inputs per conv state, of which
``causal_conv1d_update`` never reads the oldest; kvdoc keeps ``d_conv - 1``.

>>> import torch
>>> from kvdoc.interop.hf_config import random_model
>>> hf = random_model(bamba_config(Mamba2Config()))
>>> ours = from_bamba(hf)
>>> ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
>>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
True
"""

from __future__ import annotations

import math
from typing import Any

from kvdoc.core.mamba2 import Mamba2Config, MambaDecoder
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

#: transformers' names of Bamba's weights around the layers, and kvdoc's
OUTER = {"model.embed_tokens.weight": "wte.weight", "model.final_layernorm.weight": "ln_f.weight",
         "lm_head.weight": "lm_head.weight"}


#: the Mamba-2 mixer's sizes, named alike in both
_MAMBA = ("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand")


def bamba_config(config: Mamba2Config) -> Any:
    """The transformers ``BambaConfig`` of the same model: no dropout, no special tokens.

    >>> config_from_bamba(bamba_config(Mamba2Config())) == Mamba2Config()
    True
    """
    from transformers import BambaConfig

    c = config
    return BambaConfig(
        **as_theirs(c, *_MAMBA), attn_layer_indices=list(c.attn_layers),
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        mamba_d_head=c.mamba_head_dim, mamba_chunk_size=c.chunk_size, mamba_conv_bias=c.conv_bias,
        mamba_proj_bias=c.proj_bias, time_step_limit=tuple(c.time_step_limit),
        hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)


def config_from_bamba(hf_config: Any) -> Mamba2Config:
    """The :class:`Mamba2Config` of a transformers ``BambaConfig``; a ValueError for another
    model type or a variant kvdoc lacks."""
    expect_model_type(hf_config, "bamba")
    rope = dict(hf_config.rope_parameters or {})
    refuse_unsupported("bamba", {
        "rope_type": (rope.get("rope_type", "default"), ("default",)),
        "hidden_act": (hf_config.hidden_act, ("silu",)),
        "attention_bias": (hf_config.attention_bias, (False,)),
        "mlp_bias": (hf_config.mlp_bias, (False,)),
        "partial_rotary_factor": (rope.get("partial_rotary_factor", 0.5), (0.5,))})
    c = hf_config
    return as_ours(
        Mamba2Config, c, *_MAMBA, attn_layers=tuple(c.attn_layer_indices or ()),
        chunk_size=c.mamba_chunk_size, conv_bias=bool(c.mamba_conv_bias),
        proj_bias=bool(c.mamba_proj_bias),
        time_step_limit=tuple(float(v) for v in (c.time_step_limit or (0.0, math.inf))),
        rope_theta=float(rope.get("rope_theta", 10000.0)))


def from_bamba(hf_model: Any) -> MambaDecoder:
    """A :class:`MambaDecoder` with the weights of transformers' ``BambaForCausalLM``, in the
    model's dtype, in eval mode."""
    return holding(MambaDecoder(config_from_bamba(hf_model.config)),
                   by_our_names(hf_model.state_dict(), OUTER, ("feed_forward", "mlp")))


def to_bamba(model: MambaDecoder) -> Any:
    """transformers' ``BambaForCausalLM`` holding ``model``'s weights (the inverse of
    :func:`from_bamba`), in the model's dtype, in eval mode; the global RNG is left as it was."""
    mapped = by_their_names(model.state_dict(), OUTER, ("feed_forward", "mlp"))
    return load_exported(bamba_config(model.config), mapped, model)
