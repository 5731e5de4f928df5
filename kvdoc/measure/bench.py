"""``python -m kvdoc bench``: what the cache saves, timed on this machine, against its targets.

The command runs :func:`~kvdoc.measure.bench_run.run_bench`, prints the timing tables of
:mod:`kvdoc.measure.bench_tables` and the headline ratios beside
:data:`~kvdoc.measure.bench_result.TARGETS`, and writes every raw sample with ``--json``.
Nothing here asserts a speed: the exit status says only whether every ratio is a positive
number.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from .bench_result import TARGETS, BenchSettings
from .bench_run import run_bench
from .bench_tables import ablation_table, compiled_table, roofline_table, timings_table


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's options (every one with its help and default)."""
    d = BenchSettings()

    def listed(values: tuple[int, ...]) -> str:
        return ",".join(map(str, values))

    parser.add_argument("--json", metavar="PATH",
                        help="write the full results (raw samples included) here")
    parser.add_argument("--prefix-lens", type=_ints, default=d.prefix_lens, metavar="P,P,...",
                        help=f"prompt lengths P, each timed with G new tokens after it "
                             f"(default {listed(d.prefix_lens)})")
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens, metavar="G",
                        help=f"tokens decoded after each prompt, one step each "
                             f"(default {d.new_tokens})")
    parser.add_argument("--samples", type=int, default=d.samples, metavar="N",
                        help=f"timed samples per path (default {d.samples})")
    parser.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                        help=f"untimed warm-up runs per path (default {d.warmup})")
    parser.add_argument("--threads", type=int, default=d.threads, metavar="N",
                        help=f"torch threads while timing (default {d.threads})")
    parser.add_argument("--seed", type=int, default=d.seed, metavar="N",
                        help=f"seed of the random weights and the token stream "
                             f"(default {d.seed})")
    parser.add_argument("--growth-lengths", type=_ints, default=d.growth_lengths,
                        metavar="T,T,...",
                        help=f"total lengths T at which one step of each path is timed, for "
                             f"the growth fit (default {listed(d.growth_lengths)})")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip transformers' GPT-2 (timed by default on the same weights)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip the memory-bandwidth estimate on a 124M-parameter model")
    parser.add_argument("--roofline-samples", type=int, default=d.roofline_samples, metavar="N",
                        help=f"timed samples per path of the bandwidth estimate "
                             f"(default {d.roofline_samples})")
    parser.add_argument("--no-ablation", action="store_true",
                        help="skip the lean step with each of the fast step's changes undone")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip torch.compile of the model's forward (gpt-fast's fast step), "
                             "timed by default beside the fast and lean steps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print the ratios, write ``--json``; returns the exit status."""
    try:
        settings = BenchSettings(
            prefix_lens=args.prefix_lens, new_tokens=args.new_tokens, samples=args.samples,
            warmup=args.warmup, threads=args.threads, seed=args.seed,
            transformers=not args.no_transformers, growth_lengths=args.growth_lengths,
            roofline=not args.no_roofline, roofline_samples=args.roofline_samples,
            ablation=not args.no_ablation, compiled=not args.no_compile)
    except ValueError as err:
        print(f"kvdoc bench: {err}", file=sys.stderr)
        return 2
    result = run_bench(settings, progress=not args.no_progress)
    P = max(result.timings)
    print(f"kvdoc bench: P={P}, G={settings.new_tokens}, {settings.threads} thread(s), FP32, "
          f"{settings.samples} samples per path; {result.environment['cpu']}")
    tables = [timings_table(result, "p50"), timings_table(result, "p95")]
    if result.ablation is not None:
        tables.append(ablation_table(result.ablation))
    if result.roofline is not None:
        tables.append(roofline_table(result))
        if result.roofline["ablation"] is not None:
            tables.append(ablation_table(result.roofline["ablation"]))
    if result.compiled is not None:
        tables.append("time relative to the lean step, per-round median (middle rounds):\n"
                      + compiled_table(result))
    print("\n\n".join(tables))
    print()
    print("ratios (higher is better):")
    for key, value in result.ratios.items():
        target = f"   target >= {TARGETS[key]:g}: {'met' if value >= TARGETS[key] else 'not met'}" \
            if key in TARGETS else ""
        print(f"  {key:38s} {value:8.3f}{target}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=1)
        print(f"wrote {args.json}")
    bad = [k for k, v in result.ratios.items() if not (math.isfinite(v) and v > 0)]
    return 1 if bad else 0
