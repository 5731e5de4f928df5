"""Tables for pages and the command line: one Markdown renderer shared by every module (the
site parses Markdown outputs as MyST, so pipe tables render and ``$maths$`` is typeset)."""

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
