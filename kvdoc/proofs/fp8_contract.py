"""The FP8 cache's contract, checked on the grid as the ``fp8`` scenario, and its error measured.

The FP8 cache (:mod:`kvdoc.serving.fp8`) is lossy, so, like the int8 cache, it is held to a
contract in each of :data:`SETTINGS` (per-tensor scales calibrated on another stream, which the
checked stream can exceed, so saturation is exercised; both storage formats, e4m3 and e5m2):
held rows and, once set, scales never change (bitwise); the scales are the stated ones; every
value read back is a number of the format times its scale, within
:func:`~kvdoc.serving.fp8.element_error_bound` of what was written; every attention read within
:func:`~kvdoc.serving.fp8.read_error_bound` of the exact read; its bytes as its tensors.
What the contract does not say (logit error, greedy agreement) is measured, never asserted, in
:mod:`kvdoc.teach.lossy_caches`.
"""

from __future__ import annotations

import math

import torch

from kvdoc.measure.wrapper import unwrapped
from kvdoc.serving.fp8 import (
    amax_scale,
    calibrate,
    element_error_bound,
    new_fp8_cache,
    read_error_bound,
)

from .case import Case, scenario
from .compare import max_abs
from .int8_contract import INT8_CHUNKS, contract_run, judge, lossy_results, recorded, verdict

FP8_CHUNKS = INT8_CHUNKS
SETTINGS = (("per-head", False, "float8_e4m3fn"), ("per-tensor", True, "float8_e4m3fn"),
            ("per-tensor", True, "float8_e5m2"))
"""``(granularity, calibrated, storage)`` the scenario runs: both granularities, both sources,
both formats (e5m2's range past e4m3's 448 shows only there, and saturates only under
calibrated scales)."""
CHECK = ("fp8 cache, e4m3 and e5m2: held rows and scales never change, values FP8 times the stated "
         "scale within half a step (or their saturation); every attention read within its "
         "derived bound")


def row_breach(got: torch.Tensor, written: torch.Tensor, scale: torch.Tensor,
               fp8: torch.dtype = torch.float8_e4m3fn) -> float:
    """The worst breach, in units of the scale, of: ``got / scale`` is an FP8 number, and ``got``
    is within :func:`~kvdoc.serving.fp8.element_error_bound` of ``written`` (``inf`` for NaN).

    >>> from kvdoc.serving.fp8 import dequantize, quantize
    >>> x, s = torch.tensor([[[[0.3, -2.0, 900.0]]]]), torch.ones(1, 1, 1, 1)
    >>> row_breach(dequantize(quantize(x, s), s, x.dtype), x, s), row_breach(x, x, s) > 0
    (0.0, True)
    """
    if got.numel() == 0:
        return 0.0
    y = got.to(torch.float64) / scale.to(torch.float64)
    # got = q * s rounded in the model's dtype: y is an FP8 number to a few units of it
    model = torch.finfo(got.dtype)  # its subnormals: an absolute step, not a relative one
    off_grid = ((y - y.to(fp8).to(torch.float64)).abs() - 4 * model.eps * y.abs()
                - model.smallest_normal * model.eps / scale.to(torch.float64))
    err = ((got.to(torch.float64) - written.to(torch.float64)).abs()
           - element_error_bound(written, scale, fp8)) / scale.to(torch.float64)
    worst = max(float(off_grid.amax()), float(err.amax()), 0.0)
    return math.inf if math.isnan(worst) else worst


def _one(case: Case, model: torch.nn.Module, call, granularity: str,
         calibrated: bool, storage: str) -> tuple[bool, float, str]:
    """``(passed, error, detail)`` of the contract for ``model``'s cached ``call``."""
    new = case.caches.get("fp8", new_fp8_cache)
    fed = sum(FP8_CHUNKS)
    given = calibrate(model, case.alt[:, :fed], granularity, storage) if calibrated else None
    written: dict = {}
    stated: dict = {}  # layer -> the scales it states after each update: the reads' bound
    cache = recorded(new(model, case.ids.shape[0], case.ids.shape[1], granularity=granularity,
                         scales=given, fp8=storage), written, {}, stated)
    first: dict = {}  # layer -> its scales as first set
    fp8 = cache.layers[0].inner.fp8
    if fp8 != getattr(torch, storage):
        return False, math.inf, f"asked for {storage}, the cache stores {fp8}"
    scale_off, saturated = 0.0, 0

    def rows(start: int, n: int, after) -> float:
        nonlocal scale_off, saturated
        breach = 0.0
        for i, layer in enumerate(unwrapped(after).layers):
            if i not in first:  # the scales the layer must keep: given, or of its first rows
                want = (given[i].reshape(2, *layer.scales[0].shape) if calibrated else
                        [amax_scale(x, granularity, fp8) for x in written[i]])
                first[i] = tuple(s.clone() for s in layer.scales)
                for s, w in zip(layer.scales, want, strict=True):
                    off = max_abs(s / w.to(s.dtype), torch.ones_like(s))  # FP32 rounding: 1e-7
                    scale_off = max(scale_off, off if off > 1e-6 else 0.0)
            for s, f in zip(layer.scales, first[i], strict=True):  # bitwise, once set
                if not torch.equal(s, f):
                    scale_off = max(scale_off, max_abs(s, f) if s.shape == f.shape else math.inf)
            for got, wrote, s in zip(after.layer(i), written[i], layer.scales, strict=True):
                breach = max(breach, row_breach(got[:, :, start:start + n], wrote, s, fp8))
                saturated += int((wrote.abs() > torch.finfo(fp8).max * s).sum())
        return breach

    bound = judge(lambda layer, q, K, V: read_error_bound(q, K, V, *stated[layer], fp8))
    changed, breach, excess, reads, problems = contract_run(case, model, call, cache, bound, rows)
    source = "calibrated on another stream" if calibrated else "from the first prefill"
    return verdict(reads, problems, (changed, breach, scale_off, excess),
                   f"{storage}, {granularity} scales {source}; {fed} positions in "
                   f"{len(FP8_CHUNKS)} calls ({saturated} values saturated): held rows changed "
                   f"by {changed:.1e}, scales off by {scale_off:.1e}, worst breach of an "
                   f"element's bound {breach:.1e} (in scales)")


@scenario("fp8", {"fp8": CHECK})
def _scenario(case: Case, out: list) -> None:
    # on a rounded model the element bound counts the model dtype's rounding
    out += lossy_results(case, "fp8", "FP8", lambda model, call, dtype: [
        _one(case, model, call, *setting) for setting in SETTINGS])
