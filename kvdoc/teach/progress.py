"""Progress lines for a page's long cells: in the notebook, and in the build's log.

A cell that runs for a minute shows nothing until it ends, in Jupyter and in the site's build
alike. :func:`progress` prints a line as each step of such a cell is done: to the cell's output,
so that the notebook shows it, and to the file ``$KVDOC_BUILD_LOG`` names (docs/conf.py points it
at the build's own standard error), so that the build log shows it. A line holds counts, never
a time: two builds of one commit must write the same pages (scripts/compare_builds.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _to_build_log(line: str) -> None:
    path = os.environ.get("KVDOC_BUILD_LOG")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as log:
            log.write(line + "\n")
    except OSError:  # a log that is gone or not ours: the page's own line still shows
        pass


def progress(steps: Iterable[T], what: str, total: int | None = None) -> Iterator[T]:
    """Each of ``steps``, and after each has been used, the line ``what: i/n done``.

    ``n`` is ``total``, or ``len(steps)``; a step counts as done when the loop asks for the next.

    >>> for part in progress(["a", "b"], "sweep"):
    ...     pass
    sweep: 1/2 done
    sweep: 2/2 done
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
        _to_build_log(line)


def chunks(items: Iterable[T], size: int) -> list[list[T]]:
    """``items`` in consecutive lists of ``size`` (the last one shorter), for :func:`progress`.

    >>> chunks(range(5), 2)
    [[0, 1], [2, 3], [4]]
    """
    if size < 1:
        raise ValueError(f"chunk size must be at least 1, got {size}")
    items = list(items)
    return [items[i:i + size] for i in range(0, len(items), size)]
