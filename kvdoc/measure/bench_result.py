"""What one benchmark run is asked (:class:`BenchSettings`) and returns (:class:`BenchResult`),
its headline ratios and the ratios the fast step aims for (:data:`TARGETS`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvdoc.core.cache import check_int
from kvdoc.core.model import GPTConfig

from .timing import percentile

TARGETS = {"fast_vs_transformers": 4.5, "fast_vs_full_all_positions": 17.0,
           "bandwidth_fraction_fast": 0.6, "fast_vs_transformers_124m": 1.3,
           "fast_vs_lean": 1 / 1.15}
"""Ratios the fast step aims for (at least), on a quiet machine; ``--json`` records each verdict.
``fast_vs_lean`` at least 1 / 1.15: the fast step's checks cost at most 15% of the lean step's
time."""


GPT2_SMALL = GPTConfig(vocab_size=50257, n_positions=1024, n_layer=12, n_head=12, n_embd=768,
                       n_inner=3072)
"""GPT-2 small's shape; with the LM head tied to ``wte`` it has 124,439,808 parameters."""


@dataclass(frozen=True)
class BenchSettings:
    """What to measure. The defaults are the CLI's; pages and tests pass smaller ones.

    Each prompt length ``P`` in ``prefix_lens`` is followed by ``new_tokens`` (``G``) fixed
    tokens; every path is timed ``samples`` times after ``warmup`` untimed runs, on ``threads``
    torch threads (restored afterwards), on ``model`` (default: the 145,280-parameter one) with
    weights and tokens seeded by ``seed``. ``transformers`` adds transformers' GPT-2;
    ``growth_lengths`` are the total lengths ``T`` at which one step of each path is timed
    ``growth_samples`` times. ``roofline`` adds the memory-bandwidth estimate on ``roofline_model``
    (GPT-2 small's shape, tied head): ``roofline_steps`` decode steps after ``roofline_context``
    positions, ``roofline_samples`` times, beside a reduction over ``bandwidth_mib`` MiB.
    ``ablation`` also times the lean step with each of the fast step's changes undone (in the
    largest prefix's rotation and the roofline's); ``compiled`` times ``torch.compile`` of the
    model's forward over a static cache (gpt-fast's fast step) in every rotation, its compile
    time reported apart (:attr:`BenchResult.compiled`).
    """

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
    """Everything one run measured; :meth:`to_json` is what ``--json`` writes.

    ``timings[P][path]`` holds the raw samples in milliseconds (a whole ``G``-step run for the
    decode paths, one call for prefill); ``ratios`` holds the headline figures (higher is better).
    ``compiled`` says what ``torch.compile`` cost per rotation (a prefix length, or
    ``"roofline"``): ``first_run_s`` and ``graphs``, or ``error`` where it failed (None: not
    asked for).
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
    compiled: dict[str, dict[str, Any]] | None = None

    def p50(self, prefix_len: int, path: str) -> float:
        """Median of a path's samples at one prefix length, in ms."""
        return percentile(self.timings[prefix_len][path], 50)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: every field (under :data:`JSON_NAMES`), each ratio's verdict
        against :data:`TARGETS` and each path's p50 and p95."""
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
    """Headline figures at the largest prefix length, each a speed-up or fraction (higher is
    better).

    ``cached_vs_*``: the other path's p50 over the faster of kvdoc's two caches' p50 for the
    ``G`` steps; ``fast_vs_*``: the same over the fast step's p50 (``fast_vs_lean``, below 1, is
    the share of the lean step's speed the fast step keeps with its checks);
    ``compiled_vs_*``: the same over the ``torch.compile`` step's p50, where it compiled;
    ``bandwidth_fraction*``: the bandwidth estimate over a path's decode time per token on the
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
