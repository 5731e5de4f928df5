"""What the cache saves, measured: decode paths timed side by side, growth, the bandwidth estimate.

One fixed token stream, batch 1, FP32, on the CPU, a fixed thread count, the model in ``eval()``
under ``torch.inference_mode()``:

* **prefill**: ``P`` prompt tokens in one call, filling a cache;
* **full recompute**, ``G`` steps: step ``j`` runs the whole prefix of ``P + j`` tokens again,
  projecting every position to the vocabulary (``full_all``, the naive baseline) or only the
  last (``full_last``);
* **cached continuation**, ``G`` one-token steps from the prefix cache: ``dynamic``,
  ``static``, the :class:`~kvdoc.core.fast.FastDecoder` (``fast``), the same arithmetic without
  checks (``lean``, :class:`~kvdoc.measure.ablation.LeanStep`) and ``torch.compile`` of the
  model's forward (``compiled``, gpt-fast's fast step, its compile time reported apart);
* **transformers**: its ``GPT2LMHeadModel`` on the same weights, the reference a user would
  otherwise pick.

:func:`run_bench` returns every raw sample with the settings, the environment, a timestamp and
the headline ratios. Nothing here asserts a speed: timings are measurements.
"""

from __future__ import annotations

import datetime as _dt
import gc
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from kvdoc.core.fast import FastDecoder
from kvdoc.core.model import Decoder

from .ablation import ABLATION, GUARANTEES
from .bench_result import BenchResult, BenchSettings, ratios
from .costs import RowCounter, projected_positions_full, run_flops, step_bytes
from .decode_paths import ablation_paths, build_models, decode_paths, ops_per_step, token_stream
from .timing import environment, percentile, time_paths


def _bench_prefix(model: Decoder, fast: FastDecoder, hf: Any, settings: BenchSettings,
                  prefix_len: int, tick: Callable[[], None], ablation: bool = False,
                  compiled: Callable[..., Any] | None = None
                  ) -> tuple[dict[str, list[float]], float, dict[str, float], dict[str, int],
                             dict[str, Any] | None]:
    """One prefix length's paths in one rotation (``ablation``: with the ablation's variants);
    the last value is what compiling ``compiled`` cost."""
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
    """Take the ablation's variants out of one rotation's samples (timed beside the other paths,
    so all saw the same load); the ablation's summary."""
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
