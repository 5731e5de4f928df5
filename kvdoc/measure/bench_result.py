"""What one benchmark run returns: its raw samples and summaries (:class:`BenchResult`), the
headline ratios (:func:`ratios`) and the ratios the fast step aims for (:data:`TARGETS`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .timing import percentile

if TYPE_CHECKING:
    from .bench_run import BenchSettings

TARGETS = {"fast_vs_transformers": 4.5, "fast_vs_full_all_positions": 17.0,
           "bandwidth_fraction_fast": 0.6, "fast_vs_transformers_124m": 1.3,
           "fast_vs_lean": 1 / 1.15}
"""Ratios the fast step aims for (at least), on a quiet machine; ``--json`` records each verdict.
``fast_vs_lean`` at least 1 / 1.15: the fast step's checks cost at most 15% of the lean step's
time."""


@dataclass
class BenchResult:
    """Everything one run measured; :meth:`to_json` is what ``--json`` writes.

    ``timings[P][path]`` holds the raw samples in milliseconds (a whole ``G``-step run for the
    decode paths, one call for prefill); ``ratios`` holds the headline figures (higher is better).
    """

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

    def p50(self, prefix_len: int, path: str) -> float:
        """Median of a path's samples at one prefix length, in ms."""
        return percentile(self.timings[prefix_len][path], 50)

    def p95(self, prefix_len: int, path: str) -> float:
        """95th percentile of a path's samples at one prefix length, in ms."""
        return percentile(self.timings[prefix_len][path], 95)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: configuration, environment, timestamp, raw samples, summaries,
        ratios."""
        settings = asdict(self.settings)
        summary = {str(p): {path: {"p50_ms": self.p50(p, path), "p95_ms": self.p95(p, path)}
                            for path in paths} for p, paths in self.timings.items()}
        return {
            "ratios": self.ratios,
            "targets": {key: {"target": t, "measured": self.ratios.get(key),
                              "met": key in self.ratios and self.ratios[key] >= t}
                        for key, t in TARGETS.items()},
            "config": settings,
            "environment": self.environment,
            "timestamp": self.timestamp,
            "summary": summary,
            "samples_ms": {str(p): paths for p, paths in self.timings.items()},
            "final_kv_kib": {str(p): v for p, v in self.kv_kib.items()},
            "max_abs_logit_diff": {str(p): v for p, v in self.max_abs_diff.items()},
            "counts": {str(p): v for p, v in self.counts.items()},
            "flops": {str(p): v for p, v in self.flops.items()},
            "growth": self.growth,
            "roofline": self.roofline,
            "ablation": self.ablation,
            "aten_ops_per_step": self.ops,
        }


def ratios(result: BenchResult) -> dict[str, float]:
    """Headline figures at the largest prefix length, each a speed-up or fraction (higher is
    better).

    ``cached_vs_*``: the other path's p50 over the faster of kvdoc's two caches' p50 for the
    ``G`` steps; ``fast_vs_*``: the same over the fast step's p50 (``fast_vs_lean``, below 1, is
    the share of the lean step's speed the fast step keeps with its checks);
    ``bandwidth_fraction*``: the bandwidth floor over a path's decode time per token on the
    roofline model (1 would read weights and K/V at the measured bandwidth); ``*_124m``: on
    the roofline model.
    """
    P = max(result.timings)
    p50 = {path: result.p50(P, path) for path in result.timings[P]}
    best = min(p50["dynamic"], p50["static"])
    out = {"cached_vs_full_all_positions": p50["full_all"] / best,
           "cached_vs_full_last_position": p50["full_last"] / best,
           "static_vs_dynamic": p50["dynamic"] / p50["static"],
           "fast_vs_full_all_positions": p50["full_all"] / p50["fast"],
           "fast_vs_static": p50["static"] / p50["fast"],
           "fast_vs_lean": p50["lean"] / p50["fast"]}
    if "transformers" in p50:
        out["cached_vs_transformers"] = p50["transformers"] / best
        out["fast_vs_transformers"] = p50["transformers"] / p50["fast"]
    if result.roofline is not None:
        fraction, per_token = result.roofline["fraction"], result.roofline["p50_ms_per_token"]
        out["bandwidth_fraction"] = max(fraction["dynamic"], fraction["static"])
        out["bandwidth_fraction_fast"] = fraction["fast"]
        out["bandwidth_fraction_lean"] = fraction["lean"]
        out["fast_vs_lean_124m"] = per_token["lean"] / per_token["fast"]
        if "transformers" in fraction:
            out["bandwidth_fraction_transformers"] = fraction["transformers"]
            out["bandwidth_fraction_vs_transformers"] = (out["bandwidth_fraction"]
                                                         / fraction["transformers"])
            out["fast_vs_transformers_124m"] = per_token["transformers"] / per_token["fast"]
    return {k: float(v) for k, v in out.items()}
