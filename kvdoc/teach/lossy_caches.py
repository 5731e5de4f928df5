"""Lossy caches measured on the pages, never asserted (the grid's checks of their contracts are
:mod:`kvdoc.proofs.contracts`): every attention read of
an int8 cache against the exact read, and the FP8 cache's logit error and greedy agreement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.cache import DynamicCache
from kvdoc.measure.divergence import Divergence, divergence, greedy_with_gaps
from kvdoc.proofs.compare import max_abs, run_cached
from kvdoc.proofs.contracts import Read, int8_reads, recorded
from kvdoc.serving.fp8 import calibrate, new_fp8_cache
from kvdoc.serving.quant import new_int8_cache


@torch.no_grad()
def check_int8_reads(model: torch.nn.Module, ids: torch.Tensor, chunk: int) -> list[Read]:
    """Every attention read of ``ids`` fed in chunks over an int8 cache, against the exact one.

    >>> from kvdoc.proofs.compare import default_model, default_stream
    >>> reads = check_int8_reads(default_model(), default_stream(length=8), 3)
    >>> len(reads), max(r.excess for r in reads)   # 2 layers x 3 calls; every bound holds
    (6, 0.0)
    """
    exact: dict = {}
    with int8_reads(model, exact) as reads:
        run_cached(model, ids, chunk, cache=recorded(new_int8_cache(model, ids.shape[0]), {},
                                                     exact))
    return reads



@dataclass(frozen=True)
class Fp8Row:
    """The FP8 cache against one full forward, teacher-forced: the largest logit error and logit,
    positions whose argmax agrees, K/V values beyond ``448 s`` of the final scales."""

    granularity: str
    source: str
    logit_error: float
    logit_scale: float
    agree: int
    positions: int
    saturated: int
    values: int


@torch.no_grad()
def measure_fp8(model: torch.nn.Module, ids: torch.Tensor, calibration: torch.Tensor,
                chunk: int = 1, prefill: int = 8) -> list[Fp8Row]:
    """``ids`` (``[B, T]``) through ``model`` over an FP8 cache, each granularity and scale source
    (scales calibrated on ``calibration``, ``[B', T']``), against one full forward: a prefill
    of ``prefill`` tokens, then chunks of ``chunk``.

    >>> from kvdoc.proofs.compare import default_model, default_stream
    >>> rows = measure_fp8(default_model(), default_stream(), default_stream(seed=2))
    >>> [(r.granularity, r.source, r.positions) for r in rows][:2]
    [('per-tensor', 'first prefill', 48), ('per-tensor', 'calibrated', 48)]
    """
    weight = model.wte.weight
    full, exact = model(ids, DynamicCache.empty(model.config, ids.shape[0], weight.dtype,
                                                weight.device))
    rows = []
    for granularity in ("per-tensor", "per-head"):
        for source, scales in (("first prefill", None),
                               ("calibrated", calibrate(model, calibration, granularity))):
            cache = new_fp8_cache(model, ids.shape[0], granularity=granularity, scales=scales)
            first, cache = model(ids[:, :prefill], cache)
            rest = run_cached(model, ids[:, prefill:], chunk, cache=cache).logits
            got = torch.cat((first, rest), dim=1)
            fmax = torch.finfo(cache.layers[0].fp8).max
            beyond = [int((x.abs() > fmax * s).sum()) for i, layer in enumerate(cache.layers)
                      for x, s in zip(exact.layer(i), layer.scales, strict=True)]
            rows.append(Fp8Row(granularity, source, max_abs(got, full), float(full.abs().max()),
                               int((got.argmax(-1) == full.argmax(-1)).sum()),
                               full.shape[0] * full.shape[1], sum(beyond),
                               sum(t.numel() for t in exact.tensors())))
    return rows


@torch.no_grad()
def greedy_agreement(model: torch.nn.Module, prompt: torch.Tensor, steps: int,
                     settings: Sequence[tuple[str, torch.Tensor | None]] = (("per-head", None),),
                     call=None) -> list[Divergence]:
    """Generate ``steps`` greedy tokens after ``prompt`` (``[1, P]``) over an exact dynamic cache
    and over an FP8 cache of each ``(granularity, scales)`` of ``settings`` (scales None: from
    the first prefill), each path feeding its own tokens, and compare each with the exact one.
    ``call`` makes the calls (default ``model``; a :class:`~kvdoc.core.fast.FastDecoder` of it
    is faster and the same function).

    >>> from kvdoc.proofs.compare import default_model
    >>> [a] = greedy_agreement(default_model(), torch.tensor([[1, 2, 3]]), 20)
    >>> a.steps, 0 <= a.first <= 20
    (20, True)
    """
    call = model if call is None else call
    weight = model.wte.weight
    exact, gaps = greedy_with_gaps(call, prompt, steps, DynamicCache.empty(
        model.config, 1, weight.dtype, weight.device))
    return [divergence(exact, gaps, greedy_with_gaps(call, prompt, steps, new_fp8_cache(
                model, 1, granularity=granularity, scales=scales))[0])
            for granularity, scales in settings]
