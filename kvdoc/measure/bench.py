"""``python -m kvdoc bench``: what the cache saves, timed on this machine, against its targets.

The command runs :func:`~kvdoc.measure.bench_run.run_bench`, prints the timing tables of
:mod:`kvdoc.measure.bench_tables` and the headline ratios beside
:data:`~kvdoc.measure.bench_run.TARGETS`, and writes every raw sample with ``--json``.
Nothing here asserts a speed: the exit status says only whether every ratio is a positive
number.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from .bench_run import TARGETS, BenchSettings, run_bench
from .bench_tables import ablation_table, compiled_table, roofline_table, timings_table


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


# BenchSettings fields set as --field-name: (metavar, help); each default is the field's
OPTIONS = {
    "prefix_lens": ("P,P,...", "prompt lengths P, each timed with G new tokens after it"),
    "new_tokens": ("G", "tokens decoded after each prompt, one step each"),
    "samples": ("N", "timed samples per path"),
    "warmup": ("N", "untimed warm-up runs per path"),
    "threads": ("N", "torch threads while timing"),
    "seed": ("N", "seed of the random weights and the token stream"),
    "growth_lengths": ("T,T,...", "total lengths T at which one step of each path is timed, "
                                  "for the growth fit"),
    "roofline_samples": ("N", "timed samples per path of the bandwidth estimate"),
}

# the measurements an option leaves out: the settings field it turns off
SKIPS = {
    "transformers": ("--no-transformers",
                     "skip transformers' GPT-2 (timed by default on the same weights)"),
    "roofline": ("--no-roofline", "skip the memory-bandwidth estimate on a 124M-parameter model"),
    "ablation": ("--no-ablation",
                 "skip the lean step with each of the fast step's changes undone"),
    "compiled": ("--no-compile", "skip torch.compile of the model's forward (gpt-fast's fast "
                                 "step), timed by default beside the fast and lean steps"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's options (every one with its help and default)."""
    parser.add_argument("--json", metavar="PATH",
                        help="write the full results (raw samples included) here")
    for name, (metavar, text) in OPTIONS.items():
        default = getattr(BenchSettings(), name)
        listed = isinstance(default, tuple)
        shown = ",".join(map(str, default)) if listed else default
        parser.add_argument("--" + name.replace("_", "-"), type=_ints if listed else int,
                            default=default, metavar=metavar, help=f"{text} (default {shown})")
    for name, (flag, text) in SKIPS.items():
        parser.add_argument(flag, dest=name, action="store_false", help=text)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print the ratios, write ``--json``; returns the exit status."""
    try:
        settings = BenchSettings(**{name: getattr(args, name) for name in (*OPTIONS, *SKIPS)})
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
    print("\n\n".join(tables) + "\n\nratios (higher is better):")
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
