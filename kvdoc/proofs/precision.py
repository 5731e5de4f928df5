"""The ``bf16`` and ``fp16`` checks: the cached path at production precision, in a derived bound.

The grid's other checks run in FP32 and FP64. Here the model's weights are rounded to BF16 (or
FP16) once; that model is the function under test, and its exact value is computed by the same
weights converted to FP64 (every rounded weight is exactly representable there), whose own
cached and full paths the FP64 pass shows agree to ``1e-10``. The BF16 model's full forward and
its cached path (chunks of each of :data:`CHUNKS`, through the dynamic cache and the case's
implementation: every model and implementation, in the FP32 pass) must each lie within
:func:`tolerance` of that FP64 value, everywhere.

**The tolerance, argued.** Rounding ``x`` to a format with unit roundoff ``u`` (``2**-8`` for
BF16, ``2**-11`` for FP16: half the gap between 1 and the next number) moves it by at most
``u |x|``. A decoder layer rounds its result in sequence at most :data:`ROUNDINGS_PER_LAYER`
times (norm, Q/K/V projection, RoPE, scores, softmax, attention output, output projection,
residual add; norm, up projection, activation, down projection, residual add: 12 counted
generously, the products inside one matmul accumulate in FP32 and round once), the final norm
and the LM head twice more. If no operation amplifies an error it receives (pre-norm residual
blocks of the sizes here keep each block at the scale of its input) and the errors do not
cancel, the logits are off by at most ``n u S`` with ``n = 12 L + 2`` roundings and ``S`` the
largest FP64 logit magnitude (at least 1). The assumption of no amplification is the argued
part; a model that amplifies errors fails this check, which then needs its gain, not a wider
number. Full and cached, each within ``n u S`` of the exact value, are within ``2 n u S`` of
each other, reported but not a separate check. The same formula with FP32's ``u = 2**-24``
gives at most ``2.3e-6 S`` on the grid's models (three layers at most), under its ``1e-5``.

>>> from kvdoc.proofs import grid
>>> m = grid.MODELS["mha"].build(0)
>>> round(tolerance(m.config, torch.bfloat16, 1.0), 4)  # 26 roundings of 2**-8
0.1016
>>> [(name, ok) for name, ok, *_ in precision_rows(m, grid.CACHES["dynamic"].new)]
[('BF16', True), ('FP16', True)]
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from kvdoc.core.feed import feed

from .case import scenario
from .compare import max_abs

ROUNDINGS_PER_LAYER = 12
"""Roundings of a layer's values in sequence, counted generously (see the module docstring)."""
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
"""Half the gap between 1 and the next number of each format (its ``eps / 2``)."""
CHECKS = {"bf16": "BF16 model: full and cached within n u max|logit| of its FP64 value",
          "fp16": "FP16 model: full and cached within n u max|logit| of its FP64 value",
          "bf16-reference": "transformers' model exported from the BF16 model: BF16 logits, "
                            "within n u max|logit| of the FP64 value",
          "fp16-reference": "transformers' model exported from the FP16 model: FP16 logits, "
                            "within n u max|logit| of the FP64 value"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHUNKS = (1, 7)
"""One token a call (the decode step) and a chunk that divides neither the stream nor a window."""
LENGTH = 24
"""Tokens of the stream: past the grid's window of 16 and a split-K chunk, and cheap."""


def tolerance(config: object, dtype: torch.dtype, scale: float) -> float:
    """``n u max(scale, 1)``: the argued bound on a logit's error (see the module docstring)."""
    roundings = ROUNDINGS_PER_LAYER * config.n_layer + 2
    return roundings * UNIT_ROUNDOFF[dtype] * max(scale, 1.0)


def _stream(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000)
    return torch.randint(0, model.config.vocab_size, (2, LENGTH), generator=g)


def _rounded(model: nn.Module, dt: torch.dtype, ids: torch.Tensor):
    """``model`` rounded to ``dt``, the FP64 logits of those weights, and the bound."""
    low = copy.deepcopy(model).to(dt).eval()
    want = copy.deepcopy(low).to(torch.float64)(ids).logits  # the rounded weights, exactly
    return low, want, tolerance(model.config, dt, want.abs().max().item())


def precision_rows(model: nn.Module, new_cache: Callable, call: Callable = lambda m: m,
                   ids: torch.Tensor | None = None) -> list[tuple]:
    """``(dtype, passed, worst error, tolerance, cached vs full)`` for BF16 and FP16.

    ``new_cache(model, batch, capacity)`` makes the cache (a kind of
    :data:`kvdoc.proofs.grid.CACHES`), ``call(model)`` the cached call (an implementation).
    """
    ids = _stream(model) if ids is None else ids
    rows = []
    for name, dt in DTYPES.items():
        low, want, tol = _rounded(model, dt, ids)
        full = low(ids).logits.to(torch.float64)
        step = call(low)
        cached = [feed(step, ids, new_cache(low, ids.shape[0], ids.shape[1]), chunk).logits
                  .to(torch.float64) for chunk in CHUNKS]
        worst = max(max_abs(got, want) for got in (full, *cached))
        apart = max(max_abs(got, full) for got in cached)
        rows.append((name.upper(), worst <= tol, worst, tol, apart))
    return rows


def reference_rows(model: nn.Module, reference: Callable) -> list[tuple]:
    """``(dtype, passed, error, tolerance, logits' dtype)`` of transformers' model exported from
    ``model`` rounded to BF16 and FP16 (``reference(model)(ids) -> logits``): its logits must
    come in that dtype (an export that computes in FP32 would be closer to the FP64 value, not
    further) and lie within :func:`tolerance` of the FP64 value of the rounded weights.

    >>> from kvdoc.proofs import grid
    >>> m = grid.MODELS["llama"].build(0)
    >>> [(name, ok, dtype) for name, ok, _, _, dtype in reference_rows(m, grid.MODELS["llama"]
    ...                                                                .reference)]
    [('BF16', True, torch.bfloat16), ('FP16', True, torch.float16)]
    """
    ids, rows = _stream(model), []
    for name, dt in DTYPES.items():
        low, want, tol = _rounded(model, dt, ids)
        got = reference(low)(ids)
        error = max_abs(got.to(torch.float64), want)
        rows.append((name.upper(), got.dtype == dt and error <= tol, error, tol, got.dtype))
    return rows


@scenario("bf16", CHECKS)
def _scenario(case, out: list) -> None:
    """The ``bf16``, ``fp16``, ``bf16-reference`` and ``fp16-reference`` checks on one
    combination (run in the FP32 pass only, the references once per model)."""
    if case.dtype != torch.float32 or case.kind != "dynamic":
        for name in CHECKS:
            out.append(case.result(name, None, 0.0, "the dynamic kind in the FP32 pass"))
        return
    reference = case.caches.get("reference", case.spec.reference)  # a variant's loader
    for name in DTYPES:
        if case.impl != "model" or reference is None:
            why = "no independent reference" if reference is None else "once per model"
            out.append(case.result(f"{name}-reference", None, 0.0, why))
    if case.impl == "model" and reference is not None:
        for (label, ok, error, tol, dtype), name in zip(reference_rows(case.fresh(), reference),
                                                        DTYPES, strict=True):
            detail = (f"logits {str(dtype).removeprefix('torch.')}, error {error:.3g} vs "
                      f"bound {tol:.3g}")
            out.append(dataclasses.replace(case.result(f"{name}-reference", ok, error, detail),
                                           dtype=label))
    new = case.caches.get(case.kind, case.cache.new)
    for (label, ok, worst, tol, apart), name in zip(
            precision_rows(case.fresh(), new, case.implementation), DTYPES, strict=True):
        detail = (f"largest error {worst:.3g} vs bound {tol:.3g}; cached vs full {apart:.3g}")
        out.append(dataclasses.replace(case.result(name, ok, worst, detail), dtype=label))
