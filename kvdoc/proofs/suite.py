"""The verification suite: every registered scenario on every combination of the grid.

:func:`run_suite` runs what the modules of :data:`CHECK_MODULES` register on every combination of
:mod:`kvdoc.proofs.grid`'s axes and of FP32 and FP64, or on a broken variant, which must fail.
Code under test that raises (also while a model is built) is a failed check carrying its
message; the suite itself does not raise.

>>> report = run_suite(models=("gqa",), kinds=("static",), dtypes=(torch.float32,), length=40)
>>> report.passed, report.combinations, report.failed_checks()  # the model itself, and FastDecoder
(True, [('gqa', 'static', 'model', 'FP32'), ('gqa', 'static', 'fast', 'FP32')], [])
>>> run_suite("position-counter", models=("mha",), kinds=("dynamic",), dtypes=(torch.float32,),
...           length=40).failed_checks()  # doctest: +NORMALIZE_WHITESPACE
['causality', 'speculative', 'speculative_state', 'speculative_perfect', 'crop', 'branch',
 'failure', 'failure_after', 'edges']
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.measure.tables import markdown_table

from . import (
    cache_invariants,
    calls,
    contracts,
    equivalence,
    figures,
    grid,
    imported,
    precision,
)
from .case import REGISTRY, Case, CheckResult
from .compare import DTYPE_NAMES, TOLERANCE
from .variants import VARIANTS

CHECK_MODULES = (equivalence, figures, calls, cache_invariants, imported,
                 contracts, precision)
"""The modules whose scenarios run, in this order: the cheap ones first, as a sweep stops at a
variant's first failure."""
_RANK = {module.__name__: rank for rank, module in enumerate(CHECK_MODULES)}
SCENARIOS = {name: REGISTRY[name].function
             for name in sorted(REGISTRY, key=lambda n: _RANK[REGISTRY[n].function.__module__])}
"""Scenario name -> function, in run order."""
CHECKS = {check: says for name in SCENARIOS for check, says in REGISTRY[name].checks.items()}
"""Every check by name, in report order, with what it compares."""
ORDER = list(CHECKS)
DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class SuiteReport:
    """Every :class:`~kvdoc.proofs.case.CheckResult` of one run (``variant`` None: the
    implementation); a scenario that raised gives one failed result, a model that could not be
    built one failed ``build`` result."""

    variant: str | None
    results: list[CheckResult]
    seconds: float

    @property
    def passed(self) -> bool:
        """Something ran and nothing failed (a check that does not apply is neither)."""
        return bool(self.results) and all(r.passed is not False for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.passed is False]

    @property
    def combinations(self) -> list[tuple[str, str, str, str]]:
        return list(dict.fromkeys((r.model, r.kind, r.impl, r.dtype) for r in self.results))

    def failed_checks(self) -> list[str]:
        """Names of the checks that failed at least once, in report order."""
        names = list(dict.fromkeys(r.check for r in self.failures))
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))

    def select(self, check: str, **where) -> list[CheckResult]:
        """The results of ``check`` whose fields equal ``where`` (``kind="static", chunk=5``)."""
        return [r for r in self.results if r.check == check
                and all(getattr(r, k) == v for k, v in where.items())]

    def result(self, check: str, **where) -> CheckResult:
        """The one result of ``check`` matching ``where``; KeyError unless exactly one matches."""
        found = self.select(check, **where)
        if len(found) != 1:
            raise KeyError(f"{len(found)} results of {check!r} match {where}")
        return found[0]

    def max_error(self, check: str = "logits", **where) -> float:
        """Largest error of ``check`` over the results matching ``where``."""
        return max((r.error for r in self.select(check, **where)), default=0.0)

    def summary_table(self) -> str:
        """One Markdown row per check: what it compares, results passed, largest difference."""
        names = [n for n in ORDER if any(r.check == n for r in self.results)]
        names += [n for n in dict.fromkeys(r.check for r in self.results) if n not in names]
        body = []
        for name in names:
            rows = self.select(name)
            ran = [r for r in rows if r.passed is not None]
            worst = max((r.error for r in ran), default=0.0)
            body.append([name, CHECKS.get(name, "raised an exception"),
                         f"{sum(bool(r.passed) for r in ran)} of {len(ran)}", len(rows) - len(ran),
                         f"{worst:.2e}" if ran else ""])
        return markdown_table(["check", "compares", "passed", "not applicable",
                               "largest difference"], body)

    def references_table(self) -> str:
        """One Markdown row per model and dtype: its independent reference, full and cached."""
        body = []
        for model, dtype in dict.fromkeys((r.model, r.dtype) for r in self.select("reference")):
            ran = [r for r in self.select("reference", model=model, dtype=dtype)
                   if r.passed is not None]
            if ran:
                body.append([model, ran[0].detail, dtype,
                             f"{sum(bool(r.passed) for r in ran)} of {len(ran)}",
                             f"{max(r.error for r in ran):.2e}"])
        return markdown_table(["model", "independent reference", "dtype",
                               "passed (full and cached)", "largest difference"], body)

    def failures_table(self, limit: int = 12) -> str:
        """The first ``limit`` failures as a Markdown table."""
        body = [[r.check, r.model, r.kind, r.impl, r.dtype, f"{r.error:.2e}", r.detail[:120]]
                for r in self.failures[:limit]]
        return markdown_table(["check", "model", "cache", "implementation", "dtype", "difference",
                               "detail"], body)


def _streams(seed: int, batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream ``[batch, length]`` and an unrelated one (crop's and branch's continuations)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randint(0, vocab, (batch, length), generator=g),
            torch.randint(0, vocab, (batch, length), generator=g))


def _failed(case_fields: tuple, exc: Exception, check: str = "build") -> CheckResult:
    name, kind, impl, dtype = case_fields
    return CheckResult(check, name, kind, impl, DTYPE_NAMES[dtype], False, float("inf"),
                       f"raised {type(exc).__name__}: {exc}")


def _run_case(case: Case, scenarios: Sequence[str], results: list, stop_at_first: bool) -> bool:
    """Run the scenarios on one combination, appending to ``results``; True if it should stop."""
    for name in scenarios:
        found: list[CheckResult] = []
        try:
            with torch.no_grad():
                SCENARIOS[name](case, found)
        except Exception as exc:  # the code under test failed: a failed check, not a crash
            found.append(_failed((case.model_name, case.kind, case.impl, case.dtype), exc,
                                 REGISTRY[name].raises_as))
        results.extend(found)
        if stop_at_first and any(r.passed is False for r in found):
            return True
    return False


def run_suite(variant: str | None = None, *, models: Sequence[str] | None = None,
              kinds: Sequence[str] | None = None, impls: Sequence[str] | None = None,
              dtypes: Sequence[torch.dtype] = DTYPES,
              length: int = grid.STREAM_LENGTH,
              chunks: Sequence[int] = grid.CHUNKS, batches: Sequence[int] = grid.BATCHES,
              seeds: Sequence[int] = (0,), scenarios: Sequence[str] | None = None,
              stop_at_first: bool = False, model: torch.nn.Module | None = None,
              ids: torch.Tensor | None = None) -> SuiteReport:
    """Run the scenarios on every combination of models, cache kinds, implementations and dtypes.

    ``variant`` (a key of :data:`~kvdoc.proofs.variants.VARIANTS`) is tested instead of the
    implementation, by default on the models, kinds and dtypes it is built for and as itself.
    ``models``, ``kinds``, ``impls``: keys of the grid's registries (default all a model takes).
    ``stop_at_first``: return at the first failed check (a sweep). ``model``: an FP32 model with
    the Decoder interface verified instead (model ``"given"``, no reference); ``ids``: the
    stream ``[B, T]`` instead of a random one. ``ValueError`` for an unknown name, a bad dtype or
    a stream too short.
    """
    specs = ({"given": grid.ModelSpec("the model given", lambda seed: model)} if model is not None
             else grid.MODELS)
    if variant in VARIANTS and models is None and model is None:
        models = VARIANTS[variant].models_among(list(specs))  # e.g. learned positions only
    if variant in VARIANTS and kinds is None and VARIANTS[variant].kinds:
        kinds = VARIANTS[variant].kinds  # its broken caches replace these kinds
    models, kinds = list(models or specs), list(kinds or grid.CACHES)
    # a broken variant is the implementation under test: by default it runs as itself, not wrapped
    given_impls = impls is not None  # else a model's own impls (ModelSpec.impls) apply
    impls = list(impls or (grid.IMPLEMENTATIONS if variant is None else ("model",)))
    scenarios = list(scenarios or SCENARIOS)
    for axis, names, known in (("model", models, specs), ("cache kind", kinds, grid.CACHES),
                               ("implementation", impls, grid.IMPLEMENTATIONS),
                               ("scenario", scenarios, SCENARIOS)):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown {axis} {unknown[0]!r}; choose from {', '.join(known)}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if any(dt not in TOLERANCE for dt in dtypes):
        raise ValueError(f"dtypes must be float32 or float64, got {list(dtypes)}")
    length = length if ids is None else ids.shape[1]
    if length < 24 or not batches or min(batches) < 1 or not chunks or min(chunks) < 1:
        raise ValueError(f"need a stream of >= 24 tokens and positive batches and chunks; "
                         f"got {length}, {list(batches)}, {list(chunks)}")
    if ids is not None and max(batches) > ids.shape[0]:
        raise ValueError(f"batch {max(batches)} needs {max(batches)} rows of ids, "
                         f"got {ids.shape[0]}")
    start, results = time.perf_counter(), []
    broken = None if variant is None else VARIANTS[variant]
    for seed in seeds:
        for name in models:
            for dt in dtypes:
                try:
                    under_test = copy.deepcopy(specs[name].build(seed)).to(dt).eval()
                    if broken is not None and not broken.builds_on(under_test.config):
                        break  # e.g. a K/V cache bug on an MLA model: nothing to build
                    under_test = under_test if broken is None else broken.build(under_test)
                    # before any call: what the ``fresh`` scenario copies
                    pristine = copy.deepcopy(under_test)
                    shared: dict = {}
                    stream, alt = _streams(seed, max(batches), length, under_test.config.vocab_size)
                    stream = stream if ids is None else ids[:max(batches)]
                except Exception as exc:
                    results.append(_failed((name, "", "", dt), exc))
                    continue
                # skips what does not serve the model, e.g. a window cache for a model without a
                # window, K/V caches and FastDecoder for an MLA model
                own = [i for i in impls
                       if given_impls or specs[name].impls is None or i in specs[name].impls]
                for kind, impl in grid.served(under_test.config, kinds, own) if own else ():
                    try:
                        call = grid.IMPLEMENTATIONS[impl](under_test)
                    except Exception as exc:
                        results.append(_failed((name, kind, impl, dt), exc))
                        continue
                    case = Case(name, kind, impl, dt, specs[name], grid.CACHES[kind],
                                under_test, call, stream, alt, tuple(batches), tuple(chunks),
                                broken is not None and broken.stale_prefix,
                                lambda pristine=pristine: copy.deepcopy(pristine),
                                grid.IMPLEMENTATIONS[impl], shared,
                                {} if broken is None else broken.caches)
                    # a model that names its scenarios runs no other, even when a sweep or a
                    # pass names more (a V4 model refuses a padded batch: no result to judge)
                    own_scenarios = (scenarios if specs[name].scenarios is None
                                     else [n for n in scenarios if n in specs[name].scenarios])
                    if _run_case(case, own_scenarios, results, stop_at_first):
                        return SuiteReport(variant, results, time.perf_counter() - start)
    return SuiteReport(variant, results, time.perf_counter() - start)
