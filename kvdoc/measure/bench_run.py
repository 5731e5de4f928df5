"""What the cache saves, measured: decode paths timed side by side, growth, the bandwidth estimate.

One fixed token stream, batch 1, FP32, on the CPU, a fixed thread count, in inference mode:

* **prefill**: ``P`` prompt tokens in one call;
* **full recompute**, ``G`` steps, step ``j`` running all ``P + j`` tokens again and projecting
  every position (``full_all``) or only the last (``full_last``);
* **cached**, ``G`` one-token steps: ``dynamic``, ``static``, ``fast``
  (:class:`~kvdoc.core.fast.FastDecoder`), ``lean`` (its arithmetic without checks) and
  ``compiled`` (``torch.compile`` of the forward, gpt-fast's step);
* **transformers**: its ``GPT2LMHeadModel`` on the same weights.

:func:`run_bench` returns every raw sample and the headline ratios (:class:`BenchResult`),
beside the ratios the fast step aims for (:data:`TARGETS`). Nothing here asserts a speed.
"""

from __future__ import annotations

import datetime as _dt
import gc
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from kvdoc.core.cache import check_int
from kvdoc.core.fast import FastDecoder
from kvdoc.core.model import Decoder, GPTConfig

from .costs import RowCounter, projected_positions_full, run_flops, step_bytes
from .decode_paths import (
    ABLATION,
    GUARANTEES,
    ablation_paths,
    build_models,
    decode_paths,
    ops_per_step,
    token_stream,
)
from .timing import environment, percentile, time_paths

TARGETS = {"fast_vs_transformers": 4.5, "fast_vs_full_all_positions": 17.0,
           "bandwidth_fraction_fast": 0.6, "fast_vs_transformers_124m": 1.3,
           "fast_vs_lean": 1 / 1.15}
"""Ratios the fast step aims for (at least), on a quiet machine (``fast_vs_lean``: its checks
cost at most 15% of the lean step's time); ``--json`` records each verdict."""


GPT2_SMALL = GPTConfig(vocab_size=50257, n_positions=1024, n_layer=12, n_head=12, n_embd=768,
                       n_inner=3072)
"""GPT-2 small's shape; with the LM head tied to ``wte`` it has 124,439,808 parameters."""


@dataclass(frozen=True)
class BenchSettings:
    """What to measure (the defaults are the CLI's). Each prompt length ``P`` in ``prefix_lens``
    is followed by ``new_tokens`` (``G``) fixed tokens; every path is timed ``samples`` times
    after ``warmup`` runs. ``growth_lengths``: the total lengths at which one step of each path
    is timed; ``roofline``: the bandwidth estimate on ``roofline_model``, ``roofline_steps``
    steps after ``roofline_context`` positions, beside a reduction over ``bandwidth_mib`` MiB;
    ``ablation``: the lean step with each of the fast step's changes undone; ``compiled``:
    ``torch.compile`` of the model's forward (gpt-fast's fast step)."""

    prefix_lens: tuple[int, ...] = (16, 64, 128, 256)
    new_tokens: int = 16
    samples: int = 31
    warmup: int = 3
    threads: int = 1
    seed: int = 0
    model: GPTConfig = field(default_factory=GPTConfig)
    transformers: bool = True
    growth_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    growth_samples: int = 15
    roofline: bool = True
    roofline_model: GPTConfig = GPT2_SMALL
    roofline_context: int = 128
    roofline_steps: int = 8
    roofline_samples: int = 7
    bandwidth_mib: int = 512
    ablation: bool = True
    compiled: bool = True

    def __post_init__(self) -> None:
        for name in ("new_tokens", "samples", "threads", "growth_samples", "roofline_steps",
                     "roofline_samples", "bandwidth_mib", "roofline_context"):
            check_int(name, getattr(self, name))
        check_int("warmup", self.warmup, minimum=0)
        object.__setattr__(self, "prefix_lens", tuple(self.prefix_lens))
        object.__setattr__(self, "growth_lengths", tuple(self.growth_lengths))
        if not self.prefix_lens:
            raise ValueError("prefix_lens is empty")
        for p in self.prefix_lens:
            if not isinstance(p, int) or p < 1 or p + self.new_tokens > self.model.n_positions:
                raise ValueError(f"prefix length {p!r} + {self.new_tokens} new tokens does not fit "
                                 f"1 .. {self.model.n_positions} positions")
        for t in self.growth_lengths:
            if not isinstance(t, int) or t < 2 or t > self.model.n_positions:
                raise ValueError(f"growth length {t!r} must lie in 2 .. {self.model.n_positions}")
        if self.roofline_context + self.roofline_steps > self.roofline_model.n_positions:
            raise ValueError("roofline_context + roofline_steps exceeds the roofline model's "
                             "positions")


@dataclass
class BenchResult:
    """Everything one run measured (:meth:`to_json`: what ``--json`` writes): ``timings[P][path]``
    the raw samples in ms, ``ratios`` the headline figures, ``compiled`` what compiling cost."""

    settings: BenchSettings
    environment: dict[str, Any]
    timestamp: str
    timings: dict[int, dict[str, list[float]]]
    kv_kib: dict[int, float]
    max_abs_diff: dict[int, dict[str, float]]
    counts: dict[int, dict[str, int]]
    flops: dict[int, dict[str, float]]
    growth: dict[str, Any]
    roofline: dict[str, Any] | None
    ablation: dict[str, Any] | None
    ops: dict[str, int]
    ratios: dict[str, float]
    compiled: dict[str, dict[str, Any]] | None = None

    def p50(self, prefix_len: int, path: str) -> float:
        """Median of a path's samples at one prefix length, in ms."""
        return percentile(self.timings[prefix_len][path], 50)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: every field, each ratio's verdict, each path's p50 and p95."""
        summary = {p: {path: {"p50_ms": self.p50(p, path), "p95_ms": percentile(samples, 95)}
                       for path, samples in paths.items()} for p, paths in self.timings.items()}
        return {**{JSON_NAMES.get(k, k): v for k, v in asdict(self).items()},
                "targets": {key: {"target": t, "measured": self.ratios.get(key),
                                  "met": key in self.ratios and self.ratios[key] >= t}
                            for key, t in TARGETS.items()},
                "summary": summary}


JSON_NAMES = {"settings": "config", "timings": "samples_ms", "kv_kib": "final_kv_kib",
              "max_abs_diff": "max_abs_logit_diff", "ops": "aten_ops_per_step"}
"""The ``--json`` key of each :class:`BenchResult` field that is named otherwise there (the
integer prefix lengths become strings, as JSON keys)."""


def ratios(result: BenchResult) -> dict[str, float]:
    """Headline figures at the largest prefix length (higher is better): ``X_vs_Y`` is Y's p50
    over X's (``cached``: the faster of kvdoc's two caches); ``bandwidth_fraction*``: the
    bandwidth floor over a path's time per token; ``*_124m``: on the roofline model."""
    P = max(result.timings)
    p50 = {path: result.p50(P, path) for path in result.timings[P]}
    best = min(p50["dynamic"], p50["static"])
    out = {"cached_vs_full_all_positions": p50["full_all"] / best,
           "cached_vs_full_last_position": p50["full_last"] / best,
           "static_vs_dynamic": p50["dynamic"] / p50["static"],
           "fast_vs_full_all_positions": p50["full_all"] / p50["fast"],
           "fast_vs_static": p50["static"] / p50["fast"],
           "fast_vs_lean": p50["lean"] / p50["fast"]}
    if "compiled" in p50:
        out["compiled_vs_lean"] = p50["lean"] / p50["compiled"]
        out["compiled_vs_fast"] = p50["fast"] / p50["compiled"]
    if "transformers" in p50:
        out["cached_vs_transformers"] = p50["transformers"] / best
        out["fast_vs_transformers"] = p50["transformers"] / p50["fast"]
    if result.roofline is not None:
        fraction, per_token = result.roofline["fraction"], result.roofline["p50_ms_per_token"]
        out["bandwidth_fraction"] = max(fraction["dynamic"], fraction["static"])
        out["bandwidth_fraction_fast"] = fraction["fast"]
        out["bandwidth_fraction_lean"] = fraction["lean"]
        out["fast_vs_lean_124m"] = per_token["lean"] / per_token["fast"]
        if "compiled" in per_token:
            out["compiled_vs_lean_124m"] = per_token["lean"] / per_token["compiled"]
            out["compiled_vs_fast_124m"] = per_token["fast"] / per_token["compiled"]
        if "transformers" in fraction:
            out["bandwidth_fraction_transformers"] = fraction["transformers"]
            out["bandwidth_fraction_vs_transformers"] = (out["bandwidth_fraction"]
                                                         / fraction["transformers"])
            out["fast_vs_transformers_124m"] = per_token["transformers"] / per_token["fast"]
    return {k: float(v) for k, v in out.items()}


def _bench_prefix(model: Decoder, fast: FastDecoder, hf: Any, settings: BenchSettings,
                  prefix_len: int, tick: Callable[[], None], ablation: bool = False,
                  compiled: Callable[..., Any] | None = None
                  ) -> tuple[dict[str, list[float]], float, dict[str, float], dict[str, int],
                             dict[str, Any] | None]:
    """One prefix length's paths in one rotation, and what compiling ``compiled`` cost."""
    G = settings.new_tokens
    ids = token_stream(model.config, prefix_len + G, settings.seed + prefix_len)
    prepare, runs, compile_info = decode_paths(model, hf, ids, prefix_len, G, True, fast,
                                               compiled)
    if ablation:
        more = ablation_paths(model, ids, prefix_len, G)
        prepare.update(more[0])
        runs.update(more[1])
    reference = model(ids).logits[:, prefix_len:]  # [1, G, V]: one full forward of the whole stream
    diffs = {name: float((run() - reference).abs().max()) for name, run in runs.items()}
    counts: dict[str, int] = {}
    for name in ("full_all", "full_last", "dynamic", "static"):
        with RowCounter(model) as rows:
            runs[name]()
        counts[f"{name}_c_attn"] = rows.counts["c_attn"]
        counts[f"{name}_lm_head"] = rows.counts["lm_head"]
    counts["formula_full"] = projected_positions_full(prefix_len, G)
    counts["formula_cached"] = G
    final = model(ids, model.new_cache(1, "dynamic"))[1]
    samples = time_paths(prepare, settings.samples, settings.warmup, tick)
    return samples, final.nbytes() / 1024, diffs, counts, compile_info


GROWTH_PATHS = ("full_all", "dynamic", "static", "fast")


def _bench_growth(model: Decoder, fast: FastDecoder, settings: BenchSettings,
                  tick: Callable[[], None]) -> dict[str, Any]:
    """Per-step time at total length ``T``: full recompute of ``T`` positions vs one cached step."""
    per_len: dict[str, dict[str, list[float]]] = {}
    for T in settings.growth_lengths:
        ids = token_stream(model.config, T, settings.seed + 7919 + T)
        prepare = decode_paths(model, None, ids, T - 1, 1, True, fast)[0]
        prepare = {path: prepare[path] for path in GROWTH_PATHS}
        per_len[str(T)] = time_paths(prepare, settings.growth_samples, settings.warmup, tick)
    lengths = np.log(np.asarray(settings.growth_lengths, dtype=float))
    # the longer half (at least two points), where fixed costs matter least
    upper = len(lengths) // 2
    p50 = {path: [percentile(per_len[str(T)][path], 50) for T in settings.growth_lengths]
           for path in GROWTH_PATHS}
    slopes = {path: float(np.polyfit(lengths, np.log(p50[path]), 1)[0]) for path in GROWTH_PATHS}
    slopes_upper = {path: float(np.polyfit(lengths[upper:], np.log(p50[path][upper:]), 1)[0])
                    if len(lengths) >= 4 else None for path in GROWTH_PATHS}
    return {"lengths": list(settings.growth_lengths), "samples_ms": per_len, "slopes": slopes,
            "slopes_upper": slopes_upper, "upper_from": settings.growth_lengths[upper],
            "p50_ms": p50}


VARIANTS = (*GUARANTEES, *ABLATION)
"""The ablation's own paths: the fast step less a guarantee, the lean step less a change."""
ABLATION_ROWS = {"reference": "static", "fast": "fast", **{k: k for k in GUARANTEES},
                 "lean": "lean", **{k: k for k in ABLATION}}
"""Ablation row -> the timed path it reads (the reference step is the static-cache path)."""


def _split_ablation(samples: dict[str, list[float]], diffs: dict[str, float] | None,
                    steps: int) -> dict[str, Any]:
    """Take the ablation's variants out of one rotation's samples; the ablation's summary."""
    rows = {row: samples[path] for row, path in ABLATION_ROWS.items()}
    for name in VARIANTS:
        del samples[name]
    per_step = {row: percentile(v, 50) / steps * 1e3 for row, v in rows.items()}
    out: dict[str, Any] = {"steps": steps, "samples_ms": rows, "p50_us_per_step": per_step}
    if diffs is not None:
        out["max_abs_logit_diff"] = {row: diffs.pop(path) if path in VARIANTS else diffs[path]
                                     for row, path in ABLATION_ROWS.items()}
    return out


def _bench_roofline(settings: BenchSettings, tick: Callable[[], None],
                    build_threads: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    timed_threads = torch.get_num_threads()
    torch.set_num_threads(build_threads)  # random init of 124M parameters is not what is measured
    try:
        model, hf = build_models(settings.roofline_model, settings.seed, settings.transformers,
                                 tie=True)
        fast = FastDecoder(model)
    finally:
        torch.set_num_threads(timed_threads)
    C, S = settings.roofline_context, settings.roofline_steps
    ids = token_stream(model.config, C + S, settings.seed + 1)
    prepare, _, compile_info = decode_paths(model, hf, ids, C, S, False, fast,
                                            torch.compile(model) if settings.compiled else None)
    if settings.ablation:
        prepare.update(ablation_paths(model, ids, C, S)[0])
    # Bandwidth is one more path of the rotation, so it sees the same machine state as decode.
    x = torch.ones(settings.bandwidth_mib * 2**20 // 4, dtype=torch.float32)
    nbytes = x.numel() * x.element_size()
    prepare["bandwidth"] = lambda x=x: x.sum
    del x  # the bandwidth path holds the only reference; dropped after the timing below
    samples = time_paths(prepare, settings.roofline_samples, min(settings.warmup, 1), tick)
    del prepare["bandwidth"]  # frees the tensor
    bw_times = [t / 1e3 for t in samples.pop("bandwidth")]
    ablation = _split_ablation(samples, None, S) if settings.ablation else None
    bandwidth = {"bytes": nbytes, "kernel": "torch.sum over a float32 tensor",
                 "samples_s": bw_times,
                 "gb_per_s": nbytes / percentile(bw_times, 50) / 1e9}
    mean_bytes = sum(step_bytes(model, C + j) for j in range(S)) / S
    floor_ms = mean_bytes / (bandwidth["gb_per_s"] * 1e9) * 1e3
    per_token = {path: percentile(v, 50) / S for path, v in samples.items()}
    fraction = {path: floor_ms / t for path, t in per_token.items()}
    out = {"model": asdict(settings.roofline_model), "parameters": model.num_parameters(),
           "context": C, "steps": S, "samples_ms": samples, "bandwidth": bandwidth,
           "bytes_per_step": mean_bytes, "floor_ms_per_token": floor_ms,
           "p50_ms_per_token": per_token, "fraction": fraction, "ablation": ablation}
    del model, hf, fast
    gc.collect()
    return out, compile_info


def run_bench(settings: BenchSettings | None = None, progress: bool = False) -> BenchResult:
    """Run every measurement once and return the raw results and the headline ratios
    (``progress``: a tqdm bar on stderr).

    >>> s = BenchSettings(prefix_lens=(4,), new_tokens=2, samples=2, warmup=0, transformers=False,
    ...                   growth_lengths=(4, 8), growth_samples=1, roofline=False, ablation=False,
    ...                   compiled=False)
    >>> r = run_bench(s)
    >>> r.counts[4]["full_all_lm_head"] == projected_positions_full(4, 2) == 2 * 4 + 3
    True
    >>> sorted(r.ratios)  # doctest: +NORMALIZE_WHITESPACE
    ['cached_vs_full_all_positions', 'cached_vs_full_last_position', 'fast_vs_full_all_positions',
     'fast_vs_lean', 'fast_vs_static', 'static_vs_dynamic']
    """
    settings = settings or BenchSettings()
    from tqdm import tqdm

    n_paths = 7 + int(settings.transformers) + int(settings.compiled)
    n_ablation = len(VARIANTS) if settings.ablation else 0
    total = (len(settings.prefix_lens) * settings.samples * n_paths + settings.samples * n_ablation
             + len(settings.growth_lengths) * settings.growth_samples * len(GROWTH_PATHS)
             + (settings.roofline_samples * (5 + int(settings.transformers) + int(settings.compiled)
                                              + n_ablation)
                if settings.roofline else 0))
    threads = torch.get_num_threads()
    bar = tqdm(total=total, disable=not progress, file=sys.stderr, unit="sample",
               desc="kvdoc bench")
    try:
        torch.set_num_threads(settings.threads)
        with torch.inference_mode():
            model, hf = build_models(settings.model, settings.seed, settings.transformers)
            fast = FastDecoder(model)
            compiled_step = torch.compile(model) if settings.compiled else None
            compiled = {} if settings.compiled else None
            env = environment()
            stamp = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
            timings, kv_kib, diffs, counts, flops = {}, {}, {}, {}, {}
            P_max, ablation = max(settings.prefix_lens), None
            for P in settings.prefix_lens:
                bar.set_postfix_str(f"P={P}")
                with_ablation = settings.ablation and P == P_max
                timings[P], kv_kib[P], diffs[P], counts[P], info = _bench_prefix(
                    model, fast, hf, settings, P, bar.update, with_ablation, compiled_step)
                if compiled is not None:
                    compiled[str(P)] = info
                if with_ablation:
                    ablation = {"prefix_len": P, **_split_ablation(timings[P], diffs[P],
                                                                   settings.new_tokens)}
                flops[P] = run_flops(settings.model, P, settings.new_tokens)
            ops = ops_per_step(model, fast, hf,
                               token_stream(model.config, P_max + 1, settings.seed))
            bar.set_postfix_str("growth")
            growth = _bench_growth(model, fast, settings, bar.update)
            del model, hf, fast, compiled_step
            roofline = None
            if settings.roofline:
                bar.set_postfix_str("roofline")
                roofline, info = _bench_roofline(settings, bar.update, threads)
                if compiled is not None:
                    compiled["roofline"] = info
    finally:
        torch.set_num_threads(threads)
        bar.close()
    result = BenchResult(settings, env, stamp, timings, kv_kib, diffs, counts, flops, growth,
                         roofline, ablation, ops, {}, compiled)
    result.ratios = ratios(result)
    return result
