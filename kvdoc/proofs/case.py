"""The per-combination fixture of the verification suite and the registry its checks join.

A check module defines scenarios, functions ``(case, out)`` that append :class:`CheckResult` s
(made by :meth:`Case.result`) to ``out``, and registers each with :func:`scenario`, naming the
checks it makes; :mod:`kvdoc.proofs.suite` imports the check modules and runs what they
registered. This module imports no check module, so a check imports it without a circle.

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

from .compare import DTYPE_NAMES, TOLERANCE, CachedRun, run_cached
from .grid import CacheSpec, ModelSpec

SPARE = 8
"""Positions of capacity beyond the stream that a cache is built with (for kinds that take one)."""


@dataclass(frozen=True)
class CheckResult:
    """One check on one combination. ``passed`` is None when the check does not apply.

    ``batch`` and ``chunk`` are set for the checks of one stream run (``chunk`` is None for
    the other checks); ``error`` is the largest difference (``inf`` for a shape mismatch, NaN,
    or code that raised).
    """

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
    """One combination of the grid, with its model (in its dtype), cached call and streams."""

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
    """A copy of the model as it was built, before any call ran on it (a new copy each call)."""
    implementation: Callable[[nn.Module], Callable]
    """How the cached call is made from a model (``grid.IMPLEMENTATIONS[impl]``)."""
    shared: dict = field(default_factory=dict)
    """What every case of this model, dtype and stream computes alike (the reference's logits)."""
    caches: Mapping[str, Callable[[nn.Module, int, int], KVCache]] = field(default_factory=dict)
    """Cache factories a broken variant puts in place of the real ones, by kind (or ``"int8"``,
    ``"fp8"``)."""
    in_dtype: Callable[[torch.dtype], nn.Module] | None = None
    """The model under test built afresh in another dtype (a broken variant built from the
    correct model in that dtype, as in the run itself)."""

    @property
    def tol(self) -> float:
        return TOLERANCE[self.dtype]

    def result(self, check: str, passed: bool | None, error: float, detail: str,
               batch: int | None = None, chunk: int | None = None) -> CheckResult:
        return CheckResult(check, self.model_name, self.kind, self.impl, DTYPE_NAMES[self.dtype],
                           passed, error, detail, batch, chunk)

    def new_cache(self, batch: int | None = None) -> KVCache:
        # spare capacity: a cache that reads past its filled rows then reads rows never written
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
        """What a new cache of this case is built to hold: the stream and :data:`SPARE`."""
        return self.ids.shape[1] + SPARE

    def rounded(self) -> list[tuple[str, torch.dtype, nn.Module, Callable]]:
        """In the FP32 pass, the model as built rounded to BF16 and to FP16, each as ``(label,
        dtype, model, cached call)``; none in another pass."""
        if self.dtype != torch.float32:
            return []
        out = []
        for label, dtype in (("BF16", torch.bfloat16), ("FP16", torch.float16)):
            low = copy.deepcopy(self.fresh()).to(dtype).eval()
            out.append((label, dtype, low, self.implementation(low)))
        return out

    def both_batches(self) -> list[torch.Tensor]:
        """The stream at its full batch and, if larger, at batch 1 (bugs that squeeze a dim of
        1)."""
        return [self.ids] + ([self.ids[:1]] if self.ids.shape[0] > 1 else [])


Scenario = Callable[[Case, list], None]
"""A scenario: runs on one combination and appends its :class:`CheckResult` s to the list."""


@dataclass(frozen=True)
class Registered:
    """A scenario as registered: the function, the checks it makes (name -> what it compares),
    and the check an exception it raises is reported under."""

    function: Scenario
    checks: Mapping[str, str]
    raises_as: str


REGISTRY: dict[str, Registered] = {}
"""Every registered scenario by name, in the order registered (import order: the suite orders
them by module, :data:`kvdoc.proofs.suite.CHECK_MODULES`)."""


def scenario(name: str, checks: Mapping[str, str], *,
             raises_as: str | None = None) -> Callable[[Scenario], Scenario]:
    """Register the decorated function as scenario ``name``, making ``checks`` (name -> what
    it compares); an exception it raises is a failed ``raises_as`` check (default ``name``)."""
    def register(function: Scenario) -> Scenario:
        if name in REGISTRY:
            raise ValueError(f"scenario {name!r} is registered already")
        REGISTRY[name] = Registered(function, dict(checks), raises_as or name)
        return function
    return register
