"""Loading the weights of a Hugging Face transformers GPT-2 into :class:`kvdoc.Decoder`.

GPT-2's checkpoints store ``c_attn``, ``c_proj`` and ``c_fc`` as ``Conv1D`` weights of shape
``[in, out]``, the transpose of ``nn.Linear``'s ``[out, in]``; everything else maps by key
once the ``transformer.`` prefix is dropped. transformers is imported only when needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .config import GPTConfig
from .model import Decoder

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers some versions keep in the state dict


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
    """The :class:`GPTConfig` of a transformers ``GPT2Config``; raises if it uses a variant kvdoc lacks."""
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
        vocab_size=hf_config.vocab_size, n_positions=hf_config.n_positions, n_layer=hf_config.n_layer,
        n_head=hf_config.n_head, n_embd=hf_config.n_embd,
        n_inner=hf_config.n_inner or 4 * hf_config.n_embd, layer_norm_epsilon=hf_config.layer_norm_epsilon)


def decoder_from_gpt2(model_or_state_dict: Any, config: GPTConfig | None = None) -> Decoder:
    """A :class:`Decoder` holding the weights of a ``GPT2LMHeadModel`` (or of its state dict).

    Args:
        model_or_state_dict: a transformers ``GPT2LMHeadModel``, or its ``state_dict()``.
        config: required with a bare state dict (the head count is not in the weights);
            taken from ``model.config`` otherwise.

    Returns:
        A decoder in the dtype of the given weights, in eval mode.

    Raises:
        ValueError: a missing config, or keys or shapes that do not match the config.

    >>> from transformers import GPT2LMHeadModel
    >>> _ = torch.manual_seed(0)
    >>> hf = GPT2LMHeadModel(gpt2_config(GPTConfig())).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> ours = decoder_from_gpt2(hf)
    >>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
    True
    """
    if isinstance(model_or_state_dict, Mapping):
        state = model_or_state_dict
        if config is None:
            raise ValueError("a bare state dict does not say how many heads the model has: pass config=")
    else:
        state = model_or_state_dict.state_dict()
        config = config or config_from_gpt2(model_or_state_dict.config)
    if not state:
        raise ValueError("empty state dict")
    mapped: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key.removeprefix("transformer.")
        if name.endswith(_BUFFERS):
            continue
        mapped[name] = value.t() if name.endswith(_CONV1D) else value
    decoder = Decoder(config).to(next(iter(mapped.values())).dtype)
    expected = decoder.state_dict()
    missing = sorted(set(expected) - set(mapped))
    unexpected = sorted(set(mapped) - set(expected))
    if missing or unexpected:
        raise ValueError(f"GPT-2 weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, value in mapped.items():
        if value.shape != expected[name].shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)}, "
                             f"config expects {tuple(expected[name].shape)}")
    decoder.load_state_dict({k: v.contiguous() for k, v in mapped.items()})
    return decoder.eval()
