"""Tables for pages and the command line: one Markdown renderer shared by every module (the
site parses Markdown outputs as MyST, so pipe tables render and ``$maths$`` is typeset), and
the site's log axes for the figures of timings."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A pipe table: ``str()`` of each cell, ``|`` escaped, newlines folded to spaces.

    >>> print(markdown_table(["a", "b"], [[1, "x"], [2, "y|z"]]))
    | a | b |
    |---|---|
    | 1 | x |
    | 2 | y\\|z |
    """
    rows = [list(r) for r in rows]
    if any(len(r) != len(headers) for r in rows):
        raise ValueError(f"every row needs one cell per header ({len(headers)})")

    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def log_log(ax, ticks: list[int], xlabel: str, ylabel: str, title: str) -> None:
    """The site's log-log axes: powers of two along x labelled as plain numbers, a legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    log_y(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def log_y(ax) -> None:
    """A log y axis labelled at 1, 2 and 5 of every decade."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
