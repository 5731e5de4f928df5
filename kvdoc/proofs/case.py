"""The per-combination fixture of the verification suite and the registry its checks join.

A scenario is a function ``(case, out)`` appending :class:`CheckResult` s to ``out``, registered
with :func:`scenario` under the checks it makes; this module imports no check module, so a check
imports it without a circle.

>>> @scenario("answer", {"answer": "the answer vs 42"})
... def _answer(case, out):
...     out.append(CheckResult("answer", "m", "dynamic", "model", "FP32", True, 0.0, ""))
>>> found = []
>>> REGISTRY["answer"].function(None, found)
>>> found[0].passed, REGISTRY["answer"].checks
(True, {'answer': 'the answer vs 42'})
>>> scenario("answer", {})(_answer)
Traceback (most recent call last):
ValueError: scenario 'answer' is registered already
>>> del REGISTRY["answer"]
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kvdoc.core.cache import KVCache

from .compare import DTYPE_NAMES, TOLERANCE, CachedRun, close, max_abs, run_cached
from .grid import CacheSpec, ModelSpec

SPARE = 8
"""Capacity beyond the stream: a cache that reads past its filled rows reads rows never written."""


@dataclass(frozen=True)
class CheckResult:
    """One check on one combination: ``passed`` None where it does not apply; ``error`` the
    largest difference (``inf`` for a shape mismatch, NaN or code that raised)."""

    check: str
    model: str
    kind: str
    impl: str
    dtype: str
    passed: bool | None
    error: float
    detail: str
    batch: int | None = None
    chunk: int | None = None


@dataclass
class Case:
    """One combination of the grid: its model (in its dtype), cached call and streams; ``fresh()``
    a copy of the model before any call ran on it, ``shared`` what every case of this model and
    stream computes alike, ``caches`` a broken variant's factories by kind (or scenario key)."""

    model_name: str
    kind: str
    impl: str
    dtype: torch.dtype
    spec: ModelSpec
    cache: CacheSpec
    model: nn.Module
    call: Callable
    ids: torch.Tensor
    alt: torch.Tensor
    batches: Sequence[int]
    chunks: Sequence[int]
    stale: bool
    fresh: Callable[[], nn.Module]
    implementation: Callable[[nn.Module], Callable]
    shared: dict = field(default_factory=dict)
    caches: Mapping[str, Callable[[nn.Module, int, int], KVCache]] = field(default_factory=dict)

    @property
    def tol(self) -> float:
        return TOLERANCE[self.dtype]

    def result(self, check: str, passed: bool | None, error: float, detail: str,
               batch: int | None = None, chunk: int | None = None) -> CheckResult:
        return CheckResult(check, self.model_name, self.kind, self.impl, DTYPE_NAMES[self.dtype],
                           passed, error, detail, batch, chunk)

    def compared(self, check: str, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 detail: str, also: bool = True, error: float = 0.0) -> CheckResult:
        """``check`` passed if every ``(got, want)`` of ``pairs`` is within the tolerance and
        ``also`` holds; its error the largest difference, at least ``error``."""
        ok = also and all(close(got, want, self.tol) for got, want in pairs)
        return self.result(check, ok, max([error, *(max_abs(g, w) for g, w in pairs)]), detail)

    def new_cache(self, batch: int | None = None) -> KVCache:
        new = self.caches.get(self.kind, self.cache.new)
        return new(self.model, batch or self.ids.shape[0], self.capacity)

    def feed(self, tokens: torch.Tensor, chunk: int, cache: KVCache | None = None,
             first: torch.Tensor | None = None) -> CachedRun:
        """``tokens`` fed through the cached call after ``cache`` (default a new one)."""
        cache = self.new_cache(tokens.shape[0]) if cache is None else cache
        return run_cached(self.call, tokens, chunk, first_chunk_ids=first, cache=cache,
                          in_place=self.cache.in_place)

    def full(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)[0]

    @property
    def capacity(self) -> int:
        return self.ids.shape[1] + SPARE

    def rounded(self) -> list[tuple[str, torch.dtype, nn.Module, Callable]]:
        """In the FP32 pass, ``(label, dtype, model, call)`` rounded to BF16 and to FP16."""
        if self.dtype != torch.float32:
            return []
        out = []
        for label, dtype in (("BF16", torch.bfloat16), ("FP16", torch.float16)):
            low = copy.deepcopy(self.fresh()).to(dtype).eval()
            out.append((label, dtype, low, self.implementation(low)))
        return out

    def both_batches(self) -> list[torch.Tensor]:
        """The stream at its full batch and, if larger, at batch 1 (a squeezed dim of 1 shows)."""
        return [self.ids] + ([self.ids[:1]] if self.ids.shape[0] > 1 else [])


Scenario = Callable[[Case, list], None]


@dataclass(frozen=True)
class Registered:
    """A scenario as registered: its checks (name -> what it compares) and the check an exception
    it raises is reported under."""

    function: Scenario
    checks: Mapping[str, str]
    raises_as: str


REGISTRY: dict[str, Registered] = {}
"""Every registered scenario by name (the suite orders them by module)."""


def scenario(name: str, checks: Mapping[str, str], *,
             raises_as: str | None = None) -> Callable[[Scenario], Scenario]:
    """Register the function as scenario ``name`` making ``checks``; an exception it raises is a
    failed ``raises_as`` check (default ``name``)."""
    def register(function: Scenario) -> Scenario:
        if name in REGISTRY:
            raise ValueError(f"scenario {name!r} is registered already")
        REGISTRY[name] = Registered(function, dict(checks), raises_as or name)
        return function
    return register
