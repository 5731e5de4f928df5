"""Configurations between kvdoc and transformers: a :class:`~kvdoc.core.config.GPTConfig` as
transformers' ``GPT2Config``, ``LlamaConfig`` or ``MistralConfig`` and back
(:func:`transformers_config`, :func:`config_from_transformers`), and a transformers model with
random weights built offline from one (:func:`transformers_model`), and a transformers model
holding weights mapped to its names (:func:`load_exported`, for every family's export).

A variant kvdoc does not implement (scaled RoPE, another activation, biases) is refused with a
``ValueError`` naming the field. transformers is imported only when a function needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvdoc.core.config import GPTConfig

BUFFERS = (".attn.bias", ".attn.masked_bias")
"""Causal-mask buffers some GPT-2 versions keep beside the weights: never loaded or exported."""


def causal_lm_class(model_type: str) -> type:
    """transformers' causal-LM class for ``"gpt2"``, ``"llama"`` or ``"mistral"``.

    >>> causal_lm_class("llama").__name__
    'LlamaForCausalLM'
    """
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM

    classes = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "mistral": MistralForCausalLM}
    if model_type not in classes:
        raise ValueError(f"family must be one of {', '.join(classes)}, got {model_type!r}")
    return classes[model_type]


def gpt2_config(config: GPTConfig) -> Any:
    """The transformers ``GPT2Config`` of the same model: GELU-tanh, no dropout, untied head.

    Only multi-head attention maps onto GPT-2: ``n_kv_head`` must equal ``n_head``.

    >>> from transformers import GPT2LMHeadModel
    >>> hf = GPT2LMHeadModel(gpt2_config(GPTConfig()))
    >>> sum(p.numel() for p in hf.parameters())
    145280
    >>> config_from_gpt2(hf.config) == GPTConfig()
    True
    """
    from transformers import GPT2Config

    if config.n_kv_head != config.n_head:
        raise ValueError("GPT-2 has no grouped-query attention: n_kv_head must equal n_head")
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=config.n_head, n_inner=config.n_inner,
        activation_function="gelu_new", layer_norm_epsilon=config.layer_norm_epsilon,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None)  # GPT-2's 50256 lies outside a small vocabulary


def config_from_gpt2(hf_config: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a transformers ``GPT2Config``; raises for a variant kvdoc lacks."""
    unsupported = {
        "activation_function": (hf_config.activation_function, ("gelu_new", "gelu_pytorch_tanh")),
        "scale_attn_weights": (hf_config.scale_attn_weights, (True,)),
        "scale_attn_by_inverse_layer_idx": (hf_config.scale_attn_by_inverse_layer_idx, (False,)),
        "reorder_and_upcast_attn": (hf_config.reorder_and_upcast_attn, (False,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(f"GPT-2 config has {name}={value!r}; kvdoc supports {allowed}")
    return GPTConfig(
        vocab_size=hf_config.vocab_size, n_positions=hf_config.n_positions,
        n_layer=hf_config.n_layer, n_head=hf_config.n_head, n_embd=hf_config.n_embd,
        n_inner=hf_config.n_inner or 4 * hf_config.n_embd,
        layer_norm_epsilon=hf_config.layer_norm_epsilon)


# --- Llama and Mistral ------------------------------------------------------------------------

def transformers_config(config: GPTConfig) -> Any:
    """The transformers config of the same model: ``GPT2Config``, ``LlamaConfig`` or
    ``MistralConfig``.

    A learned-position config maps to GPT-2 (:func:`gpt2_config`); a Llama-style one
    (:func:`kvdoc.core.config.llama_config`) to Llama, or to Mistral when it has a sliding window.

    >>> from transformers import MistralForCausalLM
    >>> from kvdoc.core.config import mistral_config
    >>> hf = MistralForCausalLM(transformers_config(mistral_config()))
    >>> hf.config.sliding_window, config_from_transformers(hf.config) == mistral_config()
    (32, True)
    """
    if config.position == "learned":
        return gpt2_config(config)
    from transformers import LlamaConfig, MistralConfig

    if (config.norm, config.mlp, config.bias) != ("rmsnorm", "swiglu", False):
        raise ValueError("Llama and Mistral use RMSNorm, a SwiGLU MLP and no biases with RoPE")
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.n_inner,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head, max_position_embeddings=config.n_positions,
        rms_norm_eps=config.layer_norm_epsilon, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if config.sliding_window is None:
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    return MistralConfig(sliding_window=config.sliding_window, **common)


def config_from_transformers(hf_config: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a transformers GPT-2, Llama or Mistral config.

    Raises:
        ValueError: another model type, or a variant kvdoc lacks (scaled RoPE, another
            activation, a head size other than ``hidden_size / num_attention_heads``, biases).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "gpt2":
        return config_from_gpt2(hf_config)
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"kvdoc loads gpt2, llama and mistral models, not {model_type!r}")
    rope = dict(hf_config.rope_parameters or {})
    split_width = hf_config.hidden_size // hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or split_width
    unsupported = {
        "rope_type": (rope.get("rope_type", "default"), ("default",)),
        "hidden_act": (hf_config.hidden_act, ("silu",)),
        "head_dim": (head_dim, (split_width,)),
        "attention_bias": (getattr(hf_config, "attention_bias", False), (False,)),
        "mlp_bias": (getattr(hf_config, "mlp_bias", False), (False,)),
        "pretraining_tp": (getattr(hf_config, "pretraining_tp", 1) or 1, (1,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(f"{model_type} config has {name}={value!r}; kvdoc supports {allowed}")
    window = getattr(hf_config, "sliding_window", None) if model_type == "mistral" else None
    return GPTConfig(
        vocab_size=hf_config.vocab_size, n_positions=hf_config.max_position_embeddings,
        n_layer=hf_config.num_hidden_layers, n_head=hf_config.num_attention_heads,
        n_embd=hf_config.hidden_size, n_inner=hf_config.intermediate_size,
        n_kv_head=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        layer_norm_epsilon=hf_config.rms_norm_eps, position="rope",
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm="rmsnorm", mlp="swiglu",
        bias=False, tie_word_embeddings=bool(hf_config.tie_word_embeddings), sliding_window=window)


def transformers_model(family: str, config: GPTConfig | None = None, seed: int = 0,
                       dtype: torch.dtype = torch.float32) -> Any:
    """A transformers model with random weights, built offline from a kvdoc config, in eval mode.

    Args:
        family: ``"gpt2"``, ``"llama"`` or ``"mistral"``.
        config: default :class:`GPTConfig` (GPT-2), :func:`~kvdoc.core.config.llama_config` or
            :func:`~kvdoc.core.config.mistral_config` (window 32).
        seed: ``torch.manual_seed`` before the weights are drawn.
        dtype: the model's dtype.

    >>> transformers_model("llama").config.num_key_value_heads
    2
    """
    from kvdoc.core.config import llama_config, mistral_config

    cls = causal_lm_class(family)
    default = {"gpt2": GPTConfig, "llama": llama_config, "mistral": mistral_config}[family]
    hf_config = transformers_config(config or default())
    if hf_config.model_type != family:
        raise ValueError(f"this config builds a {hf_config.model_type} model, not {family}")
    torch.manual_seed(seed)
    return cls(hf_config).to(dtype).eval()


def load_exported(hf: Any, mapped: Mapping[str, torch.Tensor], model: torch.nn.Module,
                  family: str) -> Any:
    """``hf`` holding ``mapped`` (its own parameter names), in ``model``'s dtype, in eval mode.

    Every parameter of ``hf`` must be in ``mapped`` and nothing else (the causal-mask buffers
    some GPT-2 versions keep aside); otherwise a ``ValueError`` names what did not map.
    """
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in mapped.items()},
                                             strict=False)
    missing = [k for k in missing if not k.endswith(BUFFERS)]
    if missing or unexpected:
        raise ValueError(f"weights do not map onto {family}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return hf.to(next(model.parameters()).dtype).eval()
