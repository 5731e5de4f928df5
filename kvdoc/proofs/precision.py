"""The ``bf16`` and ``fp16`` checks: the cached path at production precision, in a derived bound;
the batch-invariant mode against the function outside it.

The model's weights rounded to BF16 (or FP16) are the function under test; its exact value is the
same weights in FP64 (each rounded weight is exact there). Its full forward and its cached path
(chunks of each of :data:`CHUNKS`, the dynamic cache, the case's implementation) must each lie
within :func:`tolerance` of that value, everywhere.

**The tolerance, argued.** Rounding to unit roundoff ``u`` (``2**-8`` BF16, ``2**-11`` FP16)
moves ``x`` by at most ``u |x|``. A layer rounds its values in sequence at most
:data:`ROUNDINGS_PER_LAYER` times (norm, Q/K/V, RoPE, scores, softmax, attention output,
projection, residual; norm, up, activation, down, residual: 12 counted generously, a matmul's
products accumulating in FP32 and rounding once), the final norm and LM head twice more. If no
operation amplifies an error it receives (pre-norm residual blocks of these sizes keep each block
at its input's scale) and errors do not cancel, the logits are off by at most ``n u S``, ``n =
12 L + 2``, ``S`` the largest FP64 logit magnitude (at least 1). No amplification is the argued
part: a model that amplifies fails, and then needs its gain, not a wider number. Full and cached
are within ``2 n u S`` of each other (reported, not checked). FP32's ``u = 2**-24`` gives at most
``2.3e-6 S`` on the grid's models, under its ``1e-5``.

**The batch-invariant mode** (the ``invariant`` scenario). Under
:func:`kvdoc.core.invariant.batch_invariant` the calls must agree bit for bit whatever the
chunking and the batch (``invariant_bits``, the self-consistency the mode promises), and those
bits must be the function computed outside the mode (``invariant``): the full forward, the
cached path in chunks and a left-padded batch, each within the dtype's tolerance of the full
forward outside the mode. A mode that computes a wrong function the same way on every path (a
query head reading another group's K/V head, an FP64 model attended in FP32) passes the first
and fails the second. It runs once per model and dtype (the dynamic cache, the model's own
call): the mode changes how a call reduces, not what a cache kind stores.

>>> from kvdoc.proofs import grid
>>> m = grid.MODELS["mha"].build(0)
>>> round(tolerance(m.config, torch.bfloat16, 1.0), 4)  # 26 roundings of 2**-8
0.1016
>>> [(name, ok) for name, ok, *_ in precision_rows(m, grid.CACHES["dynamic"].new)]
[('BF16', True), ('FP16', True)]
>>> from kvdoc.proofs.suite import run_suite
>>> report = run_suite(models=("gqa",), kinds=("dynamic",), impls=("model",),
...                    dtypes=(torch.float64,), scenarios=("invariant",))
>>> report.passed, [r.check for r in report.results]
(True, ['invariant', 'invariant_bits'])
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from kvdoc.core.feed import feed
from kvdoc.core.invariant import batch_invariant

from .cache_invariants import padded_run
from .case import Case, scenario
from .compare import max_abs

MODE_LENGTH = 24
"""Tokens of the stream the mode runs: past the grid's window (16) and a split-K chunk (5); the
mode's attention is a loop over keys, so a long stream only costs."""
MODE_CHUNK = 5
"""The cached path's chunk: divides neither the stream nor the window."""


@scenario("invariant", {
    "invariant": "batch_invariant(): full, cached in chunks and a left-padded batch vs the "
                 "full forward outside the mode",
    "invariant_bits": "batch_invariant(): row 0 alone, in the batch, cached in chunks and "
                      "one token a call, bitwise"})
def _invariant(case: Case, out: list) -> None:
    if case.impl != "model" or case.kind != "dynamic":
        out.append(case.result("invariant", None, 0.0, "run once per model: the dynamic cache, "
                               "the model's own call"))
        return
    ids = case.ids[:, :MODE_LENGTH]
    want = case.full(ids)  # outside the mode: the function
    with batch_invariant():
        full = case.full(ids)
        alone = case.full(ids[:1])
        cached = case.feed(ids, MODE_CHUNK).logits
        stepped = case.feed(ids[:1], 1).logits  # one token a call
        padded, rows, lengths, length_ok = (padded_run(case) if ids.shape[0] > 1
                                            else ([], [], [], True))
    solo = [case.full(r[None]) for r in rows]  # outside the mode again
    pairs = [(full, want), (cached, want), *zip(padded, solo, strict=True)]
    out.append(case.compared("invariant", pairs, f"{MODE_LENGTH} tokens, full and in chunks of "
                             f"{MODE_CHUNK}; prompts of {lengths} tokens left-padded, then decode "
                             "steps", length_ok))
    # MLA's absorbed cached calls attend in latent space, another order than its full forward:
    # there, cached runs agree with one another only
    same = [(full[:1], alone), (cached[:1], stepped)]
    same += [] if getattr(case.model.config, "absorb", False) else [(stepped, alone)]
    bits = all(g.shape == w.shape and torch.equal(g, w) for g, w in same)
    out.append(case.result("invariant_bits", bits, max(max_abs(g, w) for g, w in same),
                           f"row 0 alone, in a batch of {ids.shape[0]}, in chunks of {MODE_CHUNK} "
                           "and of 1"))


ROUNDINGS_PER_LAYER = 12
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
"""The decode step, and a chunk that divides neither the stream nor a window."""
LENGTH = 24
"""Past the grid's window of 16 and a split-K chunk, and cheap."""


def tolerance(config: object, dtype: torch.dtype, scale: float) -> float:
    """``n u max(scale, 1)``: the argued bound on a logit's error."""
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
    """``(dtype, passed, worst error, tolerance, cached vs full)`` for BF16 and FP16, the cache
    from ``new_cache(model, batch, capacity)``, the cached call ``call(model)``."""
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
    """``(dtype, passed, error, tolerance, logits' dtype)`` of the reference exported from
    ``model`` rounded to BF16 and FP16: logits in that dtype (an export computing in FP32 would
    be nearer the FP64 value, not further), within :func:`tolerance` of it.

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
    config = case.model.config
    routed = getattr(config, "experts_per_token", 0) < getattr(config, "n_experts", 0)
    if routed or case.dtype != torch.float32 or case.kind != "dynamic":
        # a router's top-k is discontinuous: one rounding can pick another expert
        why = ("experts picked by a router: a rounding can pick another expert, so no rounding "
               "bound holds" if routed else "the dynamic kind in the FP32 pass")
        out += [case.result(name, None, 0.0, why) for name in CHECKS]
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
