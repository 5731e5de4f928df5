"""The timing harness: rotated sampling of timed paths, percentiles and the environment they ran in.

:func:`time_paths` samples the paths in rounds whose order rotates, so every path sees the same
drift in the machine's load; :func:`paired_ratio` compares two paths round by round, and the
spread of those ratios says whether the machine resolved the difference at all.
"""

from __future__ import annotations

import gc
import importlib.metadata
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def percentile(samples: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation) of ``samples`` as a Python float.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.5
    """
    values = list(samples)
    if not values:
        raise ValueError("no samples")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def two_figures(x: float) -> str:
    """A measured ratio to two significant figures: few samples on a shared machine carry no
    third.

    >>> two_figures(1.046), two_figures(12.34), two_figures(0.4567), two_figures(123.4)
    ('1', '12', '0.46', '120')
    """
    return f"{float(f'{x:.2g}'):g}"


@dataclass(frozen=True)
class Ratio:
    """How many times as long one path took as another, from rounds that timed both: ``low``
    and ``high`` bound the middle 80% of the per-round ratios (all under ten rounds); the
    difference is *resolved* only if that band lies on one side of 1.

    >>> str(Ratio(2.04, 1.9, 2.2, 31))
    '2 (1.9 to 2.2 over 31 rounds)'
    >>> Ratio(1.02, 0.95, 1.1, 7).resolved, str(Ratio(1.02, 0.95, 1.1, 7))
    (False, 'not resolved on this machine (0.95 to 1.1 over 7 rounds)')
    """

    median: float
    low: float
    high: float
    rounds: int

    @property
    def resolved(self) -> bool:
        return self.low > 1 or self.high < 1

    @property
    def spread(self) -> str:
        return f"{two_figures(self.low)} to {two_figures(self.high)} over {self.rounds} rounds"

    def speed_of(self, other: str) -> str:
        """A phrase for "the faster path ran at ... ", true whichever way the rounds went.

        >>> Ratio(2.04, 1.9, 2.2, 31).speed_of("full recompute")
        '2 times the speed of full recompute (per-round ratios 1.9 to 2.2 over 31 rounds)'
        >>> Ratio(1.02, 0.95, 1.1, 7).speed_of("full recompute")  # doctest: +ELLIPSIS
        'a speed this machine did not tell apart from that of full recompute (per-round ...)'
        """
        if not self.resolved:
            return (f"a speed this machine did not tell apart from that of {other} "
                    f"(per-round ratios {self.spread})")
        return (f"{two_figures(self.median)} times the speed of {other} "
                f"(per-round ratios {self.spread})")

    def __str__(self) -> str:
        if not self.resolved:
            return f"not resolved on this machine ({self.spread})"
        return f"{two_figures(self.median)} ({self.spread})"


def paired_ratio(slow: Sequence[float], fast: Sequence[float], scale: float = 1.0) -> Ratio:
    """``scale * slow / fast`` round by round (one rotation of :func:`time_paths`: the same drift).

    >>> r = paired_ratio([2.0, 4.2, 6.0, 8.0], [1.0, 2.0, 3.0, 4.1])
    >>> round(r.median, 3), r.low, r.high, r.resolved
    (2.0, 1.951..., 2.1, True)
    """
    if len(slow) != len(fast) or not slow:
        raise ValueError(f"paired_ratio needs one sample of each path per round, got "
                         f"{len(slow)} and {len(fast)}")
    per_round = [scale * s / f for s, f in zip(slow, fast, strict=True)]
    low, high = (10, 90) if len(per_round) >= 10 else (0, 100)
    return Ratio(percentile(per_round, 50), percentile(per_round, low),
                 percentile(per_round, high), len(per_round))


def environment() -> dict[str, Any]:
    """CPU model, Python, torch and transformers versions, and torch's current thread count."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        tf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a docs/test dependency
        tf_version = None
    return {"cpu": cpu, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": tf_version,
            "threads": torch.get_num_threads()}


Prepare = Callable[[], Callable[[], Any]]
"""Untimed setup that returns the zero-argument call to time."""


def time_paths(paths: dict[str, Prepare], samples: int, warmup: int,
               tick: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Milliseconds of each path's ``samples`` timed calls after ``warmup`` runs, the order
    rotating every round; ``tick`` is called after each timed call.

    >>> out = time_paths({"a": lambda: (lambda: None), "b": lambda: (lambda: None)},
    ...                  samples=3, warmup=1)
    >>> sorted(out), [len(v) for v in out.values()]
    (['a', 'b'], [3, 3])
    """
    names = list(paths)
    for name in names:
        for _ in range(warmup):
            paths[name]()()
    out: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    for s in range(samples):
        k = s % len(names)
        for name in names[k:] + names[:k]:  # rotate: no path always runs first or last
            call = paths[name]()
            t0 = time.perf_counter()
            call()
            out[name].append((time.perf_counter() - t0) * 1e3)
            if tick is not None:
                tick()
    return out
