"""transformers' DeepSeek-V3.2 (dense layers) to and from kvdoc's
:class:`~kvdoc.core.indexed.IndexedDecoder`.

The names and the RoPE convention are DeepSeek-V3's (:mod:`kvdoc.interop.hf_deepseek`): the
attention's rotary rows move from interleaved pairs to kvdoc's half-split layout (transformers'
``DeepseekV32Attention`` always rotates interleaved); the indexer's own rotary part is half-split
in both, so its weights (``self_attn.indexer.*``) load as they are. Only dense models load: a
``"sparse"`` entry in ``mlp_layer_types`` (the MoE) is refused by name.

transformers breaks ties among the indexer's scores by ``torch.topk``, whose order depends on the
length of the row it ranks (:mod:`kvdoc.core.indexed` says where and why); :func:`earliest_ties`
runs it with kvdoc's rule instead, which is what its cached and full paths then both compute.

>>> from kvdoc.core.indexed import IndexedConfig
>>> from kvdoc.interop.hf_config import random_model
>>> hf = random_model(v32_config(IndexedConfig(index_topk=3)))
>>> ours = from_v32(hf)
>>> ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
>>> with earliest_ties():
...     torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvdoc.core.indexed import IndexedConfig, IndexedDecoder
from kvdoc.interop.hf_config import expect_model_type, holding, load_exported
from kvdoc.interop.hf_deepseek import (
    ATTENTION,
    dense_config,
    layers_by_our_names,
    layers_by_their_names,
    their_fields,
)
from kvdoc.interop.hf_float64 import patched

#: the indexer's sizes, named alike in both
_INDEXER = ("index_n_heads", "index_head_dim", "index_topk")

#: the attention's parameters (V3's and the indexer's), below ``self_attn.`` and ``attn.``
_ATTENTION = (*ATTENTION, *(f"indexer.{name}" for name in (
    "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")))


def v32_config(config: IndexedConfig) -> Any:
    """The transformers ``DeepseekV32Config`` of the same model: every layer dense.

    >>> hf_config = v32_config(IndexedConfig())
    >>> hf_config.mlp_layer_types, config_from_v32(hf_config) == IndexedConfig()
    (['dense', 'dense'], True)
    """
    from transformers import DeepseekV32Config

    return DeepseekV32Config(**their_fields(config, *_INDEXER),
                             mlp_layer_types=["dense"] * config.n_layer)


def config_from_v32(hf_config: Any) -> IndexedConfig:
    """The :class:`IndexedConfig` of a transformers ``DeepseekV32Config``; a ValueError naming
    the MoE layers, scaled RoPE, attention biases or another activation.

    >>> from transformers import DeepseekV32Config
    >>> config_from_v32(DeepseekV32Config(num_hidden_layers=4))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: DeepseekV32 layers [3] are mixture-of-experts ('sparse' in mlp_layer_types); ...
    """
    expect_model_type(hf_config, "deepseek_v32")
    sparse = [i for i, kind in enumerate(hf_config.mlp_layer_types) if kind != "dense"]
    if sparse:
        raise ValueError(f"DeepseekV32 layers {sparse} are mixture-of-experts ('sparse' in "
                         "mlp_layer_types); kvdoc loads dense layers only")
    return dense_config(hf_config, IndexedConfig, *_INDEXER)


def from_v32(hf_model: Any) -> IndexedDecoder:
    """An :class:`IndexedDecoder` with the weights of transformers' ``DeepseekV32ForCausalLM``
    (dense layers only), in the model's dtype, in eval mode."""
    config = config_from_v32(hf_model.config)
    mapped = layers_by_our_names(hf_model.state_dict(), config, _ATTENTION, interleaved=True)
    return holding(IndexedDecoder(config), mapped)


def to_v32(model: IndexedDecoder) -> Any:
    """transformers' ``DeepseekV32ForCausalLM`` holding ``model``'s weights, in its dtype, in eval
    mode; the global RNG is left as it was."""
    mapped = layers_by_their_names(dict(model.state_dict()), model.config, _ATTENTION,
                                   interleaved=True)
    return load_exported(v32_config(model.config), mapped, model)


def earliest_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                  sorted: bool = True) -> Any:
    """``torch.topk``'s result with ties to the earlier index (a stable sort), whatever the
    length of the dimension.

    >>> earliest_topk(torch.tensor([1., 0., 0., 0., 0.]), 2).indices
    tensor([0, 1])
    """
    if not largest:
        raise ValueError("earliest_topk ranks the largest values only")
    values, indices = self.sort(dim=dim, descending=True, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextmanager
def earliest_ties() -> Iterator[None]:
    """Within the block, ``Tensor.topk`` is :func:`earliest_topk`: transformers' indexer then
    breaks ties as kvdoc does. (Its dense layers call no other ``topk``.)"""
    with patched([(torch.Tensor, "topk", earliest_topk)]):
        yield
