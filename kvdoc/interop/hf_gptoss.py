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
    as_ours,
    as_theirs,
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
        **as_theirs(c, "head_dim", "sliding_window", "swiglu_alpha", "swiglu_limit"),
        num_local_experts=c.n_experts, num_experts_per_tok=c.experts_per_token,
        layer_types=list(c.types), rope_parameters=rope, attention_dropout=0.0,
        attention_bias=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
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
    return as_ours(
        GptOssConfig, hf_config, "head_dim", "sliding_window", "swiglu_alpha", "swiglu_limit",
        n_experts=hf_config.num_local_experts, experts_per_token=hf_config.num_experts_per_tok,
        layer_types=None if types == GptOssConfig(n_layer=len(types)).types else types,
        rope_theta=float(rope.get("rope_theta", 150000.0)),
        **({"yarn_factor": None} if kind == "default" else yarn))


def from_gptoss(hf_model: Any) -> GptOssDecoder:
    """A :class:`GptOssDecoder` with the weights of transformers' ``GptOssForCausalLM``, in the
    model's dtype, in eval mode."""
    return holding(GptOssDecoder(config_from_gptoss(hf_model.config)),
                   by_our_names(hf_model.state_dict()))


def to_gptoss(model: GptOssDecoder) -> Any:
    """transformers' ``GptOssForCausalLM`` holding ``model``'s weights (the inverse of
    :func:`from_gptoss`), in the model's dtype, in eval mode; the global RNG is left as it was."""
    return load_exported(gptoss_config(model.config), by_their_names(model.state_dict()), model)
