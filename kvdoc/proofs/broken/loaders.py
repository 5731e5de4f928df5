"""Deliberately wrong layer layouts: exports to transformers, and a layout derived one layer
off, each visible only at a size or layout the grid chooses for it.

* :func:`deepseek_reference_uninverted`: the MLA exporter
  (:func:`kvdoc.interop.hf_deepseek.to_deepseek`) moves each head's rotary rows with the importer's
  permutation (interleaved to half-split: evens, then odds) instead of its inverse. For a rotary
  width of 4 that permutation, ``[0, 2, 1, 3]``, is its own inverse, so the bug is invisible
  there; from a width of 6 on (``[0, 2, 4, 1, 3, 5]``, whose inverse is ``[0, 3, 1, 4, 2, 5]``)
  it is not, which is why the grid's MLA models rotate 6 dimensions (:data:`kvdoc.proofs.grid.MLA`).
* :func:`transformers_reference_layers_by_name`: the export to transformers
  (:func:`kvdoc.interop.hf_weights.to_transformers`) puts kvdoc's blocks into transformers' layer
  list in the order of their names, ``h.0, h.1, h.10, h.11, h.2, ..``: the same order below 10
  layers, so only the grid's 12-layer model shows it (the trait ``deep``).
* :func:`transformers_reference_upcast`: the export hands a BF16 or FP16 model to transformers
  in FP32 (as CPU code often upcasts half precision, whose matmuls are slow there): its logits
  are then nearer the exact value, not further, so only a check of their dtype tells.
* :func:`gemma_pattern_one_off`: a Gemma model whose layer types come from
  ``sliding_window_pattern`` one layer off (``i % k`` for ``(i + 1) % k``), in the model and its
  hybrid cache alike, so that the two agree; only a reference whose layout transformers derives
  from the pattern itself (:func:`kvdoc.interop.hf_gemma.gemma_config`) tells.
* :func:`gemma_reference_pattern_only`: the export writes ``sliding_window_pattern`` and drops an
  explicit list of global layers: the same model wherever the layout is a pattern, so only the
  grid's global-first Gemma model shows it (the trait ``global-first``).

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

from collections.abc import Callable

import torch
from torch import nn

from kvdoc.core.gemma import GLOBAL, SLIDING, Gemma3Config, Gemma3Decoder
from kvdoc.interop import hf_deepseek as deepseek
from kvdoc.interop import hf_gemma as gemma

from .. import references
from .decoders import copy_as


def by_name(n: int) -> list[int]:
    """``0 .. n - 1`` in the order of their names: ``by_name(12)[:4] == [0, 1, 10, 11]``.

    >>> by_name(9) == list(range(9)), by_name(12)[:4]
    (True, [0, 1, 10, 11])
    """
    return sorted(range(n), key=str)


def transformers_reference_layers_by_name(model: nn.Module) -> Callable[[torch.Tensor],
                                                                          torch.Tensor]:
    """BROKEN: transformers' model holding ``model``'s weights with its decoder layers in the
    order of kvdoc's block names (:func:`by_name`); otherwise
    :func:`kvdoc.proofs.references.transformers_reference`."""
    from kvdoc.interop.hf_weights import to_transformers

    hf = to_transformers(model)
    body = hf.model if hasattr(hf, "model") else hf.transformer
    name = "layers" if hasattr(body, "layers") else "h"
    stack = getattr(body, name)
    setattr(body, name, nn.ModuleList([stack[i] for i in by_name(len(stack))]))
    return references.hf_reference(hf, model)


def transformers_reference_upcast(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """BROKEN: :func:`kvdoc.proofs.references.transformers_reference`, but a model narrower than
    FP32 is exported in FP32."""
    from kvdoc.interop.hf_weights import to_transformers

    hf = to_transformers(model)
    if next(hf.parameters()).dtype in (torch.bfloat16, torch.float16):
        hf = hf.float()  # BUG: the model's precision is not the reference's
    return references.hf_reference(hf, model)


def deepseek_reference_uninverted(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """BROKEN: transformers' DeepSeek-V3 loaded by an exporter whose rotary rows move the way
    the importer's do (not inverted); otherwise :func:`kvdoc.proofs.references.deepseek_reference`.
    """
    real = deepseek._move_rope

    def importer_order(state, config, prefix, interleaved_to_split):  # the bug: ignores it
        real(state, config, prefix, interleaved_to_split=True)

    return _exported_with(deepseek, "_move_rope", importer_order, deepseek.to_deepseek, model)


def _exported_with(module: object, name: str, bug: Callable, export: Callable,
                   model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference ``export`` makes of ``model`` while ``module.name`` is ``bug``; the module
    is restored before the reference is returned, so only this reference holds the bug."""
    real = getattr(module, name)
    setattr(module, name, bug)
    try:
        hf = export(model)
    finally:
        setattr(module, name, real)
    return references.hf_reference(hf, model)


class _OneOffConfig(Gemma3Config):
    """BROKEN: a :class:`~kvdoc.core.gemma.Gemma3Config` whose pattern starts one layer early."""

    @property
    def layer_types(self) -> tuple[str, ...]:
        k = self.sliding_window_pattern
        return tuple(SLIDING if i % k else GLOBAL for i in range(self.n_layer))


def gemma_pattern_one_off(model: Gemma3Decoder) -> Gemma3Decoder:
    """BROKEN: ``model`` (same weights, dtype, device) with its layer types derived one layer
    off: layer 0 global, then every ``k``-th after it.

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
    """BROKEN: transformers' Gemma 3 exported with ``sliding_window_pattern`` only, an explicit
    ``global_layers`` dropped; otherwise :func:`kvdoc.proofs.references.transformers_reference`.
    """
    def pattern_only(config):  # the bug: a layer list never reaches transformers
        return {"sliding_window_pattern": config.sliding_window_pattern}

    return _exported_with(gemma, "_layout", pattern_only, gemma.to_gemma, model)
