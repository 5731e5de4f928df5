"""Weights between kvdoc and transformers: a transformers model loaded into a kvdoc decoder
(:func:`from_transformers`) and a decoder exported to the transformers model of its family
(:func:`to_transformers`).

GPT-2's ``c_attn``, ``c_proj`` and ``c_fc`` are ``Conv1D`` weights, ``[in, out]``, the
transpose of ``nn.Linear``'s; everything else maps by key once the ``transformer.`` prefix is
dropped. Llama's, Mistral's and Qwen's ``q_proj``, ``k_proj`` and ``v_proj`` (weights, and
Qwen2's biases) are stacked into ``c_attn``, ``gate_proj`` and ``up_proj`` into ``c_fc``; Phi-3
stores them stacked already (``qkv_proj``, ``gate_up_proj``). Qwen3's ``q_norm`` and ``k_norm``
keep their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvdoc.core.gemma import Gemma3Decoder
from kvdoc.core.gptoss import GptOssDecoder
from kvdoc.core.model import Decoder, GPTConfig

from .hf_config import (
    BUFFERS,
    NORMS_AND_DOWN,
    OUTER,
    ROPE_FAMILIES,
    config_from_transformers,
    holding,
    load_exported,
    outer_weights,
    transformers_config,
)
from .hf_deepseek import from_deepseek
from .hf_gemma import from_gemma, to_gemma
from .hf_gptoss import from_gptoss, to_gptoss

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")
"""GPT-2's weights stored as ``Conv1D`` (``[in, out]``, the transpose of ``nn.Linear``'s)."""
_LLAMA = {**NORMS_AND_DOWN, "self_attn.o_proj": "attn.c_proj", "self_attn.q_norm": "attn.q_norm",
          "self_attn.k_norm": "attn.k_norm"}  # the last two: Qwen3's alone
#: kvdoc's stacked matrices: transformers' parts, and Phi-3's one name for them
_STACKED = {"attn.c_attn": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            "self_attn.qkv_proj"),
            "mlp.c_fc": (("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_up_proj")}


def _decoder_holding(config: GPTConfig, mapped: Mapping[str, torch.Tensor],
                     family: str) -> Decoder:
    """A :class:`Decoder` of ``config`` holding ``mapped`` (kvdoc's names); a name or a shape the
    config does not expect is a ``ValueError``."""
    decoder = Decoder(config)
    expected = decoder.state_dict()
    missing = sorted(set(expected) - set(mapped))
    unexpected = sorted(set(mapped) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{family} weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, value in mapped.items():
        if value.shape != expected[name].shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)}, "
                             f"config expects {tuple(expected[name].shape)}")
    return holding(decoder, mapped)


def decoder_from_gpt2(model_or_state_dict: Any, config: GPTConfig | None = None) -> Decoder:
    """A :class:`Decoder` holding the weights of a ``GPT2LMHeadModel`` (or of its state dict,
    with the ``config`` the weights do not say: the head count), in their dtype and on their
    device, in eval mode.

    >>> from transformers import GPT2LMHeadModel
    >>> _ = torch.manual_seed(0)
    >>> from kvdoc.interop.hf_config import gpt2_config
    >>> hf = GPT2LMHeadModel(gpt2_config(GPTConfig())).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> ours = decoder_from_gpt2(hf)
    >>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
    True
    """
    if isinstance(model_or_state_dict, Mapping):
        state = model_or_state_dict
        if config is None:
            raise ValueError("a bare state dict does not say how many heads the model has: "
                             "pass config=")
    else:
        state = model_or_state_dict.state_dict()
        config = config or config_from_transformers(model_or_state_dict.config)
    if not state:
        raise ValueError("empty state dict")
    mapped: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key.removeprefix("transformer.")
        if name.endswith(BUFFERS):
            continue
        mapped[name] = value.t() if name.endswith(CONV1D_WEIGHTS) else value
    return _decoder_holding(config, mapped, "GPT-2")


def _llama_state(state: Mapping[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """Weights of a :data:`~kvdoc.interop.hf_config.ROPE_FAMILIES` model under kvdoc's GPT-2
    names: Q, K, V (and gate, up) stacked by rows; what the model lacks stays unmapped, for
    the caller to name."""
    mapped = outer_weights(state)
    for i in range(n_layer):
        src, dst = f"model.layers.{i}.", f"h.{i}."
        for theirs, ours in _LLAMA.items():
            if src + theirs + ".weight" in state:
                mapped[dst + ours + ".weight"] = state[src + theirs + ".weight"]
        for ours, (parts, whole) in _STACKED.items():
            for kind in (".weight", ".bias"):
                if src + whole + kind in state:  # Phi-3: stacked already
                    mapped[dst + ours + kind] = state[src + whole + kind]
                elif src + parts[0] + kind in state:
                    mapped[dst + ours + kind] = torch.cat([state[src + p + kind] for p in parts])
    return mapped


LOADS = ("gpt2", *ROPE_FAMILIES, "gemma3_text", "deepseek_v3", "gpt_oss")
"""The transformers ``model_type`` values :func:`from_transformers` loads."""


def from_transformers(hf_model: Any) -> Decoder:
    """A kvdoc decoder with the weights of a transformers model of any :data:`LOADS` type (a
    :class:`~kvdoc.core.gemma.Gemma3Decoder` for Gemma 3, an :class:`~kvdoc.core.mla.MLADecoder`
    for DeepSeek-V3), in the model's dtype, in eval mode: one entry point for every family kvdoc
    implements. A Mistral model's ``new_cache(batch)`` gives window layers
    (:func:`~kvdoc.core.window.window_cache`).

    >>> from transformers import LlamaForCausalLM
    >>> from kvdoc.core.model import llama_config
    >>> _ = torch.manual_seed(0)
    >>> hf = LlamaForCausalLM(transformers_config(llama_config())).eval()
    >>> ours = from_transformers(hf)
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
    True
    >>> from transformers import BertConfig, BertModel
    >>> from_transformers(BertModel(BertConfig(num_hidden_layers=1, hidden_size=32,
    ...     num_attention_heads=2, intermediate_size=37)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: kvdoc loads gpt2, llama, mistral, qwen2, qwen3, phi3, gemma3_text, deepseek_v3,
    gpt_oss models, not 'bert'
    """
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type == "gemma3_text":  # window and global layers: a decoder of its own
        return from_gemma(hf_model)
    if model_type == "deepseek_v3":  # a latent cache instead of K and V
        return from_deepseek(hf_model)
    if model_type == "gpt_oss":  # sinks and experts: a decoder of its own
        return from_gptoss(hf_model)
    if model_type not in LOADS:
        raise ValueError(f"kvdoc loads {', '.join(LOADS)} models, not {model_type!r}")
    config = config_from_transformers(hf_model.config)
    if config.position == "learned":
        return decoder_from_gpt2(hf_model, config)
    state = hf_model.state_dict()
    try:
        mapped = _llama_state(state, config.n_layer)
    except KeyError as missing:
        raise ValueError(f"{hf_model.config.model_type} weights lack {missing}") from None
    return _decoder_holding(config, mapped, model_type)


def to_transformers(model: Decoder, family: str | None = None) -> Any:
    """The transformers model of the same family (GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 3
    or gpt-oss; ``family="phi3"``: Phi-3, which computes what Llama or Mistral does) holding
    ``model``'s weights, in its dtype, in eval mode; the global RNG is left as it was. It is how
    :mod:`kvdoc.proofs.references` builds an implementation that shares no code with kvdoc.

    >>> from kvdoc.core.model import llama_config
    >>> _ = torch.manual_seed(0)
    >>> ours = Decoder(llama_config()).eval()
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> torch.allclose(to_transformers(ours)(ids).logits, ours(ids).logits, atol=1e-5)
    True
    """
    if isinstance(model, Gemma3Decoder):
        return to_gemma(model)
    if isinstance(model, GptOssDecoder):
        return to_gptoss(model)
    config, state = model.config, model.state_dict()
    hf_config = transformers_config(config, family)
    if hf_config.model_type == "gpt2":
        mapped = {("" if name.startswith("lm_head.") else "transformer.") + name:
                  (value.t() if name.endswith(CONV1D_WEIGHTS) else value)
                  for name, value in state.items()}
    else:
        kv = config.kv_dim
        rows = {"attn.c_attn": (config.n_head * config.head_dim, kv, kv),
                "mlp.c_fc": (config.n_inner, config.n_inner)}
        phi3 = hf_config.model_type == "phi3"  # its stacked matrices stay whole
        mapped = {theirs: state[ours] for theirs, ours in OUTER.items()}
        for i in range(config.n_layer):
            src, dst = f"h.{i}.", f"model.layers.{i}."
            mapped.update({dst + theirs + ".weight": state[src + ours + ".weight"]
                           for theirs, ours in _LLAMA.items() if src + ours + ".weight" in state})
            for ours, (parts, whole) in _STACKED.items():
                names = (whole,) if phi3 else parts
                sizes = (sum(rows[ours]),) if phi3 else rows[ours]
                for kind in (".weight", ".bias"):
                    if src + ours + kind in state:
                        pieces = state[src + ours + kind].split(sizes)
                        mapped.update(zip([dst + n + kind for n in names], pieces, strict=True))
    return load_exported(hf_config, mapped, model)
