"""The broken-variant sweep the pages show, run once a build and read by every page that shows
it, and the progress lines of the long cells that run it.

Pages that execute in parallel, in any order, show the sweep of every broken variant
(:func:`broken_variants`); :func:`stored` computes each part once and keeps it as JSON in
``$KVDOC_RECORDS`` (set by docs/conf.py; unset: nothing is written), under a key of the package's
source, the numeric environment and the arguments (another key: stale, computed again). A file
lock makes a kernel that asks while another computes wait, then read what the other stored.

:func:`progress` prints a line as each step of a long cell is done, to the cell's output and to
the file ``$KVDOC_BUILD_LOG`` names; a line holds counts, never a time, so two builds of one
commit write the same pages (scripts/compare_builds.py).

>>> import tempfile
>>> from kvdoc.proofs.sweep import sweep_variants
>>> axes = dict(models=["mha"], kinds=["dynamic"], dtypes=[torch.float32], length=24)
>>> with tempfile.TemporaryDirectory() as folder:
...     first = stored("demo", sweep_variants, folder=folder, names=["no-mask"], **axes)
...     again = stored("demo", sweep_variants, folder=folder, names=["no-mask"], **axes)
>>> again == first, [(o.name, o.caught, o.first.check) for o in again]  # read, not rerun
(True, [('no-mask', True, 'logits')])
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import TypeVar

import torch

from kvdoc.proofs.case import CheckResult
from kvdoc.proofs.suite import SuiteReport
from kvdoc.proofs.sweep import VariantOutcome, sweep_variants, worker_map
from kvdoc.proofs.variants import VARIANTS

PACKAGE = Path(__file__).resolve().parents[1]
"""The kvdoc package: every ``.py`` file under it is part of a record's key."""
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "KVDOC_THREADS")
"""Environment variables that change the last bits of the numbers (``make numeric-check``)."""
AXES = dict(models=("mha", "gqa", "mqa", "llama"), kinds=("dynamic", "static"),
            dtypes=(torch.float32, torch.float64))
"""The pages' axes; a variant with nothing to run on among them runs on its own models and
kinds (in these dtypes)."""
PARTS = 3
"""The sweep in parts, a part a cell, so that no cell runs for long."""
_FIELDS = [f.name for f in dataclasses.fields(CheckResult)]


def source_hash(root: Path | None = None) -> str:
    """SHA-256 of every ``.py`` file under ``root`` (:data:`PACKAGE`): paths and bytes."""
    root, digest = root or PACKAGE, hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def record_key(sweep: Callable, args: dict) -> str:
    """The key of ``sweep(**args)``'s record: the source, the numeric environment, the torch and
    transformers versions, the sweep and its arguments."""
    versions = {p: metadata.version(p) for p in ("torch", "transformers")}
    what = {"source": source_hash(), "env": {v: os.environ.get(v) for v in NUMERIC_ENV},
            "versions": versions, "sweep": f"{sweep.__module__}.{sweep.__qualname__}",
            "args": _plain(args)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _dump(outcomes: list[VariantOutcome]) -> list[dict]:
    return [{"name": o.name, "breaks": o.breaks, "bug_class": o.bug_class,
             "variant": o.report.variant, "seconds": o.report.seconds,
             "results": [[getattr(r, f) for f in _FIELDS] for r in o.report.results]}
            for o in outcomes]


def _load(plain: list[dict]) -> list[VariantOutcome]:
    return [VariantOutcome(o["name"], o["breaks"], o["bug_class"], SuiteReport(
        o["variant"], [CheckResult(*r) for r in o["results"]], o["seconds"])) for o in plain]


def stored(name: str, sweep: Callable[..., list[VariantOutcome]], folder: str | None = None,
           **args) -> list[VariantOutcome]:
    """``sweep(**args)``, computed once and kept as ``<folder>/<name>.json`` (``folder``: default
    ``$KVDOC_RECORDS``), under an exclusive lock on ``<folder>/<name>.lock``."""
    folder = folder or os.environ.get("KVDOC_RECORDS")
    if not folder:
        return sweep(**args)
    key, path = record_key(sweep, args), Path(folder) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(path.read_text(encoding="utf-8"))
            if record["key"] == key:
                return _load(record["outcomes"])
        outcomes = sweep(**args)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": key, "outcomes": _dump(outcomes)}),
                           encoding="utf-8")
        partial.replace(path)  # whole or not at all
        return _load(_dump(outcomes))  # what a later reader gets, whoever computed it


def sweep_part(part: int, parts: int = PARTS, axes: dict = AXES,
               workers: int = 2) -> list[VariantOutcome]:
    """Part ``part`` of ``parts`` of :data:`~kvdoc.proofs.variants.VARIANTS`, in
    that order, through every check on ``axes``, two variants at a time."""
    names = list(VARIANTS)
    names = names[part * len(names) // parts:(part + 1) * len(names) // parts]
    with worker_map(workers) as map_:
        outcomes = sweep_variants(names, stop_at_first=False, map_=map_, **axes)
        swept = {o.name for o in outcomes}
        rest = [n for n in names if n not in swept]  # on their own models and kinds
        outcomes += sweep_variants(rest, stop_at_first=False, map_=map_,
                                   dtypes=axes["dtypes"])
    return sorted(outcomes, key=lambda o: names.index(o.name))


def broken_variants(part: int | None = None) -> list[VariantOutcome]:
    """The sweep the pages show: part ``part`` of :func:`sweep_part` (all parts if None), each
    part computed once a build (:func:`stored`)."""
    parts = range(PARTS) if part is None else [part]
    return [o for p in parts
            for o in stored(f"broken-variants-{p}", sweep_part, part=p, parts=PARTS, axes=AXES)]


T = TypeVar("T")


def progress(steps: Iterable[T], what: str, total: int | None = None) -> Iterator[T]:
    """Each of ``steps``, and after each has been used (the loop asks for the next), the line
    ``what: i/n done``, ``n`` being ``total`` or ``len(steps)``.

    >>> list(progress(iter("xy"), "steps", total=2))
    steps: 1/2 done
    steps: 2/2 done
    ['x', 'y']
    """
    if total is None:
        total = len(steps)  # type: ignore[arg-type]
    for done, step in enumerate(steps, 1):
        yield step
        line = f"{what}: {done}/{total} done"
        print(line, flush=True)  # flush: Jupyter shows it now, not when the cell ends
        path = os.environ.get("KVDOC_BUILD_LOG")
        if path:  # a log that is gone or not ours: the page's own line still shows
            with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as log:
                log.write(line + "\n")


def chunks(items: Iterable[T], size: int) -> list[list[T]]:
    """``items`` in consecutive lists of ``size`` (the last one shorter), for :func:`progress`.

    >>> chunks(range(5), 2)
    [[0, 1], [2, 3], [4]]
    """
    if size < 1:
        raise ValueError(f"chunk size must be at least 1, got {size}")
    items = list(items)
    return [items[i:i + size] for i in range(0, len(items), size)]
