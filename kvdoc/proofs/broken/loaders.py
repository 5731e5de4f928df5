"""Deliberately wrong layer layouts, each visible only at a size or layout the grid chooses for it:
the DeepSeek exporter's rotary permutation is its own inverse at a rotary width of 4, not at
the grid's 6 (:data:`kvdoc.proofs.grid.MLA`); layers ordered by name differ from layers by
number from 11 layers on (the trait ``deep``); a Gemma pattern one layer off, or a pattern
exported without the list of global layers, shows only where the layout is no pattern; an
importer that reads RoPE's base from a key transformers 5 no longer writes.

>>> from kvdoc.interop.hf_deepseek import rope_rows
>>> from kvdoc.proofs import grid
>>> import dataclasses
>>> def self_inverse(d_r):
...     c = dataclasses.replace(grid.MLA, qk_rope_head_dim=d_r)
...     return torch.equal(rope_rows(c, True)[1], rope_rows(c, False)[1])
>>> self_inverse(4), self_inverse(grid.MLA.qk_rope_head_dim)
(True, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from kvdoc.core.frame import GLOBAL, SLIDING
from kvdoc.core.gemma import Gemma3Config, Gemma3Decoder
from kvdoc.interop import hf_deepseek as deepseek
from kvdoc.interop import hf_gemma as gemma

from .. import references
from .decoders import copy_as


def by_name(n: int) -> list[int]:
    """``0 .. n - 1`` in the order of their names.

    >>> by_name(9) == list(range(9)), by_name(12)[:4]
    (True, [0, 1, 10, 11])
    """
    return sorted(range(n), key=str)


def transformers_reference_layers_by_name(model: nn.Module) -> Callable[[torch.Tensor],
                                                                          torch.Tensor]:
    """BROKEN: the transformers reference, its layers in the order of their names."""
    from kvdoc.interop.hf_weights import to_transformers

    hf = to_transformers(model)
    body = hf.model if hasattr(hf, "model") else hf.transformer
    name = "layers" if hasattr(body, "layers") else "h"
    stack = getattr(body, name)
    setattr(body, name, nn.ModuleList([stack[i] for i in by_name(len(stack))]))
    return references.hf_reference(hf, model)


def transformers_reference_upcast(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """BROKEN: a model narrower than FP32 exported in FP32: only the logits' dtype tells."""
    from kvdoc.interop.hf_weights import to_transformers

    hf = to_transformers(model)
    if next(hf.parameters()).dtype in (torch.bfloat16, torch.float16):
        hf = hf.float()  # BUG: the model's precision is not the reference's
    return references.hf_reference(hf, model)


def deepseek_reference_uninverted(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """BROKEN: the DeepSeek-V3 reference exported with the importer's rotary permutation."""
    real = deepseek._move_rope

    def importer_order(state, config, prefix, interleaved_to_split):  # the bug: ignores it
        real(state, config, prefix, interleaved_to_split=True)

    return _exported_with(deepseek, "_move_rope", importer_order, deepseek.to_deepseek, model)


def _exported_with(module: object, name: str, bug: Callable, export: Callable,
                   model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference ``export`` makes of ``model`` while ``module.name`` is ``bug`` (restored
    before it returns, so only this reference holds the bug)."""
    real = getattr(module, name)
    setattr(module, name, bug)
    try:
        hf = export(model)
    finally:
        setattr(module, name, real)
    return references.hf_reference(hf, model)


class _OneOffConfig(Gemma3Config):
    """BROKEN: a Gemma 3 config whose pattern starts one layer early."""

    @property
    def layer_types(self) -> tuple[str, ...]:
        k = self.sliding_window_pattern
        return tuple(SLIDING if i % k else GLOBAL for i in range(self.n_layer))


def gemma_pattern_one_off(model: Gemma3Decoder) -> Gemma3Decoder:
    """BROKEN: ``model`` with its layer types one layer off: layer 0 global, then every ``k``-th.

    >>> from kvdoc.core.gemma import Gemma3Config
    >>> broken = gemma_pattern_one_off(Gemma3Decoder(Gemma3Config(n_layer=3,
    ...                                                           sliding_window_pattern=3)))
    >>> [layer.self_attn.window is None for layer in broken.h]
    [True, False, False]
    """
    c = model.config
    config = _OneOffConfig(**{name: getattr(c, name) for name in Gemma3Config.__dataclass_fields__})
    return copy_as(model, Gemma3Decoder, config)


def gemma_reference_pattern_only(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """BROKEN: the Gemma 3 reference exported with the pattern only, ``global_layers`` dropped."""
    def pattern_only(config):  # the bug: a layer list never reaches transformers
        return {"sliding_window_pattern": config.sliding_window_pattern}

    return _exported_with(gemma, "_layout", pattern_only, gemma.to_gemma, model)


def import_top_level_rope_theta(hf: nn.Module) -> nn.Module:
    """BROKEN: :func:`~kvdoc.interop.hf_weights.from_transformers` reading RoPE's base from
    transformers 4's top-level ``rope_theta`` (default 10000), not ``rope_parameters``."""
    from kvdoc.interop.hf_weights import from_transformers

    model = from_transformers(hf)
    theta = float(hf.config.to_dict().get("rope_theta", 10000.0))  # BUG: not rope_parameters
    if getattr(model.config, "rope_theta", None) in (None, theta):
        return model
    broken = type(model)(dataclasses.replace(model.config, rope_theta=theta))
    broken.load_state_dict(model.state_dict())
    return broken.to(model.wte.weight.dtype).eval()
