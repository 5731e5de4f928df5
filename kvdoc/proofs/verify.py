"""``python -m kvdoc verify``: the suite in the passes of :func:`verify_passes`, the sweep of every
broken variant, the checks across processes (:func:`process_checks`), and a verdict; the exit
status is 0 only if the implementation passed and every variant was caught. The checks across
processes run from this process (pool workers cannot start ranks), each beside its broken
variants (:mod:`kvdoc.proofs.broken.parallel`), which must fail.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from kvdoc.measure.tables import markdown_table
from kvdoc.parallel.blocks import Handover, handover_runs
from kvdoc.parallel.comparison import Job, build_model, check_jobs, compare_jobs, rank_jobs
from kvdoc.parallel.latent import (
    MODES,
    WIDE,
    LatentJob,
    check_latent_job,
    compare_latent,
    latent_model,
    rank_latent_jobs,
)
from kvdoc.parallel.launch import launch, stop_fork_server, together
from kvdoc.serving.offload import TieredStore, check_offload, multi_turn

from . import grid
from .broken.parallel import BROKEN as PARALLEL_BROKEN
from .broken.parallel import HANDOVER_BROKEN, LATENT_BROKEN, PULL_BROKEN
from .broken.serving import OFFLOAD_BROKEN
from .compare import DTYPE_NAMES
from .suite import DTYPES, SCENARIOS, SuiteReport, run_suite
from .sweep import sweep_passes, variants_table, worker_map
from .variants import VARIANTS

FP64_SCENARIOS = ("stream", "reference", "invariant", "imported")
"""Repeated in FP64, where a path that rounds through FP32 shows (the mode's, an import's)."""
FP64_CHUNKS = (2, 13)
"""Pairs (the last call a single token: the fast step) and a chunk that divides neither the
stream, the window nor a block."""
SWEEP_KINDS = ("static", *(k for k in grid.CACHES if k != "static"))
"""Static first: the slow scenarios run on the dynamic kind only, so a bug any kind shows is
caught on static before them (a variant stops at its first failure).

>>> SWEEP_KINDS[:2], sorted(SWEEP_KINDS) == sorted(grid.CACHES)
(('static', 'dynamic'), True)
"""


def verify_passes(thorough: bool = False, seed: int = 0) -> list[dict]:
    """The axes of each :func:`run_suite` of ``verify``: every scenario in FP32, then
    :data:`FP64_SCENARIOS` in FP64; ``thorough``, everything in both on the thorough grid, with
    the weights of seed ``seed + 1``: the default run and the thorough one draw two sets.

    >>> [p["dtypes"] for p in verify_passes()], verify_passes()[1]["scenarios"]
    ([(torch.float32,), (torch.float64,)], ('stream', 'reference', 'invariant', 'imported'))
    >>> len(verify_passes(thorough=True)), verify_passes(True, seed=3)[0]["seeds"]
    (1, (4,))
    """
    if thorough:  # every implementation on every model that it serves
        return [dict(grid.THOROUGH, seeds=(seed + 1,), dtypes=DTYPES,
                     impls=tuple(grid.IMPLEMENTATIONS))]
    return [dict(seeds=(seed,), dtypes=(torch.float32,)),
            dict(seeds=(seed,), dtypes=(torch.float64,), scenarios=FP64_SCENARIOS,
                 chunks=FP64_CHUNKS)]


def run_passes(passes: Sequence[dict], variant: str | None = None,
               map_: Callable = map) -> SuiteReport:
    """:func:`run_suite` per pass, in one :class:`SuiteReport`; the implementation's as one run
    per seed and model through ``map_``, in the order one call would visit them."""
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


PROMPT = torch.tensor([[11, 3, 57, 20, 8, 91, 42, 5, 77]])
NEW = 5
BLOCK = 4
# one request a rank under DP-attention
LATENT_PROMPTS = torch.tensor([[11, 3, 57, 20, 8, 91, 42, 5, 77],
                               [60, 2, 33, 14, 70, 9, 25, 88, 1]])


class ProcessCheck(NamedTuple):
    """One run across processes: a variant (it must fail) or not."""

    name: str
    variant: bool
    what: str
    passed: bool

    @property
    def as_expected(self) -> bool:
        return self.passed != self.variant


LAYOUTS = (("tp=2, GQA 4/2", "llama", 2, 1), ("cp=2, GQA 4/2", "llama", 1, 2),
           ("tp=2, Q/K/V biases", "qwen2", 2, 1), ("cp=2, a window of 5", "mistral", 1, 2))
"""The decode layouts of the default run, ``(name, model, tp, cp)``: the branches a
configuration picks that 2 ranks reach."""
THOROUGH_LAYOUTS = (("tp=2, MQA: 1 K/V head on both ranks", "mqa", 2, 1),
                    ("tp=2, GPT-2: MHA, learned positions, biases", "gpt2", 2, 1),
                    ("tp=4, 2 K/V heads each on 2 ranks", "llama", 4, 1),
                    ("tp=4, GPT-2: 1 K/V head a rank, biases", "gpt2", 4, 1),
                    ("tp=2 cp=2, a window of 5", "mistral", 2, 2),
                    ("cp=4, a window of 5", "mistral", 1, 4))
"""What ``--thorough`` adds: K/V heads replicated, MHA, 4 ranks, TP and CP together."""
HANDOVERS = (("MQA: rank 0 alone sends the 1 K/V head", "mqa", 2, "recompute"),
             ("GPT-2: 2 K/V heads a message, biases", "gpt2", 2, "logits"))
"""The hand-overs the default run adds to llama's, ``(name, model, prefill tp, mode)``: what 2
prefill ranks reach in :mod:`kvdoc.parallel.blocks`."""
THOROUGH_HANDOVERS = (("a window of 5 over a prompt of 9", "mistral", 2, "logits"),
                      ("Q/K/V biases split with their heads", "qwen2", 2, "recompute"),
                      ("tp=4: 2 K/V heads on 2 ranks each", "llama", 4, "logits"),
                      ("tp=4, GPT-2: 1 K/V head a rank", "gpt2", 4, "recompute"))
"""What ``--thorough`` adds: a window, biases, 4 prefill ranks."""


def process_layouts(thorough: bool = False, variants: bool = True) -> list[tuple]:
    """``(name, model, tp, cp, parts)`` of each decode run (``parts`` None: correct ones).

    >>> [(name, tp * cp) for name, _, tp, cp, _ in process_layouts(variants=False)][:2]
    [('tp=2, GQA 4/2', 2), ('cp=2, GQA 4/2', 2)]
    >>> len(process_layouts(True, False)) - len(process_layouts(False, False))
    6
    """
    runs = [(*layout, None) for layout in LAYOUTS + (THOROUGH_LAYOUTS if thorough else ())]
    if variants:
        runs += [(name, b.model, b.tp, b.cp, b.parts) for name, b in PARALLEL_BROKEN.items()
                 if thorough or b.tp * b.cp == 2]
    return runs


def _decode_checks(thorough: bool, variants: bool, latent: list) -> tuple[list, list]:
    """Every decode layout, launched once per number of ranks (the latent jobs with 2 ranks)."""
    models: dict = {}
    jobs = [Job(name, models.setdefault(model, build_model(model)), PROMPT, NEW, tp, cp,
                *(() if parts is None else (parts,)))
            for name, model, tp, cp, parts in process_layouts(thorough, variants)]
    compared, latents = [], []
    for world in sorted({j.tp * j.cp for j in jobs}):
        these = [j for j in jobs if j.tp * j.cp == world]
        calls = [(rank_jobs, (these,))] + ([(rank_latent_jobs, (latent,))] if world == 2 else [])
        per_rank = launch(together, check_jobs(these), calls, backend="gloo")
        compared += compare_jobs(these, [r[0] for r in per_rank])
        latents = [r[1] for r in per_rank] if world == 2 else latents
    return compared, latents


def process_checks(variants: bool = True, thorough: bool = False) -> list[ProcessCheck]:
    """Run every check across processes (``variants``: the broken ones too)."""
    llama = build_model("llama")
    mla, wide = latent_model(), latent_model(config=WIDE)  # every width different
    latent = [LatentJob(f"latent, {mode}", mla, LATENT_PROMPTS, NEW, mode) for mode in MODES]
    latent += [LatentJob(f"latent, {mode}, widths that differ, query LoRA", wide,
                         LATENT_PROMPTS, NEW, mode) for mode in MODES]
    if variants:
        latent += [LatentJob(name, wide if b.widths_differ else mla, LATENT_PROMPTS,
                             NEW, b.mode, b.split, b.bytes_rule, b.heads)
                   for name, b in LATENT_BROKEN.items()]
    for j in latent:
        check_latent_job(j, 2)
    compared, latents = _decode_checks(thorough, variants, latent)
    out = [ProcessCheck(c.name if c.name in PARALLEL_BROKEN else f"parallel decode, {c.name}",
                        c.name in PARALLEL_BROKEN, "tokens, logits, each rank's K/V and bytes, "
                        "collectives, against one process", c.ok)
           for c in compared]
    out += [ProcessCheck(j.name, j.name in LATENT_BROKEN, "MLA tokens, logits and each rank's "
                         "latent against one process, latent bytes against the formula",
                         compare_latent(j, [r[i] for r in latents]).ok)
            for i, j in enumerate(latent)]
    handed = [(2, Handover(f"block hand-over, {mode}", llama, PROMPT, NEW, BLOCK,
                           mode)) for mode in ("logits", "recompute")]
    handed.append((2, Handover("block hand-over, pulled after 1 block", llama, PROMPT,
                               NEW, BLOCK, "recompute", transfer="pull", have=1)))
    handed += [(tp, Handover(f"block hand-over, {name}", build_model(model), PROMPT,
                             NEW, BLOCK, mode)) for name, model, tp, mode in
               HANDOVERS + (THOROUGH_HANDOVERS if thorough else ())]
    if variants:
        handed += [(2, Handover(name, llama, PROMPT, NEW, BLOCK, "logits", place))
                   for name, place in HANDOVER_BROKEN.items()]
        handed += [(2, Handover(name, llama, PROMPT, NEW, BLOCK, **fields))
                   for name, fields in PULL_BROKEN.items()]
    broken = {**HANDOVER_BROKEN, **PULL_BROKEN}
    out += [ProcessCheck(h.name, h.name in broken, "tokens and the decode rank's K/V against "
                         "one process, bytes and messages against the formula", h.ok)
            for h in handover_runs(handed)]
    hashes = {"offloaded blocks, chained keys": None}
    if variants:
        hashes.update(OFFLOAD_BROKEN)
    for name, hash_fn in hashes.items():
        with tempfile.TemporaryDirectory() as folder:
            store = TieredStore(device_blocks=4, host_blocks=4, folder=folder)
            kwargs = {} if hash_fn is None else {"hash_fn": hash_fn}
            served = multi_turn(llama, store, block_size=BLOCK, max_new_tokens=3, **kwargs)
            check = check_offload(llama, served, 3)
        out.append(ProcessCheck(name, hash_fn is not None, f"{check.requests} requests' tokens "
                                "and first logits against their runs without offloading",
                                check.ok))
    return out


def processes_table(checks: list[ProcessCheck]) -> str:
    """One Markdown row per check."""
    return markdown_table(
        ["run", "compares", "expected", "outcome"],
        [[c.name, c.what, "caught" if c.variant else "pass",
          ("caught" if not c.passed else "NOT caught") if c.variant
          else ("pass" if c.passed else "FAIL")] for c in checks])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", type=_variant, default=None, metavar="NAME",
                        help="run the suite on this broken variant instead (it must fail); "
                             "--list shows the names")
    parser.add_argument("--list", action="store_true", help="list the broken variants and exit")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the models' random weights (default 0)")
    parser.add_argument("--no-variants", action="store_true",
                        help="skip the broken variants (by default each must be caught)")
    parser.add_argument("--workers", type=_positive, default=min(2, os.cpu_count() or 1),
                        help="processes that share the runs (default: 2, or 1 on one core)")
    parser.add_argument("--thorough", action="store_true",
                        help=f"a longer stream ({grid.THOROUGH['length']} tokens), "
                             "more chunk sizes, batch 3 and 1, on seed SEED + 1's weights "
                             "(slower; CI runs it)")


def _variant(name: str) -> str:
    # not argparse's choices: they would spell every name in the usage line and the error
    if name not in VARIANTS:
        raise argparse.ArgumentTypeError(
            f"no broken variant {name!r}; --list shows the {len(VARIANTS)} names")
    return name


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def main(args: argparse.Namespace) -> int:
    """Run the suite, print its tables and a verdict; 0 only if everything is as expected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster than several that contend
    try:
        if args.list:
            for v in VARIANTS.values():
                print(f"{v.name:22s} {v.bug_class:26s} {v.breaks}")
            return 0
        start = time.perf_counter()
        # what the workers and the ranks run, imported once by the fork server they are forked
        # from (where there is one) instead of by each of them (seconds of torch and kvdoc each)
        multiprocessing.set_forkserver_preload([__name__])
        passes = verify_passes(args.thorough, args.seed)
        with worker_map(args.workers) as map_:
            return _report(args, passes, map_, start)
    except Exception as exc:  # the verifier's own failure still ends in a verdict
        print(f"VERDICT: FAIL (the verifier stopped: {type(exc).__name__}: {exc})")
        return 1
    finally:
        torch.set_num_threads(threads)
        stop_fork_server()


def _report(args: argparse.Namespace, passes: list[dict], map_: Callable, start: float) -> int:
    report = run_passes(passes, args.variant, map_)
    subject = f"broken variant {args.variant!r}" if args.variant else "the implementation"
    print(f"Suite on {subject}: {len(report.combinations)} combinations of model, cache kind, "
          f"implementation and dtype, weights of seed {passes[0]['seeds'][0]}, "
          f"{len(report.results)} checks, {report.seconds:.1f} s "
          f"({args.workers} worker process{'es' if args.workers > 1 else ''})")
    ran = list(zip(*report.combinations, strict=True)) or [(), (), (), ()]
    for axis, values in zip(("models", "cache kinds", "implementations", "dtypes"), ran,
                            strict=True):
        print(f"  {axis}: {', '.join(dict.fromkeys(values))}")
    print("  approximate caches: int8 (scenario int8, on the dynamic kind; its own contract: "
          "held rows bitwise, each element within half its row's step, each attention read "
          "within its derived bound)")
    print("  approximate caches: fp8 (scenario fp8, on the dynamic kind; e4m3 with per-head "
          "scales from the first prefill and per-tensor calibrated ones, e5m2 with calibrated "
          "ones; held rows and scales bitwise, each element within half a step or its "
          "saturation, each attention read within its derived bound)")
    print("  padded batches: left-padded prompts with a pad mask (scenario padded)")
    print("  alternative paths held to the function outside them: batch_invariant() full, "
          "chunked and left-padded vs the default full forward (scenario invariant, FP32 and "
          "FP64); from_transformers() of the exported model vs transformers (imported); a "
          "prompt re-served from the blocks evictions left vs one full forward (evicted, paged "
          "kind); speculative decoding's caches after its rounds vs fresh ones, and a perfect "
          "draft accepting everything (speculative)")
    print("  BF16 and FP16 passes: every model's weights rounded to BF16 and FP16, full and "
          "cached within the derived n u max|logit| of their FP64 value (scenario bf16, "
          "dynamic kind, in the FP32 run)")
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
    outcomes, swept, across, ran = _sweep_and_across(args, passes, map_)
    missed: list[str] = []
    if not args.no_variants:
        print(f"\nBroken variants (each must be caught; the slowest scenarios run last), "
              f"{swept:.1f} s:\n\n{variants_table(outcomes)}")
        caught = {o.name for o in outcomes if o.caught}
        missed = [name for name in VARIANTS if name not in caught]  # or never run
    problems = ([f"{len(report.failures)} failed checks ({', '.join(report.failed_checks())})"]
                if not report.passed else [])
    problems += [f"variants not caught: {', '.join(missed)}"] if missed else []
    added = ("" if args.thorough else " (--thorough adds decode at "
             f"{'; '.join(n for n, *_ in THOROUGH_LAYOUTS)}; hand-overs of "
             f"{'; '.join(n for n, *_ in THOROUGH_HANDOVERS)})")
    print(f"\nAcross processes (torch.distributed, gloo; launched from this process), "
          f"{ran:.1f} s{added}:\n\n{processes_table(across)}")
    wrong = [c.name for c in across if not c.as_expected]
    problems += [f"across processes, not as expected: {', '.join(wrong)}"] if wrong else []
    print(f"\nTotal: {time.perf_counter() - start:.1f} s")
    print("\nVERDICT: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return 0 if not problems else 1


def _sweep_and_across(args: argparse.Namespace, passes: list[dict],
                      map_: Callable) -> tuple[list, float, list[ProcessCheck], float]:
    """The sweep and :func:`process_checks`, each with its seconds: at once where workers
    sweep, as this process mostly waits on its ranks."""
    def sweep() -> tuple[list, float]:
        began = time.perf_counter()
        # a verdict needs each variant's first failure only
        outcomes = [] if args.no_variants else sweep_passes(
            [dict(axes, kinds=SWEEP_KINDS) for axes in passes], map_=map_)
        return outcomes, time.perf_counter() - began

    def across() -> tuple[list[ProcessCheck], float]:
        began = time.perf_counter()
        checks = process_checks(variants=not args.no_variants, thorough=args.thorough)
        return checks, time.perf_counter() - began

    if args.workers == 1:  # in this process, a thread would share the global RNG models seed
        return *sweep(), *across()
    with ThreadPoolExecutor(1) as background:
        swept = background.submit(sweep)  # the thread only waits on the workers
        checks, ran = across()
        return *swept.result(), checks, ran
