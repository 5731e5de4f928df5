"""The verification suite: every scenario on every combination of the grid, and its verdict.

:func:`run_suite` runs the scenarios of :mod:`kvdoc.proofs.scenarios` on every combination of
the axes of :mod:`kvdoc.proofs.grid` (model configurations, cache kinds, implementations) and of
FP32 and FP64, and returns a :class:`SuiteReport`. :func:`sweep_variants` runs every broken
variant of :mod:`kvdoc.proofs.variants` through it, each of which must be caught.
``python -m kvdoc verify`` does both, in the passes of :func:`verify_passes` (by default every
scenario in FP32, then the stream and the reference in FP64; ``--thorough``, everything in both
on a longer stream), and ends with a verdict line; its exit status is 0 only if the
implementation passed and every variant was caught.

An exception raised by the code under test (also while a model is built) is a failed check
carrying its message; the suite itself does not raise.

>>> report = run_suite(models=("gqa",), kinds=("static",), dtypes=(torch.float32,), length=40)
>>> report.passed, report.combinations, report.failed_checks()  # the model itself, and FastDecoder
(True, [('gqa', 'static', 'model', 'FP32'), ('gqa', 'static', 'fast', 'FP32')], [])
>>> run_suite("position-counter", models=("mha",), kinds=("dynamic",), dtypes=(torch.float32,),
...           length=40).failed_checks()
['causality', 'speculative', 'crop', 'branch', 'failure', 'failure_after', 'edges']
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvdoc.measure.tables import markdown_table

from . import grid
from .compare import DTYPE_NAMES, TOLERANCE
from .scenarios import CHECKS, SCENARIO_CHECK, SCENARIOS, Case, CheckResult
from .variants import VARIANTS

ORDER = list(CHECKS)
DTYPES = (torch.float32, torch.float64)
"""The dtypes of a run by default."""


@dataclass(frozen=True)
class SuiteReport:
    """Every :class:`~kvdoc.proofs.scenarios.CheckResult` of one run of the suite.

    Attributes:
        variant: None for the implementation as it is, else the broken variant's name.
        results: one per check and combination (and per batch and chunk size for the stream's
            checks; a scenario that raised gives one failed result, with the exception's message
            as its detail; a model that could not be built, one failed ``build`` result).
        seconds: wall-clock time of the run (an observation).
    """

    variant: str | None
    results: list[CheckResult]
    seconds: float

    @property
    def passed(self) -> bool:
        """Something ran and nothing failed (checks that do not apply are neither)."""
        return bool(self.results) and all(r.passed is not False for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        """The failed results, in run order."""
        return [r for r in self.results if r.passed is False]

    @property
    def combinations(self) -> list[tuple[str, str, str, str]]:
        """The distinct ``(model, kind, implementation, dtype)`` combinations run."""
        return list(dict.fromkeys((r.model, r.kind, r.impl, r.dtype) for r in self.results))

    def failed_checks(self) -> list[str]:
        """Names of the checks that failed at least once, in report order."""
        names = list(dict.fromkeys(r.check for r in self.failures))
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))

    def select(self, check: str, **where) -> list[CheckResult]:
        """The results of ``check`` whose fields equal ``where``
        (e.g. ``kind="static", chunk=5``)."""
        return [r for r in self.results if r.check == check
                and all(getattr(r, k) == v for k, v in where.items())]

    def result(self, check: str, **where) -> CheckResult:
        """The one result of ``check`` matching ``where``; KeyError unless exactly one matches."""
        found = self.select(check, **where)
        if len(found) != 1:
            raise KeyError(f"{len(found)} results of {check!r} match {where}")
        return found[0]

    def max_error(self, check: str = "logits", **where) -> float:
        """Largest error of ``check`` over the results matching ``where``
        (e.g. ``dtype="FP32"``)."""
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
        """One Markdown row per model and dtype: its independent reference (transformers' GPT-2,
        Llama or Mistral, or the MHA copy of a GQA model) against kvdoc, full and cached, over
        every cache kind and implementation."""
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
    """The stream ``[batch, length]`` and an unrelated one (other continuations for crop and
    branch)."""
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
                                 SCENARIO_CHECK.get(name, name)))
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

    Args:
        variant: a key of :data:`kvdoc.proofs.variants.VARIANTS` to test instead of the
            implementation as it is.
        models, kinds, impls: keys of :data:`kvdoc.proofs.grid.MODELS`, ``CACHES``,
            ``IMPLEMENTATIONS`` (default: all of each, as registered when called, and of those a
            model's :attr:`~kvdoc.proofs.grid.ModelSpec.impls`; for a variant, ``impls``
            defaults to ``("model",)``, the broken model itself).
        dtypes: FP32 and/or FP64 (FP64 converts a copy of the FP32 weights).
        length, chunks, batches, seeds: the stream, the stream checks' chunk and batch sizes
            (every pair), and the model seeds.
        scenarios: keys of :data:`kvdoc.proofs.scenarios.SCENARIOS` (default all), run in this
            order on each combination.
        stop_at_first: return at the first failed check (how broken variants are swept).
        model: a model (FP32, with the :class:`~kvdoc.core.model.Decoder` interface) to verify
            instead of the grid's models; reported as model ``"given"``, without a reference.
        ids: the stream ``[B, T]`` to use instead of a random one of ``length`` tokens
            (``B >= max(batches)``; a batch ``b`` uses its first ``b`` rows).

    Returns:
        A :class:`SuiteReport`.

    Raises:
        ValueError: an unknown name on an axis, a bad dtype, or a stream too short for the
            scenarios.
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
                # skips what does not serve the model, e.g. a ring cache for a model without a
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
                    if _run_case(case, scenarios, results, stop_at_first):
                        return SuiteReport(variant, results, time.perf_counter() - start)
    return SuiteReport(variant, results, time.perf_counter() - start)


@dataclass(frozen=True)
class VariantOutcome:
    """How one broken variant fared: ``caught`` if any check failed; where the first failure was."""

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
                   workers: int = 1, map_: Callable | None = None,
                   **axes) -> list[VariantOutcome]:
    """Run each broken variant (all by default) through :func:`run_suite` with the same ``axes``.

    A variant built for some models, kinds or dtypes only
    (:meth:`~kvdoc.proofs.variants.BrokenVariant.models_among`, ``kinds``, ``dtypes``) runs on
    those among the ``axes``, and is left out when there are none.

    With ``stop_at_first`` (the default) each run stops at its first failed check, which is all
    a verdict needs; without it, every check runs, which shows everything that catches a variant.
    ``workers > 1`` runs the variants in that many fresh processes (:func:`worker_map`), or
    ``map_`` (one of :func:`worker_map`'s) in its processes; the outcomes are the same, in the
    same order.
    """
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
    if map_ is not None:
        return list(map_(_sweep_one, runs))
    with worker_map(workers if len(runs) > 1 else 1) as map_:
        return list(map_(_sweep_one, runs))


@contextmanager
def worker_map(workers: int) -> Iterator[Callable]:
    """A ``map`` over ``workers`` fresh processes (the built-in ``map`` for one), in order.

    The workers share this process's torch threads, at least one each: two workers of two
    threads each on two cores ran three times slower than of one.
    """
    if workers <= 1:
        yield map
        return
    import multiprocessing

    # spawn, not fork: a forked child of a process that ran OpenMP threads can hang
    context = multiprocessing.get_context("spawn")
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
    """One Markdown row per variant: its class, whether it was caught, and by which check where."""
    body = []
    for o in outcomes:
        f = o.first
        where = "" if f is None else f"{f.check} ({f.model}, {f.kind}, {f.dtype})"
        body.append([f"`{o.name}`", o.bug_class, "yes" if o.caught else "NO", where])
    return markdown_table(["variant", "bug class", "caught", "first failed check"], body)


# --- command line -----------------------------------------------------------------------------

FP64_SCENARIOS = ("stream", "reference")
"""What the default ``verify`` repeats in FP64: the stream's checks and the independent reference,
at FP64's tolerance, where a path that rounds through FP32 shows. ``--thorough`` runs every
scenario in both dtypes."""
FP64_CHUNKS = (2, 13)
"""The default FP64 stream's chunk sizes: pairs, whose last call is a single token (the fast
step, at the stream's end), and a chunk near the window that divides neither the stream, the
window nor a paged block. A path that rounds through FP32 is off by far more than FP64's
tolerance at any chunk size; FP32 runs every chunk size of :data:`kvdoc.proofs.grid.CHUNKS`."""
SWEEP_LAST = ("weights", "branch", "reference", "prefill_decode", "stream")
"""The slowest scenarios, which a sweep that stops at a variant's first failure runs last (in
this order, after every other scenario in its own order): most variants fail a cheap check
first, and the verdict is the same in any order."""


def sweep_order(names: Sequence[str]) -> list[str]:
    """``names`` with those of :data:`SWEEP_LAST` moved to the end, in that order.

    >>> sweep_order(["stream", "last_only", "branch", "bytes"])
    ['last_only', 'bytes', 'branch', 'stream']
    """
    return ([n for n in names if n not in SWEEP_LAST]
            + [n for n in SWEEP_LAST if n in names])


def verify_passes(thorough: bool = False, seed: int = 0) -> list[dict]:
    """The runs of ``python -m kvdoc verify``, each the axes of one :func:`run_suite`.

    By default every scenario in FP32, then :data:`FP64_SCENARIOS` in FP64 at
    :data:`FP64_CHUNKS`, one seed; ``thorough``, every scenario in both dtypes on
    :data:`kvdoc.proofs.grid.THOROUGH`, two seeds, every implementation on every model it
    serves (also those a :attr:`~kvdoc.proofs.grid.ModelSpec.impls` leaves out by default).

    >>> [p["dtypes"] for p in verify_passes()], verify_passes()[1]["scenarios"]
    ([(torch.float32,), (torch.float64,)], ('stream', 'reference'))
    >>> len(verify_passes(thorough=True)), verify_passes(True, seed=3)[0]["seeds"]
    (1, (3, 4))
    """
    if thorough:  # every implementation on every model that it serves
        return [dict(grid.THOROUGH, seeds=(seed, seed + 1), dtypes=DTYPES,
                     impls=tuple(grid.IMPLEMENTATIONS))]
    return [dict(seeds=(seed,), dtypes=(torch.float32,)),
            dict(seeds=(seed,), dtypes=(torch.float64,), scenarios=FP64_SCENARIOS,
                 chunks=FP64_CHUNKS)]


def run_passes(passes: Sequence[dict], variant: str | None = None,
               map_: Callable = map) -> SuiteReport:
    """:func:`run_suite` once per pass (axes), the results in one :class:`SuiteReport`; a
    variant runs as the broken model itself, whatever implementations a pass names.

    The implementation's passes run one :func:`run_suite` per seed and model through ``map_``
    (e.g. :func:`worker_map`'s), in the order one call would visit them, so the results are
    the same whichever ``map_`` runs them; ``seconds`` is the wall time of the whole.
    """
    start = time.perf_counter()
    if variant is None:
        runs = [{**axes, "seeds": (seed,), "models": (name,)} for axes in passes
                for seed in axes.get("seeds", (0,)) for name in axes.get("models") or grid.MODELS]
    else:
        runs = [{k: v for k, v in axes.items() if k != "impls"} for axes in passes]
    reports = list(map_(_suite_one, [(variant, axes) for axes in runs]))
    return SuiteReport(variant, [r for report in reports for r in report.results],
                       time.perf_counter() - start)


def _suite_one(run: tuple[str | None, dict]) -> SuiteReport:
    variant, axes = run
    return run_suite(variant, **axes)


def sweep_passes(passes: Sequence[dict], names: Sequence[str] | None = None,
                 map_: Callable = map) -> list[VariantOutcome]:
    """:func:`sweep_variants` (of ``names``, default all) pass after pass, each stopping at a
    variant's first failure, the slowest scenarios last (:func:`sweep_order`); a pass runs only
    the variants no earlier pass caught. One outcome per variant swept, in
    :data:`~kvdoc.proofs.variants.VARIANTS` order."""
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m kvdoc verify``."""
    parser.add_argument("--variant", choices=list(VARIANTS), default=None,
                        help="run the suite on this broken variant instead (it must fail)")
    parser.add_argument("--list", action="store_true", help="list the broken variants and exit")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the models' random weights (default 0)")
    parser.add_argument("--no-variants", action="store_true",
                        help="skip the broken variants (by default each must be caught)")
    parser.add_argument("--workers", type=_positive, default=min(2, os.cpu_count() or 1),
                        help="processes that share the runs (default: 2, or 1 on one core)")
    parser.add_argument("--thorough", action="store_true",
                        help=f"a longer stream ({grid.THOROUGH['length']} tokens), "
                             "more chunk sizes, batch 3 and 1, two seeds (slower; CI runs it)")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def main(args: argparse.Namespace) -> int:
    """Run the suite, print its tables and a verdict line; return 0 only if everything is as
    expected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster than several that contend
    try:
        return _main(args)
    except Exception as exc:  # the verifier's own failure still ends in a verdict
        print(f"VERDICT: FAIL (the verifier stopped: {type(exc).__name__}: {exc})")
        return 1
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> int:
    if args.list:
        for v in VARIANTS.values():
            print(f"{v.name:22s} {v.bug_class:26s} {v.breaks}")
        return 0
    start = time.perf_counter()
    passes = verify_passes(args.thorough, args.seed)
    with worker_map(args.workers) as map_:
        return _report(args, passes, map_, start)


def _report(args: argparse.Namespace, passes: list[dict], map_: Callable, start: float) -> int:
    report = run_passes(passes, args.variant, map_)
    subject = f"broken variant {args.variant!r}" if args.variant else "the implementation"
    print(f"Suite on {subject}: {len(report.combinations)} combinations of model, cache kind, "
          f"implementation and dtype, {len(passes[0]['seeds'])} seed(s), "
          f"{len(report.results)} checks, {report.seconds:.1f} s "
          f"({args.workers} worker process{'es' if args.workers > 1 else ''})")
    ran = list(zip(*report.combinations, strict=True)) or [(), (), (), ()]
    for axis, values in zip(("models", "cache kinds", "implementations", "dtypes"), ran,
                            strict=True):
        print(f"  {axis}: {', '.join(dict.fromkeys(values))}")
    print("  approximate caches: int8 (scenario int8, on the dynamic kind; its own contract: "
          "held rows bitwise, each element within half its row's step, each attention read "
          "within its derived bound)")
    print("  padded batches: left-padded prompts with a pad mask (scenario padded)")
    print(f"  scenarios: {', '.join(SCENARIOS)}")
    for axes in passes:
        dtypes = "/".join(DTYPE_NAMES[d] for d in axes["dtypes"])
        names = axes.get("scenarios")
        print(f"  {dtypes} run: {', '.join(names) if names else 'every scenario'}; chunks of "
              f"{', '.join(map(str, axes.get('chunks', grid.CHUNKS)))}, batch "
              f"{', '.join(map(str, axes.get('batches', grid.BATCHES)))}, "
              f"{axes.get('length', grid.STREAM_LENGTH)} tokens")
    print()
    print(report.summary_table())
    print(f"\nIndependent references, full and cached:\n\n{report.references_table()}")
    if report.failures:
        print(f"\n{len(report.failures)} failed checks (first {min(12, len(report.failures))}):\n")
        print(report.failures_table())
    if args.variant is not None:
        verdict = "FAIL" if report.failures else "PASS"
        print(f"\nVERDICT: {verdict}: broken variant {args.variant!r} "
              + (f"caught by {', '.join(report.failed_checks())}" if report.failures
                 else "NOT caught"))
        return 0 if report.passed else 1
    missed: list[str] = []
    if not args.no_variants:
        swept = time.perf_counter()
        # a verdict needs each variant's first failure only
        outcomes = sweep_passes(passes, map_=map_)
        print(f"\nBroken variants (each must be caught; the slowest scenarios run last), "
              f"{time.perf_counter() - swept:.1f} s:\n\n{variants_table(outcomes)}")
        caught = {o.name for o in outcomes if o.caught}
        missed = [name for name in VARIANTS if name not in caught]  # or never run
    problems = ([f"{len(report.failures)} failed checks ({', '.join(report.failed_checks())})"]
                if not report.passed else [])
    problems += [f"variants not caught: {', '.join(missed)}"] if missed else []
    print(f"\nTotal: {time.perf_counter() - start:.1f} s")
    print("\nVERDICT: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return 0 if not problems else 1
