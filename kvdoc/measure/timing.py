"""The timing harness: rotated sampling of timed paths, percentiles and the environment they ran in.

A *path* is a zero-argument ``prepare`` that does untimed setup and returns the call to time.
:func:`time_paths` warms every path up, then samples them in rounds whose order rotates, so no
path always runs first or last and every path sees the same drift in the machine's load.
Nothing here asserts a speed: timings are measurements, not facts.
"""

from __future__ import annotations

import gc
import importlib.metadata
import platform
import time
from collections.abc import Callable, Iterable
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
    """Time each path ``samples`` times after ``warmup`` runs, rotating the order every round.

    Returns the raw samples in milliseconds, per path. ``tick`` is called after each timed call.

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
