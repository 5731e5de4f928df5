"""A deliberately wrong export to transformers, visible only at a size the grid chooses for it.

* :func:`deepseek_reference_uninverted`: the MLA exporter
  (:func:`kvdoc.interop.deepseek.to_deepseek`) moves each head's rotary rows with the importer's
  permutation (interleaved to half-split: evens, then odds) instead of its inverse. For a rotary
  width of 4 that permutation, ``[0, 2, 1, 3]``, is its own inverse, so the bug is invisible
  there; from a width of 6 on (``[0, 2, 4, 1, 3, 5]``, whose inverse is ``[0, 3, 1, 4, 2, 5]``)
  it is not, which is why the grid's MLA models rotate 6 dimensions (:data:`kvdoc.proofs.grid.MLA`).
* :func:`transformers_reference_layers_by_name`: the export to transformers
  (:func:`kvdoc.interop.hf_weights.to_transformers`) puts kvdoc's blocks into transformers' layer
  list in the order of their names, ``h.0, h.1, h.10, h.11, h.2, ..``: the same order below 10
  layers, so only the grid's 12-layer model shows it (the trait ``deep``).

>>> from kvdoc.interop.deepseek import _rope_rows
>>> from kvdoc.proofs import grid
>>> import dataclasses
>>> def self_inverse(d_r):
...     c = dataclasses.replace(grid.MLA, qk_rope_head_dim=d_r)
...     return torch.equal(_rope_rows(c, True)[1], _rope_rows(c, False)[1])
>>> self_inverse(4), self_inverse(grid.MLA.qk_rope_head_dim)
(True, False)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvdoc.interop import deepseek

from .. import references


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
    return references._lifted(hf, model)


def deepseek_reference_uninverted(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """BROKEN: transformers' DeepSeek-V3 loaded by an exporter whose rotary rows move the way
    the importer's do (not inverted); otherwise :func:`kvdoc.proofs.references.deepseek_reference`.
    """
    real = deepseek._move_rope

    def importer_order(state, config, prefix, interleaved_to_split):  # the bug: ignores it
        real(state, config, prefix, interleaved_to_split=True)

    deepseek._move_rope = importer_order
    try:
        hf = deepseek.to_deepseek(model)
    finally:
        deepseek._move_rope = real
    return references._lifted(hf, model)
