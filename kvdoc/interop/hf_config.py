"""Configurations between kvdoc and transformers: the one reader of a transformers config
(:func:`config_fields`), a :class:`~kvdoc.core.model.GPTConfig` as transformers' GPT-2, Llama,
Mistral, Qwen2 (Q/K/V biases), Qwen3 (q/k norms) or Phi-3 (fused projections) config and back,
and what every family's weight mapping shares.

A variant kvdoc does not implement (scaled or partial RoPE, another activation, other biases,
Qwen's sliding layers) is refused with a ``ValueError`` naming the field. transformers and torch
are imported only when a function needs them: ``python -m kvdoc memory`` reads a
``config.json`` through this module without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free: the command line reads config.json files through this module
    import torch

    from kvdoc.core.model import GPTConfig

BUFFERS = (".attn.bias", ".attn.masked_bias")
"""Causal-mask buffers some GPT-2 versions keep beside the weights: never loaded or exported."""

#: transformers' names of the weights around the layers (Llama, Gemma 3, DeepSeek-V3): kvdoc's
OUTER = {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "ln_f.weight",
         "lm_head.weight": "lm_head.weight"}
#: a Llama-style layer's norms and MLP down projection: transformers' names, and kvdoc's
NORMS_AND_DOWN = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2",
                  "mlp.down_proj": "mlp.c_proj"}
#: the RoPE families :func:`config_from_transformers` reads, beside GPT-2
ROPE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
#: a decoder's sizes: kvdoc's names, and transformers'
SIZES = {"vocab_size": "vocab_size", "n_positions": "max_position_embeddings",
         "n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_inner": "intermediate_size",
         "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
         "layer_norm_epsilon": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings"}


def _names(config: Any, same: tuple[str, ...]) -> dict[str, str]:
    """:data:`SIZES` and the fields ``same`` (named alike in both), those ``config`` (a kvdoc
    config or its class) has: kvdoc's names, and transformers'."""
    fields = {f.name for f in dataclasses.fields(config)}
    return {ours: theirs for ours, theirs in {**SIZES, **{name: name for name in same}}.items()
            if ours in fields}


def as_theirs(config: Any, *same: str) -> dict[str, Any]:
    """``config``'s (a kvdoc config's) :data:`SIZES` and fields ``same`` under transformers'
    names.

    >>> from kvdoc.core.mla import MLAConfig
    >>> as_theirs(MLAConfig(), "kv_lora_rank")["num_hidden_layers"]
    2
    """
    return {theirs: getattr(config, ours) for ours, theirs in _names(config, same).items()}


def as_ours(cls: type, hf_config: Any, *same: str, **rest: Any) -> Any:
    """The kvdoc config ``cls`` of ``hf_config``'s :data:`SIZES` and fields ``same`` (the
    inverse of :func:`as_theirs`), and of ``rest``."""
    return cls(**{**{ours: getattr(hf_config, theirs)
                     for ours, theirs in _names(cls, same).items()}, **rest})


#: GPT-2's short names, and the long ones
_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_embd": "hidden_size", "n_positions": "max_position_embeddings"}
#: sizes a published config.json leaves to its transformers class: Gemma 3's ``text_config``
#: omits those equal to transformers 5.24.0's ``Gemma3TextConfig`` defaults (gemma-3-4b-pt's
#: gives no head counts)
_CLASS_DEFAULTS = {"gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4,
                                   "head_dim": 256, "max_position_embeddings": 131072,
                                   "sliding_window": 4096}}


def config_fields(config: Any, name: str = "config.json") -> dict[str, Any]:
    """A transformers config (a config object, or a parsed ``config.json``) as one dict under
    the long names: a multimodal config's ``text_config`` in its place, GPT-2's names also
    under the long ones, the sizes a published Gemma 3 file leaves to its class filled in,
    ``None`` values dropped.

    >>> c = config_fields({"n_layer": 12, "n_head": 12, "n_embd": 768, "bos_token_id": None})
    >>> c["num_hidden_layers"], "bos_token_id" in c
    (12, False)
    """
    if not isinstance(config, Mapping):
        if not callable(getattr(config, "to_dict", None)):
            raise ValueError(f"{name}: expected a JSON object, got {type(config).__name__}")
        config = config.to_dict()
    c: dict[str, Any] = dict(config)
    if isinstance(c.get("text_config"), Mapping):  # multimodal: the decoder's own config
        c = {"model_type": c.get("model_type"), **c["text_config"]}
    for old, new in _ALIASES.items():
        c.setdefault(new, c.get(old))
    defaults = _CLASS_DEFAULTS.get(str(c.get("model_type") or ""), {})
    return {**defaults, **{k: v for k, v in c.items() if v is not None}}


def positive(c: Mapping[str, Any], key: str, where: str) -> int:
    """``c[key]``, which must be a positive integer; else a ValueError naming ``key``."""
    value = c.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        got = "missing" if value is None else f"{value!r}"
        raise ValueError(f"{where}: {key} must be a positive integer ({got})")
    return value


def attention_sizes(c: Mapping[str, Any], where: str) -> tuple[int, int, int]:
    """``(H, H_kv, D)`` of :func:`config_fields`' output: ``num_key_value_heads`` (absent:
    ``num_attention_heads``, MHA; Falcon's ``num_kv_heads`` with ``new_decoder_architecture``
    or without ``multi_query``, else 1 with it) and ``head_dim`` (absent:
    ``hidden_size / num_attention_heads``).

    >>> attention_sizes(config_fields({"num_attention_heads": 32, "hidden_size": 4096,
    ...                                "num_key_value_heads": 8}), "x")
    (32, 8, 128)
    """
    heads = positive(c, "num_attention_heads", where)
    if c.get("num_key_value_heads") is not None:
        kv_heads = positive(c, "num_key_value_heads", where)
    elif c.get("new_decoder_architecture") or c.get("multi_query") is False:
        # Falcon-40B/180B's grouped heads (num_kv_heads); multi_query is then not read
        kv_heads = positive({"num_kv_heads": heads, **c}, "num_kv_heads", where)
    else:
        kv_heads = 1 if c.get("multi_query") else heads
    head_dim = (positive(c, "head_dim", where) if c.get("head_dim") is not None
                else positive(c, "hidden_size", where) // heads)
    return heads, kv_heads, head_dim


#: transformers' causal-LM class of each model type kvdoc builds or exports
CAUSAL_LM = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
             "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
             "gemma3_text": "Gemma3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
             "deepseek_v32": "DeepseekV32ForCausalLM", "gpt_oss": "GptOssForCausalLM",
             "qwen3_5_text": "Qwen3_5ForCausalLM", "bamba": "BambaForCausalLM"}


def _causal_lm(hf_config: Any) -> Any:
    """``hf_config``'s causal LM with fresh weights (imports that family's module alone)."""
    import transformers

    return getattr(transformers, CAUSAL_LM[hf_config.model_type])(hf_config)


def random_model(hf_config: Any, seed: int = 0, dtype: torch.dtype | None = None) -> Any:
    """transformers' causal LM of ``hf_config`` (a model type of :data:`CAUSAL_LM`) with
    weights drawn after ``torch.manual_seed(seed)``, built offline, in eval mode.

    >>> from kvdoc.core.gemma import Gemma3Config
    >>> from kvdoc.interop.hf_gemma import gemma_config
    >>> random_model(gemma_config(Gemma3Config())).config.layer_types
    ['sliding_attention', 'full_attention']
    """
    import torch

    torch.manual_seed(seed)
    return _causal_lm(hf_config).to(dtype or torch.float32).eval()


def gpt2_config(config: GPTConfig) -> Any:
    """The transformers ``GPT2Config`` of the same model: GELU-tanh, no dropout, untied head.

    >>> from transformers import GPT2LMHeadModel
    >>> from kvdoc import GPTConfig
    >>> hf = GPT2LMHeadModel(gpt2_config(GPTConfig()))
    >>> sum(p.numel() for p in hf.parameters())
    145280
    >>> config_from_transformers(hf.config) == GPTConfig()
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


# --- Llama, Mistral, Qwen2, Qwen3 and Phi-3 ---------------------------------------------------

def transformers_config(config: GPTConfig, family: str | None = None) -> Any:
    """The transformers config of the same model: GPT-2's for learned positions
    (:func:`gpt2_config`), else Qwen3's with q/k norms, Qwen2's with Q/K/V biases, Mistral's
    with a sliding window, Llama's without; ``family="phi3"``: Phi-3's (the same model, its
    projections fused).

    >>> from transformers import MistralForCausalLM
    >>> from kvdoc.core.model import llama_config
    >>> from kvdoc.core.model import mistral_config
    >>> hf = MistralForCausalLM(transformers_config(mistral_config()))
    >>> hf.config.sliding_window, config_from_transformers(hf.config) == mistral_config()
    (32, True)
    >>> transformers_config(llama_config(qk_norm=True, head_size=24)).model_type
    'qwen3'
    """
    if config.position == "learned":
        return gpt2_config(config)
    import transformers

    if (config.norm, config.mlp, config.bias) != ("rmsnorm", "swiglu", False):
        raise ValueError("Llama, Mistral, Qwen and Phi-3 use RMSNorm, a SwiGLU MLP and no "
                         "biases but Qwen2's on Q, K and V with RoPE")
    qwen = "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else None
    if config.qk_norm and config.qkv_bias:  # Qwen3's attention_bias also biases o_proj
        raise ValueError("no transformers family has q/k norms and Q/K/V biases alone")
    if (qwen or family == "phi3") and family not in (None, qwen or "phi3"):
        raise ValueError(f"this config is a {qwen or 'llama'} model's, not {family}'s")
    if qwen and config.sliding_window is not None:
        raise ValueError(f"kvdoc exports {qwen} without sliding windows")
    common = dict(
        **as_theirs(config), hidden_act="silu", head_dim=config.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if qwen:
        return getattr(transformers, qwen.title() + "Config")(use_sliding_window=False, **common)
    if family == "phi3":
        return transformers.Phi3Config(sliding_window=config.sliding_window, **common)
    if config.sliding_window is None:
        return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    return transformers.MistralConfig(sliding_window=config.sliding_window, **common)


def config_from_transformers(hf_config: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a transformers GPT-2 config or one of :data:`ROPE_FAMILIES`
    (an object or a parsed ``config.json``); a ValueError for another model type or a variant
    kvdoc lacks.

    >>> from kvdoc import GPTConfig
    >>> config_from_transformers({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64,
    ...                           "n_positions": 512, "vocab_size": 97}) == GPTConfig()
    True
    """
    from kvdoc.core.model import GPTConfig  # torch: only when a model config is built
    c = config_fields(hf_config, "config")
    model_type = c.get("model_type")
    if model_type not in ("gpt2", *ROPE_FAMILIES):
        raise ValueError(f"kvdoc loads gpt2, {', '.join(ROPE_FAMILIES)} models, "
                         f"not {model_type!r}")
    heads, kv_heads, head_dim = attention_sizes(c, model_type)
    hidden = positive(c, "hidden_size", model_type)
    if model_type == "gpt2":
        unsupported = {
            "activation_function": (c.get("activation_function", "gelu_new"),
                                    ("gelu_new", "gelu_pytorch_tanh")),
            "scale_attn_weights": (c.get("scale_attn_weights", True), (True,)),
            "scale_attn_by_inverse_layer_idx": (c.get("scale_attn_by_inverse_layer_idx", False),
                                                (False,)),
            "reorder_and_upcast_attn": (c.get("reorder_and_upcast_attn", False), (False,)),
        }
    else:
        rope = dict(c.get("rope_parameters") or {})
        unsupported = {
            "rope_type": (rope.get("rope_type", "default"), ("default",)),
            "partial_rotary_factor": (rope.get("partial_rotary_factor",
                                               c.get("partial_rotary_factor", 1.0)), (1.0,)),
            "hidden_act": (c.get("hidden_act"), ("silu",)),
            "attention_bias": (c.get("attention_bias", False), (False,)),
            "use_sliding_window": (c.get("use_sliding_window", False), (False,)),  # Qwen's
            "layer_types": (sorted(set(c.get("layer_types") or ["full_attention"])),
                            (["full_attention"],)),
            "mlp_bias": (c.get("mlp_bias", False), (False,)),
            "pretraining_tp": (c.get("pretraining_tp", 1) or 1, (1,)),
        }
    refuse_unsupported(model_type, unsupported)
    sizes = dict(vocab_size=positive(c, "vocab_size", model_type),
                 n_positions=positive(c, "max_position_embeddings", model_type),
                 n_layer=positive(c, "num_hidden_layers", model_type), n_head=heads,
                 n_embd=hidden)
    if model_type == "gpt2":
        return GPTConfig(**sizes, n_inner=c.get("n_inner") or 4 * hidden,
                         layer_norm_epsilon=c.get("layer_norm_epsilon", 1e-5))
    window = c.get("sliding_window") if model_type in ("mistral", "phi3") else None
    return GPTConfig(
        **sizes, n_inner=positive(c, "intermediate_size", model_type), n_kv_head=kv_heads,
        layer_norm_epsilon=c["rms_norm_eps"], position="rope",
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm="rmsnorm", mlp="swiglu",
        bias=False, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        sliding_window=window, head_size=None if head_dim == hidden // heads else head_dim,
        qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")


def transformers_model(family: str, config: GPTConfig | None = None, seed: int = 0,
                       dtype: torch.dtype | None = None) -> Any:
    """:func:`random_model` of the ``family`` model (``"gpt2"`` or one of
    :data:`ROPE_FAMILIES`) of ``config`` (default: the family's kvdoc default).

    >>> transformers_model("llama").config.num_key_value_heads
    2
    >>> transformers_model("qwen3").config.head_dim      # not hidden_size / heads = 16
    24
    """
    from kvdoc.core.model import GPTConfig, llama_config, mistral_config

    defaults = {"gpt2": GPTConfig, "llama": llama_config, "mistral": mistral_config,
                "qwen2": partial(llama_config, qkv_bias=True),
                "qwen3": partial(llama_config, qk_norm=True, head_size=24),
                "phi3": mistral_config}
    if family not in defaults:
        raise ValueError(f"family must be one of {', '.join(defaults)}, got {family!r}")
    hf_config = transformers_config(config or defaults[family](), family)
    if hf_config.model_type != family:
        raise ValueError(f"this config builds a {hf_config.model_type} model, not {family}")
    return random_model(hf_config, seed, dtype)


def outer_weights(state: Mapping[str, torch.Tensor],
                  outer: Mapping[str, str] = OUTER) -> dict[str, torch.Tensor]:
    """``outer``'s weights of a transformers state dict, under kvdoc's names (no head: tied to
    the embedding)."""
    wte = state["model.embed_tokens.weight"]
    return {ours: state.get(theirs, wte) for theirs, ours in outer.items()}


def by_our_names(state: Mapping[str, torch.Tensor], outer: Mapping[str, str] = OUTER,
                 renamed: tuple[str, str] | None = None) -> dict[str, torch.Tensor]:
    """A transformers state dict under kvdoc's names, for a decoder whose blocks keep
    transformers' names below ``h.`` (Gemma 3, gpt-oss, Qwen3.5, Bamba): :func:`outer_weights`
    and ``model.layers.i.x`` as ``h.i.x``; ``renamed`` is one ``(theirs, ours)`` module name
    inside a layer that differs (Bamba's ``feed_forward`` is kvdoc's ``mlp``)."""
    mapped = outer_weights(state, outer)
    mapped.update({_renamed("h." + k.removeprefix("model.layers."), renamed): v
                   for k, v in state.items() if k.startswith("model.layers.")})
    return mapped


def by_their_names(state: Mapping[str, torch.Tensor], outer: Mapping[str, str] = OUTER,
                   renamed: tuple[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`by_our_names`: ``outer``'s weights and ``h.i.x`` as
    ``model.layers.i.x``."""
    back = None if renamed is None else renamed[::-1]
    mapped = {theirs: state[ours] for theirs, ours in outer.items()}
    mapped.update({_renamed("model.layers." + k.removeprefix("h."), back): v
                   for k, v in state.items() if k.startswith("h.")})
    return mapped


def _renamed(name: str, renamed: tuple[str, str] | None) -> str:
    """``name`` with the module ``renamed[0]`` inside it read as ``renamed[1]``."""
    return name if renamed is None else name.replace(f".{renamed[0]}.", f".{renamed[1]}.")


def expect_model_type(hf_config: Any, model_type: str) -> None:
    """A ValueError unless ``hf_config`` is a ``model_type`` config."""
    found = getattr(hf_config, "model_type", None)
    if found != model_type:
        raise ValueError(f"expected a {model_type} config, got {found!r}")


def refuse_unsupported(model_type: str, unsupported: Mapping[str, tuple[Any, tuple]]) -> None:
    """A ValueError naming the first field of ``unsupported`` (name: ``(value, allowed)``)
    whose value kvdoc does not implement."""
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(f"{model_type} config has {name}={value!r}; kvdoc supports {allowed}")


def holding(model: torch.nn.Module, mapped: Mapping[str, torch.Tensor]) -> Any:
    """``model`` holding ``mapped`` (kvdoc's names), in their dtype, on their device, in eval
    mode."""
    wte = mapped["wte.weight"]
    model.to(wte.dtype).load_state_dict({k: v.contiguous() for k, v in mapped.items()})
    return model.to(wte.device).eval()


def load_exported(hf_config: Any, mapped: Mapping[str, torch.Tensor],
                  model: torch.nn.Module) -> Any:
    """transformers' causal LM of ``hf_config`` (built without touching the global RNG: its fresh
    weights are overwritten) holding ``mapped`` (its own parameter names), in ``model``'s dtype,
    in eval mode; a ``ValueError`` names any parameter (but the causal-mask buffers) that did
    not map."""
    import torch

    with torch.random.fork_rng():
        hf = _causal_lm(hf_config)
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in mapped.items()},
                                             strict=False)
    missing = [k for k in missing if not k.endswith(BUFFERS)]
    if missing or unexpected:
        raise ValueError(f"weights do not map onto {hf_config.model_type}: missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}")
    return hf.to(next(model.parameters()).dtype).eval()
