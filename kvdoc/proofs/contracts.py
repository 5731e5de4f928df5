"""The lossy caches' contracts, checked on the grid as the ``int8`` and ``fp8`` scenarios.

The int8 cache (:mod:`kvdoc.serving.quant`) and the FP8 cache (:mod:`kvdoc.serving.fp8`) are
lossy, so each is held to its contract, not to the FP32 tolerance: held rows (and, once set, an
FP8 cache's scales) never change after an append (bitwise); the scales are the stated ones (an
int8 row's its own ``max|x| / 127``); each value read back within half a step of what was
written (int8: a whole number of steps in ``[-127, 127]``; FP8: a number of the format times
its scale, within :func:`~kvdoc.serving.fp8.element_error_bound`, or its saturation); every
attention read within its derived bound of the same read over the exact K/V; its bytes as its
tensors. In the FP32 pass each runs again on the model rounded to BF16 and FP16
(:func:`half_step`). The FP8 cache runs in each of :data:`FP8_SETTINGS` (calibrated per-tensor
scales, which the checked stream can exceed, exercise saturation). What the contracts do not
say (logit error, greedy agreement) is measured, never asserted, in
:mod:`kvdoc.teach.lossy_caches`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvdoc.core.cache import CacheLayer, KVCache
from kvdoc.core.feed import feed
from kvdoc.core.model import GPTConfig
from kvdoc.measure.wrapper import LayerWrapper, unwrapped, wrap_layers
from kvdoc.serving import fp8 as fp8_cache
from kvdoc.serving.fp8 import amax_scale, calibrate, element_error_bound, new_fp8_cache
from kvdoc.serving.quant import new_int8_cache, read_error_bound

from .cache_invariants import byte_problems
from .case import Case, CheckResult, scenario
from .compare import DTYPE_NAMES, Snapshot, max_abs
from .precision import UNIT_ROUNDOFF

CHUNKS = (5, 1, 1, 9, 1)  # single tokens (the fast step) and chunks, both contracts
ROW_SLACK = 1e-3
"""Slack, in steps, of the element contract: the rounding of ``x / scale`` and ``q * scale``,
a few units in the last place of 127, is far below it."""


class Recorder(LayerWrapper):
    """Delegates to the layer under test and records the K/V each write was given: the last
    rows per layer (``written``), every row so far (``exact``) and, given ``scales``, the scales
    the layer states after it (an FP8 layer's)."""

    def __init__(self, inner: CacheLayer, index: int, written: dict, exact: dict,
                 scales: dict | None = None) -> None:
        super().__init__(inner, index)
        self.written, self.exact, self.scales = written, exact, scales

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int):
        i = self.index
        self.written[i] = (k.clone(), v.clone())
        old_k, old_v = self.exact.get(i, (k[:, :, :0], v[:, :, :0]))
        self.exact[i] = (torch.cat((old_k, k), dim=2), torch.cat((old_v, v), dim=2))
        out = self.inner.write(k, v, start)
        if self.scales is not None:
            self.scales[i] = tuple(s.clone() for s in self.inner.scales)
        return out


def recorded(cache: KVCache, written: dict, exact: dict, scales: dict | None = None) -> KVCache:
    """``cache``, each layer wrapped in a :class:`Recorder` writing into the dicts given."""
    return wrap_layers(cache, lambda layer, i: Recorder(layer, i, written, exact, scales))


def half_step(unit: float) -> float:
    """The element error, in steps of ``max|x| / 127``, of a model whose dtype rounds with unit
    ``unit`` (0 for FP32 and FP64): half a step of the stored scale (itself rounded), and the
    rounding of ``q * scale``, up to ``127.5`` steps, to the model's dtype.

    >>> half_step(0.0), round(half_step(2.0 ** -8), 4)   # FP32, BF16
    (0.5, 1.0019)
    """
    return (0.5 + 127.5 * unit) * (1 + unit)


def _row_problems(got: torch.Tensor, written: torch.Tensor, unit: float = 0.0) -> float:
    """The worst breach, in steps of a row's own scale, of: ``got`` within :func:`half_step` of
    ``written`` and (``unit`` 0: FP32 and FP64 hold every multiple of a step exactly) a whole
    number of steps in ``[-127, 127]``, the largest at 127."""
    amax = written.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    steps = got / scale
    worst = ((got - written).abs() / scale).amax().item() - half_step(unit) - ROW_SLACK
    if unit == 0.0:
        off_grid = (steps - steps.round()).abs().amax().item()
        beyond = max(0.0, steps.abs().amax().item() - 127)
        top = (127 - steps.abs().amax(dim=-1))[amax[..., 0] > 0]
        not_top = top.abs().amax().item() if top.numel() else 0.0
        worst = max(worst, off_grid - ROW_SLACK, beyond - ROW_SLACK, not_top - ROW_SLACK)
    worst = max(worst, 0.0)
    return math.inf if math.isnan(worst) else worst


@dataclass(frozen=True)
class Read:
    """One attention read over the lossy cache against the same read over the exact K/V: the
    largest error and bound, and ``excess``, the most an element's error passes its bound plus
    the two reads' rounding (``inf`` for shapes that disagree)."""

    layer: int
    start: int
    error: float
    bound: float
    excess: float


def judge(bound: Callable) -> Callable[..., Read]:
    """A judge for :func:`int8_reads`: each read against ``bound(layer, q, K, V)``."""
    def read(layer: int, attend, q, k, v, start, attn_mask, got, exact) -> Read:
        K, V = exact
        if K.shape != k.shape or V.shape != v.shape:
            return Read(layer, start, math.inf, 0.0, math.inf)
        want = attend(q, K, V, start, attn_mask)
        limit = bound(layer, q, K, V)
        # each read rounds: a weighted sum of T values and a score of D_h products
        slack = 2 * (K.shape[2] + q.shape[-1]) * torch.finfo(q.dtype).eps * float(V.abs().max())
        err = (got - want).abs().to(torch.float64)
        excess = float((err - limit - slack).amax().clamp(min=0)) if err.numel() else 0.0
        return Read(layer, start, max_abs(got, want), float(limit.max()) if limit.numel() else 0.0,
                    math.inf if math.isnan(excess) else excess)
    return read


def _int8_judge(unit: float = 0.0) -> Callable[..., Read]:
    return judge(lambda layer, q, K, V: read_error_bound(q, K, V, half_step(unit) + ROW_SLACK))


@contextmanager
def int8_reads(model: torch.nn.Module, exact: dict, judge=None) -> Iterator[list[Read]]:
    """Within the block, every ``attend`` of ``model``'s layers is also judged against the same
    read over ``exact`` (as a :class:`Recorder` collects it), its :class:`Read` appended to the
    list. A one-token step of the fast decoder does not call ``attend``."""
    judge = _int8_judge() if judge is None else judge
    reads: list[Read] = []
    patched = []
    for i, block in enumerate(getattr(model, "h", [])):
        attn, original = block.attn, block.attn.attend

        def attend(q, k, v, start, attn_mask=None, i=i, original=original):
            got = original(q, k, v, start, attn_mask)
            reads.append(judge(i, original, q, k, v, start, attn_mask, got, exact[i]))
            return got

        patched.append((attn, vars(attn).get("attend")))
        attn.attend = attend
    try:
        yield reads
    finally:
        for attn, own in patched:
            if own is None:
                del attn.attend
            else:
                attn.attend = own


def contract_run(case: Case, model: torch.nn.Module, call, cache: KVCache, judge,
                 rows: Callable) -> tuple:
    """Feed :data:`CHUNKS` of the stream through ``call`` over ``cache``, checking after each
    call held rows (bitwise), ``rows(start, n, after)`` (the worst breach of the new rows) and
    the byte figures: ``(changed, breach, excess, reads, problems)``; ``cache`` is
    :func:`recorded`."""
    changed, breach, problems = 0.0, 0.0, []
    held = [Snapshot.of(cache)]  # what the cache passed to the next call holds

    def check(start: int, n: int, before: KVCache, after: KVCache) -> None:
        nonlocal changed, breach
        # rows held before the call: bitwise the same in the cache passed in and the new one
        changed = max(changed, held[0].changed(before, start), held[0].changed(after, start))
        breach = max(breach, rows(start, n, after))
        problems.extend(f"after {start + n}: {p}" for p in byte_problems(unwrapped(after)))
        held[0] = Snapshot.of(after)

    with int8_reads(model, cache.layers[0].exact, judge) as reads:
        feed(call, case.ids[:, :sum(CHUNKS)], cache, CHUNKS, hook=check)
    return changed, breach, max((r.excess for r in reads), default=0.0), reads, problems


def verdict(reads: list[Read], problems: list[str], errors: tuple[float, ...],
            say: str) -> tuple[bool, float, str]:
    """``(passed, error, detail)`` of a contract run: passed if every one of ``errors`` (held
    rows, elements, ..., the reads' excess last) is 0, some attention read was judged and the
    byte figures are right; the detail is ``say`` and the reads, or the first byte problem."""
    missing = math.inf if problems or not reads else 0.0
    ratio = max((r.error / r.bound for r in reads if r.bound > 0), default=0.0)
    return (all(e == 0.0 for e in errors) and missing == 0.0, max(*errors, missing),
            problems[0] if problems else f"{say}; {len(reads)} attention reads, error at most "
            f"{ratio:.2f} of its bound, excess {errors[-1]:.1e}")


def lossy_results(case: Case, check: str, label: str, contract: Callable) -> list[CheckResult]:
    """``check`` of a lossy cache (``label``: int8, FP8) on the case's model and, in the FP32
    pass, on it rounded to BF16 and FP16: ``contract(model, call, dtype)`` gives a ``(passed,
    error, detail)`` per setting (``dtype`` None: the case's own). Such a cache holds a GPTConfig
    model's K/V and grows as a dynamic cache does, so it runs on that kind only."""
    if case.kind != "dynamic":
        return [case.result(check, None, 0.0, "run with the dynamic kind only")]
    if not isinstance(case.model.config, GPTConfig):
        return [case.result(check, None, 0.0, f"an {label} cache of a GPTConfig model's K/V")]
    runs = [(None, case.model, case.call)] + [(dtype, low, call)
                                              for _, dtype, low, call in case.rounded()]
    results = [(dt, case.result(check, *r)) for dt, model, call in runs
               for r in contract(model, call, dt)]
    return [dataclasses.replace(r, dtype=DTYPE_NAMES[dt]) if dt else r for dt, r in results]


@scenario("int8", {"int8": "int8 cache: held rows never change, each row's own scale, half a "
                           "step of error; every attention read within its derived bound of the "
                           "exact read"})
def _int8(case: Case, out: list) -> None:
    out += lossy_results(case, "int8", "int8", lambda model, call, dtype: [
        _int8_contract(case, model, call, 0.0 if dtype is None else UNIT_ROUNDOFF[dtype])])


def _int8_contract(case: Case, model: torch.nn.Module, call,
                   unit: float) -> tuple[bool, float, str]:
    """``(passed, error, detail)`` of the contract for ``model``'s cached ``call``."""
    new = case.caches.get("int8", new_int8_cache)
    written: dict = {}
    cache = recorded(new(model, case.ids.shape[0], case.ids.shape[1]), written, {})

    def rows(start: int, n: int, after: KVCache) -> float:
        return max(_row_problems(got[:, :, start:start + n].double(), wrote.double(), unit)
                   for i in range(after.n_layer)
                   for got, wrote in zip(after.layer(i), written[i], strict=True))

    changed, breach, excess, reads, problems = contract_run(case, model, call, cache,
                                                            _int8_judge(unit), rows)
    return verdict(reads, problems, (changed, breach, excess),
                   f"{sum(CHUNKS)} positions in {len(CHUNKS)} calls: held rows changed "
                   f"by {changed:.1e}, worst breach of the {half_step(unit):.3g}-step bound "
                   f"{breach:.1e}")


FP8_SETTINGS = (("per-head", False, "float8_e4m3fn"), ("per-tensor", True, "float8_e4m3fn"),
                ("per-tensor", True, "float8_e5m2"))
"""``(granularity, calibrated, storage)`` the scenario runs: both granularities, both sources,
both formats (e5m2's range past e4m3's 448 shows only there, and saturates only under
calibrated scales)."""


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


def _fp8_contract(case: Case, model: torch.nn.Module, call, granularity: str,
         calibrated: bool, storage: str) -> tuple[bool, float, str]:
    """``(passed, error, detail)`` of the contract for ``model``'s cached ``call``."""
    new = case.caches.get("fp8", new_fp8_cache)
    fed = sum(CHUNKS)
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

    bound = judge(lambda layer, q, K, V: fp8_cache.read_error_bound(q, K, V, *stated[layer],
                                                                    fp8))
    changed, breach, excess, reads, problems = contract_run(case, model, call, cache, bound, rows)
    source = "calibrated on another stream" if calibrated else "from the first prefill"
    return verdict(reads, problems, (changed, breach, scale_off, excess),
                   f"{storage}, {granularity} scales {source}; {fed} positions in "
                   f"{len(CHUNKS)} calls ({saturated} values saturated): held rows changed "
                   f"by {changed:.1e}, scales off by {scale_off:.1e}, worst breach of an "
                   f"element's bound {breach:.1e} (in scales)")


@scenario("fp8", {"fp8": "fp8 cache, e4m3 and e5m2: held rows and scales never change, values "
                         "FP8 times the stated scale within half a step (or their saturation); "
                         "every attention read within its derived bound"})
def _fp8(case: Case, out: list) -> None:
    # on a rounded model the element bound counts the model dtype's rounding
    out += lossy_results(case, "fp8", "FP8", lambda model, call, dtype: [
        _fp8_contract(case, model, call, *setting) for setting in FP8_SETTINGS])
