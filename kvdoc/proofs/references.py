"""Independent references: implementations that share no cache or attention-sharing code with
kvdoc, so they see a bug both the cached and the full path run: transformers' model of the same
family holding the same weights, and for a GQA or MQA model the MHA model whose every query head
has a copy of its group's K/V head. Each is ``ids -> logits``, built from a model's weights
(never its code), leaving the global RNG as it was.

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

from kvdoc.core.model import Decoder, GPTConfig

Reference = Callable[[torch.Tensor], torch.Tensor]


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def mha_weights(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The state dict of the MHA model equivalent to a GQA/MQA one: each K/V head's rows of
    ``c_attn`` copied over its group (query head ``h`` reads K/V head ``h // (H / H_kv)``)."""
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
    config = model.config
    mha_config = dataclasses.replace(config, n_kv_head=config.n_head)
    with torch.random.fork_rng():
        ref = Decoder(mha_config).to(_dtype(model)).eval()
    ref.load_state_dict(mha_weights(model.state_dict(), config))
    return lambda ids: ref(ids)[0]


def transformers_reference(model: nn.Module) -> Reference:
    from kvdoc.interop.hf_weights import to_transformers

    return hf_reference(to_transformers(model), model)


def deepseek_reference(model: nn.Module) -> Reference:
    # transformers' DeepSeek-V3 up-projects the latent in every call, however kvdoc attends
    from kvdoc.interop.hf_deepseek import to_deepseek

    return hf_reference(to_deepseek(model), model)


def bamba_reference(model: nn.Module) -> Reference:
    # transformers' Bamba: its own Mamba-2 scan and attention, the same weights
    from kvdoc.interop.hf_bamba import to_bamba

    return hf_reference(to_bamba(model), model)


def qwen35_reference(model: nn.Module) -> Reference:
    from kvdoc.interop.hf_qwen35 import to_qwen35

    return hf_reference(to_qwen35(model), model)


def deepseek_v32_reference(model: nn.Module) -> Reference:
    # transformers' DeepSeek-V3.2, its indexer's ties broken as kvdoc breaks them (earlier
    # position first): what its full forward computes where no scores tie
    from kvdoc.interop.hf_deepseek_v32 import earliest_ties, to_v32

    reference = hf_reference(to_v32(model), model)

    def tied(ids: torch.Tensor) -> torch.Tensor:
        with earliest_ties():
            return reference(ids)

    return tied


def v4_reference(model: nn.Module) -> Reference:
    """kvdoc's V4 decoder with transformers' ``DeepseekV4Attention`` in each block (its MoE and
    hyper-connections leave no whole model to compare), FP32 islands lifted in FP64."""
    from kvdoc.interop.hf_deepseek_v4 import float64_lifted, with_transformers_attention

    ref = with_transformers_attention(model)
    lift = float64_lifted if _dtype(model) == torch.float64 else contextlib.nullcontext

    def reference(ids: torch.Tensor) -> torch.Tensor:
        with lift():
            return ref(ids).logits

    return reference


def hf_reference(hf: nn.Module, model: nn.Module) -> Reference:
    """``ids -> logits`` of the transformers model ``hf``; for an FP64 ``model`` its FP32 islands
    (RMSNorm, rotary angles) lifted to FP64, so the FP64 tolerance applies."""
    from kvdoc.interop.hf_float64 import float64_islands_lifted

    lift = float64_islands_lifted if _dtype(model) == torch.float64 else contextlib.nullcontext

    def reference(ids: torch.Tensor) -> torch.Tensor:
        with lift(hf):
            return hf(ids).logits

    return reference
