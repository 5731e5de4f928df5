"""transformers' gpt-oss to and from :class:`kvdoc.core.gptoss.GptOssDecoder`.

Inside a layer the weights keep transformers' names; only the prefixes move (``model.layers.i.``
is ``h.i.``). The layout comes from ``layer_types``, the rope from ``rope_parameters``
(``"yarn"`` or ``"default"``). A model built here runs transformers 5.24's eager attention (its
SDPA path takes no sinks: ``GptOssPreTrainedModel._supports_sdpa = False``) and eager experts
(its default ``grouped_mm`` raises "strides should be multiple of 16 bytes" on odd widths).

Not loaded: a YaRN ``attention_factor``, ``mscale`` or ``partial_rotary_factor`` (gpt-oss's
checkpoints set none), attention without biases.

>>> import torch
>>> from kvdoc.interop.hf_config import random_model
>>> hf = random_model(gptoss_config(GptOssConfig(sliding_window=4)))
>>> ours = from_gptoss(hf)
>>> ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
>>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
True
>>> config_from_gptoss(gptoss_config(GptOssConfig())) == GptOssConfig()
True
"""

from __future__ import annotations

from typing import Any

from kvdoc.core.gptoss import GptOssConfig, GptOssDecoder
from kvdoc.interop.hf_config import (
    by_our_names,
    by_their_names,
    expect_model_type,
    holding,
    load_exported,
)


def gptoss_config(config: GptOssConfig) -> Any:
    """The transformers ``GptOssConfig`` of the same model: no dropout, no special tokens."""
    from transformers import GptOssConfig as HFConfig

    c = config
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.yarn_factor is not None:
        rope |= {"rope_type": "yarn", "factor": c.yarn_factor, "beta_fast": c.yarn_beta_fast,
                 "beta_slow": c.yarn_beta_slow, "truncate": c.yarn_truncate,
                 "original_max_position_embeddings": c.yarn_original_positions}
    hf_config = HFConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.n_inner,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head, head_dim=c.head_dim,
        num_local_experts=c.n_experts, num_experts_per_tok=c.experts_per_token,
        sliding_window=c.sliding_window, layer_types=list(c.types),
        max_position_embeddings=c.n_positions, rms_norm_eps=c.layer_norm_epsilon,
        rope_parameters=rope, swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit,
        tie_word_embeddings=c.tie_word_embeddings, attention_dropout=0.0, attention_bias=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    # the classes' own code: the default grouped_mm experts need widths of 16-byte multiples
    hf_config._attn_implementation, hf_config._experts_implementation = "eager", "eager"
    return hf_config


def config_from_gptoss(hf_config: Any) -> GptOssConfig:
    """The :class:`GptOssConfig` of a transformers ``GptOssConfig``; a ValueError for another
    model type or a variant kvdoc lacks."""
    expect_model_type(hf_config, "gpt_oss")
    rope = dict(hf_config.rope_parameters or {})
    kind = rope.get("rope_type", "default")
    lacking = [k for k in ("attention_factor", "mscale", "mscale_all_dim")
               if rope.get(k) is not None]
    if kind not in ("default", "yarn") or lacking or rope.get("partial_rotary_factor", 1.0) != 1:
        raise ValueError(f"gpt_oss config has rope_parameters={rope}; kvdoc supports default "
                         "and yarn rope without attention_factor, mscale or a partial rotary")
    if not hf_config.attention_bias:
        raise ValueError("gpt_oss config has attention_bias=False; kvdoc supports True")
    yarn = {} if kind == "default" else dict(
        yarn_factor=float(rope["factor"]), yarn_beta_fast=float(rope.get("beta_fast") or 32),
        yarn_beta_slow=float(rope.get("beta_slow") or 1),
        yarn_original_positions=int(rope["original_max_position_embeddings"]),
        yarn_truncate=bool(rope.get("truncate", True)))  # transformers' default when absent
    types = tuple(hf_config.layer_types)
    return GptOssConfig(
        vocab_size=hf_config.vocab_size, n_positions=hf_config.max_position_embeddings,
        n_head=hf_config.num_attention_heads, n_kv_head=hf_config.num_key_value_heads,
        n_embd=hf_config.hidden_size, head_dim=hf_config.head_dim,
        n_inner=hf_config.intermediate_size, n_experts=hf_config.num_local_experts,
        experts_per_token=hf_config.num_experts_per_tok, n_layer=hf_config.num_hidden_layers,
        sliding_window=hf_config.sliding_window,
        layer_types=None if types == GptOssConfig(n_layer=len(types)).types else types,
        layer_norm_epsilon=hf_config.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 150000.0)),
        **({"yarn_factor": None} if kind == "default" else yarn),
        swiglu_alpha=hf_config.swiglu_alpha, swiglu_limit=hf_config.swiglu_limit,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings))


def from_gptoss(hf_model: Any) -> GptOssDecoder:
    """A :class:`GptOssDecoder` with the weights of transformers' ``GptOssForCausalLM``, in the
    model's dtype, in eval mode."""
    return holding(GptOssDecoder(config_from_gptoss(hf_model.config)),
                   by_our_names(hf_model.state_dict()))


def to_gptoss(model: GptOssDecoder) -> Any:
    """transformers' ``GptOssForCausalLM`` holding ``model``'s weights (the inverse of
    :func:`from_gptoss`), in the model's dtype, in eval mode; the global RNG is left as it was."""
    return load_exported(gptoss_config(model.config), by_their_names(model.state_dict()), model)
