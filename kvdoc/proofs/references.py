"""Independent references: implementations that share no cache or attention-sharing code with kvdoc.

Cached-versus-full cannot see a bug in code that both paths run (positions clamped in every
forward, K/V heads shared wrongly by every attention call). These references can:

* :func:`transformers_reference`: Hugging Face transformers' GPT-2, Llama or Mistral holding
  the same weights (:func:`kvdoc.interop.hf_weights.to_transformers`);
* :func:`deepseek_reference`: transformers' DeepSeek-V3 holding an MLA model's weights
  (:func:`kvdoc.interop.hf_deepseek.to_deepseek`, interleaved rotary pairs as DeepSeek stores them);
* :func:`mha_reference`: for a grouped-query (GQA) or multi-query (MQA) model, the multi-head
  model whose K/V projection of each query head is a copy of the K/V head of its group. The
  two compute the same function, but the MHA model never shares a K/V head.

Each returns a function ``ids [B, T] -> logits [B, T, V]`` and is built from a model's weights
(its ``state_dict``), never from its code. Building leaves the global RNG as it was.

>>> import torch
>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> gqa = Decoder(GPTConfig(n_kv_head=2)).eval()
>>> ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
>>> with torch.no_grad():
...     err = (mha_reference(gqa)(ids) - gqa(ids).logits).abs().max().item()
>>> err < 1e-5
True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from kvdoc.core.model import GPTConfig
from kvdoc.core.model import Decoder

Reference = Callable[[torch.Tensor], torch.Tensor]
"""``ids [B, T] -> logits [B, T, V]``."""


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def mha_weights(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The state dict of the MHA model equivalent to a GQA/MQA one: each K/V head copied over
    its group.

    ``c_attn``'s output rows are ``H`` query heads, then ``H_kv`` key heads, then ``H_kv`` value
    heads, each ``D_h`` rows; query head ``h`` reads K/V head ``h // (H / H_kv)``.
    """
    d, kv, dh = config.n_embd, config.kv_dim, config.head_dim
    group = config.n_head // config.n_kv_head

    def grow(t: torch.Tensor) -> torch.Tensor:  # [H_kv * D_h, ...] -> [H * D_h, ...]
        rest = t.shape[1:]
        per_head = t.reshape(config.n_kv_head, dh, *rest)  # [H_kv, D_h, ...]
        return per_head.repeat_interleave(group, dim=0).reshape(d, *rest)

    out = dict(state)
    for name, value in state.items():
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            q, k, v = value.split((d, kv, kv), dim=0)
            out[name] = torch.cat((q, grow(k), grow(v)), dim=0)
    return out


def mha_reference(model: nn.Module) -> Reference:
    """The multi-head model with ``model``'s weights, K/V heads copied over each group."""
    config = model.config
    mha_config = dataclasses.replace(config, n_kv_head=config.n_head)
    with torch.random.fork_rng():
        ref = Decoder(mha_config).to(_dtype(model)).eval()
    ref.load_state_dict(mha_weights(model.state_dict(), config))
    return lambda ids: ref(ids)[0]


def transformers_reference(model: nn.Module) -> Reference:
    """transformers' model of the same family (GPT-2, Llama or Mistral) holding ``model``'s weights.

    In FP64, transformers' Llama and Mistral would still compute RMSNorm and the rotary angles in
    FP32; there :func:`kvdoc.interop.hf_float64.float64_islands_lifted` makes them follow the
    model's dtype, so the comparison can use the FP64 tolerance. In FP32 transformers runs as
    shipped.
    """
    from kvdoc.interop.hf_weights import to_transformers

    return hf_reference(to_transformers(model), model)


def deepseek_reference(model: nn.Module) -> Reference:
    """transformers' DeepSeek-V3 holding an :class:`~kvdoc.core.mla.MLADecoder`'s weights.

    Its attention up-projects the latent to K and V in every call, whichever way the kvdoc model
    attends; in FP64 its RMSNorm and rotary angles are lifted to FP64 as for Llama.
    """
    from kvdoc.interop.hf_deepseek import to_deepseek

    return hf_reference(to_deepseek(model), model)


def hf_reference(hf: nn.Module, model: nn.Module) -> Reference:
    """``ids -> logits`` of the transformers model ``hf``, its FP32 islands lifted to FP64 when
    ``model`` is FP64."""
    from kvdoc.interop.hf_float64 import float64_islands_lifted

    lift = float64_islands_lifted if _dtype(model) == torch.float64 else contextlib.nullcontext

    def reference(ids: torch.Tensor) -> torch.Tensor:
        with lift(hf):
            return hf(ids).logits

    return reference
