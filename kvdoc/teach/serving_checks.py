"""The serving features of :mod:`kvdoc.serving` against recompute, for the pages: a left-padded
batch and a shared-prefix run against each request alone (the broken
:class:`~kvdoc.teach.broken_shown.UnshiftedPositionsDecoder` must fail the first), and how far
the int8 cache moves the logits and K/V (an approximation: measured, nothing claimed).

>>> from kvdoc.proofs.compare import default_model
>>> model = default_model()
>>> [(r.pad, r.passed) for r in compare_with_alone(model, [[5, 6, 7], [8]], max_new_tokens=4)]
[(0, True), (2, True)]
>>> from kvdoc.teach.broken_shown import unshifted_positions
>>> broken = unshifted_positions(model)
>>> [(r.pad, r.passed) for r in compare_with_alone(model, [[5, 6, 7], [8]], 4, under_test=broken)]
[(0, True), (2, False)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder, generate
from kvdoc.proofs.compare import DTYPE_NAMES, TOLERANCE, close, max_abs, run_cached
from kvdoc.serving.batching import generate_padded, left_pad
from kvdoc.serving.quant import new_int8_cache
from kvdoc.serving.workload import MixMemory, RequestMix


@dataclass(frozen=True)
class RowCheck:
    """One row of a padded batch (``length`` prompt tokens after ``pad`` pad slots) against its
    prompt generated alone: the largest logit difference, whether it is within
    :data:`kvdoc.proofs.compare.TOLERANCE`, whether the greedy tokens are the same."""

    length: int
    pad: int
    logit_error: float
    logits_close: bool
    same_tokens: bool

    @property
    def passed(self) -> bool:
        return self.logits_close and self.same_tokens


@torch.no_grad()
def compare_with_alone(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       under_test: Decoder | None = None) -> list[RowCheck]:
    """Generate ``prompts`` as one padded batch with ``under_test`` (default ``model``) and each
    alone with ``model`` (:func:`~kvdoc.core.model.generate`, the logits from one full forward);
    compare row by row."""
    batched = generate_padded(model if under_test is None else under_test, prompts, max_new_tokens)
    pad = left_pad(prompts).pad
    tol, device = TOLERANCE[model.wte.weight.dtype], model.wte.weight.device
    rows = []
    for b, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([list(prompt)], device=device), max_new_tokens)
        ref = model(alone[:, :-1]).logits[0, len(prompt) - 1:]  # [N, V]: logits behind each choice
        got = batched.logits[b]
        rows.append(RowCheck(len(prompt), int(pad[b]), max_abs(got, ref), close(got, ref, tol),
                             bool(torch.equal(batched.tokens[b], alone[0, len(prompt):]))))
    return rows


@torch.no_grad()
def compare_mix_with_alone(model: Decoder, mix: RequestMix,
                           memory: MixMemory) -> tuple[float, bool]:
    """``(max error, all within tolerance)`` of each request's shared-prefix logits
    (``memory.logits``) against one full forward of prefix + user + output alone."""
    tol, device = TOLERANCE[model.wte.weight.dtype], model.wte.weight.device
    err, ok = 0.0, len(memory.logits) == len(mix.users)
    # not strict: a memory with missing logits is reported by ``ok`` above, not raised
    for user, output, got in zip(mix.users, mix.outputs, memory.logits, strict=False):
        ids = torch.tensor([mix.prefix + user + output], device=device)
        alone = model(ids).logits[:, len(mix.prefix):]
        err, ok = max(err, max_abs(got, alone)), ok and close(got, alone, tol)
    return err, ok


@dataclass(frozen=True)
class Int8Row:
    """The int8 cache against one full forward, for one (batch, chunk, dtype): the largest logit
    difference beside the largest logit, the largest K/V difference from an exact cache (after
    layer 0 it includes the drift of the layer's inputs), and how many of the ``B * T``
    positions choose the same greedy token."""

    batch: int
    chunk: int
    dtype: str
    logit_error: float
    logit_scale: float
    kv_error: float
    agree: int
    positions: int


@torch.no_grad()
def measure_int8(model: Decoder, ids: torch.Tensor, batches: Sequence[int] = (1, 2),
                 chunks: Sequence[int] = (1, 2, 5)) -> list[Int8Row]:
    """Run ``ids`` through ``model`` with the int8 cache and with none, per batch and chunk size.

    The reference K/V are those of an exact dynamic cache fed the same chunks.
    """
    rows = []
    for b in batches:
        full = model(ids[:b]).logits
        for c in chunks:
            int8 = run_cached(model, ids[:b], c, cache=new_int8_cache(model, b))
            exact = run_cached(model, ids[:b], c).cache
            kv_err = max(max_abs(got, ref) for i in range(model.config.n_layer)
                         for got, ref in zip(int8.cache.layer(i), exact.layer(i), strict=True))
            rows.append(Int8Row(b, c, DTYPE_NAMES[model.wte.weight.dtype],
                                max_abs(int8.logits, full), float(full.abs().max()), kv_err,
                                int((int8.logits.argmax(-1) == full.argmax(-1)).sum()),
                                full.shape[0] * full.shape[1]))
    return rows
