"""``python -m kvdoc bench``: what the cache saves, timed on this machine, against its targets;
and the tables (Markdown) and figures (matplotlib) of a
:class:`~kvdoc.measure.bench_run.BenchResult`, for the savings page and the command.

The exit status says only whether every ratio is a positive number: no speed is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from typing import TYPE_CHECKING

from .bench_run import TARGETS, BenchSettings, run_bench
from .tables import log_log, log_y, markdown_table
from .timing import paired_ratio, percentile, two_figures

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .bench_run import BenchResult

PATH_LABELS = {"prefill": "prefill", "full_all": "full, all positions",
               "full_last": "full, last position", "transformers": "transformers, cached",
               "dynamic": "kvdoc, dynamic cache", "static": "kvdoc, static cache",
               "fast": "kvdoc, fast step", "lean": "lean step (no checks)",
               "compiled": "torch.compile(model), static cache"}
"""Readable names of the timed paths, for tables and figures."""

ABLATION_LABELS = {
    "reference": "reference step: the model's forward, static cache",
    "fast": "fast step: FastDecoder, with its checks",
    "unwatched": "fast step without its watch on the weights",
    "unchecked": "fast step without its input checks",
    "unguarded": "fast step without either guarantee",
    "lean": "lean step: the fast step's arithmetic, no checks",
    "no_pretranspose": "lean step, weights kept [out, in] (read transposed, as F.linear does)",
    "matmul_attention": "lean step, matmul / scale / softmax / matmul instead of one SDPA call",
}
"""Readable names of the ablation's variants."""


def timings_table(result: BenchResult, stat: str = "p50") -> str:
    """A row per path, a column per prefix P: the ``stat`` (p50 or p95) in ms."""
    if stat not in ("p50", "p95"):
        raise ValueError(f"stat must be 'p50' or 'p95', not {stat!r}")
    order = ("prefill", "full_all", "full_last", "dynamic", "static", "fast", "lean", "compiled",
             "transformers")
    paths = [p for p in order if all(p in v for v in result.timings.values())]
    header = [f"path ({stat})"] + [f"P = {P} (ms)" for P in result.timings]
    rows = [[PATH_LABELS[p]] + [f"{percentile(result.timings[P][p], int(stat[1:])):.3f}"
                                 for P in result.timings] for p in paths]
    return markdown_table(header, rows)


def counts_table(result: BenchResult) -> str:
    """Rows counted on ``c_attn`` and ``lm_head`` over the G steps, beside the closed form."""
    header = ["prefix P", "path", "c_attn (rows, counted)", "c_attn (rows, closed form)",
              "lm_head (rows, counted)"]
    rows = []
    for P, c in result.counts.items():
        for path, label, formula in (("full_all", "full, all positions", "formula_full"),
                                     ("full_last", "full, last position", "formula_full"),
                                     ("static", "cached", "formula_cached")):
            rows.append([P, label, f"{c[f'{path}_c_attn']:,}", f"{c[formula]:,}",
                         f"{c[f'{path}_lm_head']:,}"])
    return markdown_table(header, rows)


def flops_table(result: BenchResult) -> str:
    """Modelled MFLOPs of the G steps per path, split into linear layers, attention and LM head."""
    header = ["prefix P", "path", "linear (MFLOP)", "attention (MFLOP)", "LM head (MFLOP)",
              "total (MFLOP)"]
    rows = []
    for P, f in result.flops.items():
        for path, label in (("full_all", "full, all positions"),
                            ("full_last", "full, last position"), ("cached", "cached")):
            rows.append([P, label] + [f"{f[f'{path}_{part}'] / 1e6:.2f}"
                                      for part in ("linear", "attention", "lm_head")]
                        + [f"{f[path] / 1e6:.2f}"])
    return markdown_table(header, rows)


def roofline_table(result: BenchResult) -> str:
    """Per decode path of the roofline model: ms per token, the floor, and the fraction reached."""
    r = result.roofline
    if r is None:
        raise ValueError("this run has no roofline (settings.roofline was False)")
    header = ["path", "decode p50 (ms / token)", "floor (ms / token)", "achieved bandwidth (GB/s)",
              "fraction of measured bandwidth"]
    rows = [[PATH_LABELS[path], f"{t:.2f}", f"{r['floor_ms_per_token']:.2f}",
             f"{r['bytes_per_step'] / (t / 1e3) / 1e9:.2f}", two_figures(r["fraction"][path])]
            for path, t in r["p50_ms_per_token"].items()]
    return markdown_table(header, rows)


def ablation_table(ablation: dict) -> str:
    """Per variant of the decode step: p50 per step (µs), its time relative to the lean step
    and the band of the middle rounds; a variant whose band straddles 1 is named after the
    table, not shown as a result.

    >>> print(ablation_table({"p50_us_per_step": {"fast": 110.0, "lean": 100.0},
    ...                       "samples_ms": {"fast": [1.1, 1.2, 1.0], "lean": [1.0, 1.0, 1.0]},
    ...                       "steps": 10}))
    | decode step | p50 (µs / step) | time relative to the lean step | middle rounds |
    |---|---|---|---|
    | lean step: the fast step's arithmetic, no checks | 100.0 | 1 | 1 to 1 |
    <BLANKLINE>
    Not resolved in this run (their middle rounds straddle 1): fast step: FastDecoder, with
    its checks (1 to 1.2).
    """
    samples = ablation["samples_ms"]
    rows, unresolved = [], []
    for name, t in ablation["p50_us_per_step"].items():
        ratio = paired_ratio(samples[name], samples["lean"])
        band = f"{two_figures(ratio.low)} to {two_figures(ratio.high)}"
        if name != "lean" and not ratio.resolved:
            unresolved.append(f"{ABLATION_LABELS[name]} ({band})")
        else:
            rows.append([ABLATION_LABELS[name], f"{t:,.1f}", two_figures(ratio.median), band])
    header = ["decode step", "p50 (µs / step)", "time relative to the lean step",
              "middle rounds"]
    note = ("\n\n" + textwrap.fill("Not resolved in this run (their middle rounds straddle "
                                   f"1): {'; '.join(unresolved)}.", 88)) if unresolved else ""
    return markdown_table(header, rows) + note


def compiled_table(result: BenchResult) -> str:
    """gpt-fast's step beside kvdoc's, per rotation: compile cost, times relative to lean."""
    if result.compiled is None:
        raise ValueError("this run has no compiled step (settings.compiled was False)")
    header = ["rotation", "compile (first run, s)", "graphs", "compiled / lean",
              "fast step / lean", "compiled / fast step"]
    rows = []
    for where, info in result.compiled.items():
        label = "roofline model" if where == "roofline" else f"P = {where}"
        if "error" in info:
            rows.append([label, f"torch.compile failed: {info['error']}", "", "", "", ""])
            continue
        samples = (result.roofline["samples_ms"] if where == "roofline"
                   else result.timings[int(where)])

        def rel(a: str, b: str, samples: dict[str, list[float]] = samples) -> str:
            r = paired_ratio(samples[a], samples[b])
            band = f"{two_figures(r.median)} ({two_figures(r.low)} to {two_figures(r.high)})"
            return band if r.resolved else band + ", not resolved"
        rows.append([label, f"{info['first_run_s']:.1f}", info["graphs"],
                     rel("compiled", "lean"), rel("fast", "lean"), rel("compiled", "fast")])
    return markdown_table(header, rows)


def growth_figure(result: BenchResult) -> Figure:
    """Log-log plot of per-step p50 against total length, with the fitted slopes in the legend."""
    import matplotlib.pyplot as plt

    g = result.growth
    fig, ax = plt.subplots(figsize=(6.6, 4.4))
    labels = {"full_all": "full recompute (all positions)", "dynamic": "cached, dynamic",
              "static": "cached, static", "fast": "cached, fast step"}
    for path, marker in zip(g["p50_ms"], "os^D", strict=True):
        label = f"{labels[path]}: slope {g['slopes'][path]:.2f}"
        if g["slopes_upper"][path] is not None:
            label += f" (T ≥ {g['upper_from']}: {g['slopes_upper'][path]:.2f})"
        ax.plot(g["lengths"], g["p50_ms"][path], marker=marker, label=label)
    log_log(ax, g["lengths"], "total length T (positions)", "one step, p50 (ms)",
            "Per-step time against length (log-log)")
    fig.tight_layout()
    return fig


def timings_figure(result: BenchResult) -> Figure:
    """Dot plot of the G-step p50 per path and prefix length, on a log axis."""
    import matplotlib.pyplot as plt

    prefixes = list(result.timings)
    paths = [p for p in ("full_all", "full_last", "transformers", "dynamic", "static", "fast")
             if all(p in result.timings[P] for P in prefixes)]
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    width = 0.8 / len(paths)
    for i, (path, marker) in enumerate(zip(paths, "osD^vP", strict=False)):
        xs = [k + (i - (len(paths) - 1) / 2) * width for k in range(len(prefixes))]
        ax.plot(xs, [result.p50(P, path) for P in prefixes], ls="none", marker=marker, ms=7,
                label=PATH_LABELS[path])
    ax.set_xticks(range(len(prefixes)), [str(P) for P in prefixes])
    log_y(ax)
    ax.set_xlabel("prefix length P (tokens)")
    ax.set_ylabel(f"{result.settings.new_tokens} steps, p50 (ms)")
    ax.set_title("Consuming G fixed tokens after the prefix")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    # below the axes: inside, it would hide the dots of the shortest prefix
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    return fig


# --- the command ------------------------------------------------------------------------------

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
