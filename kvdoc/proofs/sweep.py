"""The sweep of the broken variants, each of which must be caught, in worker processes if asked.

>>> outcomes = sweep_variants(["no-mask"], models=("mha",), kinds=("dynamic",),
...                           dtypes=(torch.float32,), length=24)
>>> [(o.name, o.caught, o.first.check) for o in outcomes]
[('no-mask', True, 'logits')]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvdoc.measure.tables import markdown_table
from kvdoc.parallel.launch import START_METHOD

from . import grid
from .case import CheckResult
from .suite import DTYPES, SCENARIOS, SuiteReport, run_suite
from .variants import VARIANTS


@dataclass(frozen=True)
class VariantOutcome:
    """How one broken variant fared: caught if any check failed, and where first."""

    name: str
    breaks: str
    bug_class: str
    report: SuiteReport

    @property
    def caught(self) -> bool:
        return not self.report.passed

    @property
    def first(self) -> CheckResult | None:
        failures = self.report.failures
        return failures[0] if failures else None


def sweep_variants(names: Sequence[str] | None = None, *, stop_at_first: bool = True,
                   map_: Callable = map, **axes) -> list[VariantOutcome]:
    """Each broken variant (default all) through :func:`run_suite` on those of ``axes`` it is
    built for (left out if none), stopping at its first failure (what a verdict needs) or not;
    through ``map_`` (:func:`worker_map`), the same outcomes in the same order."""
    runs = []
    for name in (list(VARIANTS) if names is None else list(names)):
        v = VARIANTS[name]
        # e.g. RoPE variants run on the RoPE models only
        models = v.models_among(list(axes.get("models") or grid.MODELS))
        kinds = [k for k in (axes.get("kinds") or grid.CACHES) if v.kinds is None or k in v.kinds]
        dtypes = [d for d in axes.get("dtypes", DTYPES) if v.dtypes is None or d in v.dtypes]
        if models and kinds and dtypes:  # else nothing on these axes it can be built from
            runs.append((name, stop_at_first, {**axes, "models": models, "dtypes": dtypes,
                                               **({"kinds": kinds} if v.kinds else {})}))
    return list(map_(_sweep_one, runs))


@contextmanager
def worker_map(workers: int) -> Iterator[Callable]:
    """A ``map`` over ``workers`` fresh processes (the built-in ``map`` for one), in order; they
    share this process's torch threads (two workers of two threads on two cores ran three times
    slower than of one) and start as the ranks of :func:`kvdoc.parallel.launch.launch` do."""
    if workers <= 1:
        yield map
        return
    import multiprocessing

    # not a fork of this process: a forked child of a process that ran OpenMP threads can hang
    context = multiprocessing.get_context(START_METHOD)
    threads = max(1, torch.get_num_threads() // workers)
    with context.Pool(workers, _set_threads, (threads,)) as pool:
        yield lambda fn, items: pool.map(fn, items, chunksize=1)


def _set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def _sweep_one(run: tuple[str, bool, dict]) -> VariantOutcome:
    name, stop_at_first, axes = run
    v = VARIANTS[name]
    return VariantOutcome(name, v.breaks, v.bug_class,
                          run_suite(name, stop_at_first=stop_at_first, **axes))


def variants_table(outcomes: Sequence[VariantOutcome]) -> str:
    """One Markdown row per variant: its class, caught or not, the first failed check."""
    body = []
    for o in outcomes:
        f = o.first
        where = "" if f is None else f"{f.check} ({f.model}, {f.kind}, {f.dtype})"
        body.append([f"`{o.name}`", o.bug_class, "yes" if o.caught else "NO", where])
    return markdown_table(["variant", "bug class", "caught", "first failed check"], body)


SWEEP_LAST = ("weights", "branch", "reference", "prefill_decode", "stream")
"""The slowest scenarios, run last by a sweep (most variants fail a cheap check first)."""


def sweep_order(names: Sequence[str]) -> list[str]:
    """``names``, those of :data:`SWEEP_LAST` moved to the end in that order.

    >>> sweep_order(["stream", "last_only", "branch", "bytes"])
    ['last_only', 'bytes', 'branch', 'stream']
    """
    return ([n for n in names if n not in SWEEP_LAST]
            + [n for n in SWEEP_LAST if n in names])


def sweep_passes(passes: Sequence[dict], names: Sequence[str] | None = None,
                 map_: Callable = map) -> list[VariantOutcome]:
    """:func:`sweep_variants` pass after pass in :func:`sweep_order`, a pass running the variants
    no earlier one caught: one outcome a variant."""
    names = list(VARIANTS if names is None else names)
    outcomes: dict[str, VariantOutcome] = {}
    for axes in passes:
        todo = [n for n in names if n not in outcomes or not outcomes[n].caught]
        order = sweep_order(axes.get("scenarios") or SCENARIOS)
        # a variant runs as the broken model itself, whatever implementations the pass names
        swept = {k: v for k, v in axes.items() if k != "impls"}
        outcomes.update((o.name, o) for o in sweep_variants(todo, map_=map_,
                                                            **{**swept, "scenarios": order}))
    return [outcomes[n] for n in names if n in outcomes]
