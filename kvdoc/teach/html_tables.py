"""Small HTML tables generated from values, and dependency maps drawn as such tables, small
enough to sit beside their claim.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from kvdoc.teach.dependency_maps import CheckedMap, DependencyMap


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]], caption: str | None = None,
               css_class: str = "table kvdoc-table") -> str:
    """A small HTML table (cells are escaped; floats are shown as given, so format them first).

    >>> html_table(["a"], [[1]])
    '<table class="table kvdoc-table"><thead><tr><th>a</th></tr></thead><tbody><tr><td>1</td></tr></tbody></table>'
    """  # noqa: E501 (a doctest output line)
    if any(len(r) != len(headers) for r in rows):
        raise ValueError("every row must have one cell per header")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return (f'<table class="{css_class}">{cap}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def map_table(m: CheckedMap | DependencyMap, labels: Sequence[str],
              out_labels: Sequence[str] | None = None, corner: str = "out \\ in",
              caption: str | None = None) -> str:
    """A dependency map as a small HTML table: ``●`` where the output row needs the input row.

    ``labels`` name the input rows; the output rows take the labels of their indices unless
    ``out_labels`` is given (for instance for a map whose output is a single row). The table has
    the class ``kvdoc-map`` (docs/_static/kvdoc.css keeps it small, so that maps sit side by side).

    >>> import torch
    >>> from kvdoc.teach.dependency_maps import jacobian_map
    >>> m = jacobian_map(lambda x: x.cumsum(0), torch.ones(2, 1, dtype=torch.float64))
    >>> html_out = map_table(m, "AB")
    >>> html_out.count("●"), html_out.count("·")
    (3, 1)
    """
    dm = m.jacobian if isinstance(m, CheckedMap) else m
    outs = list(out_labels) if out_labels is not None else [labels[t] for t in dm.out_rows]
    dm = dm.relabel(list(labels), outs)
    rows = [[outs[t]] + ["●" if bool(dm.depends[t, s]) else "·" for s in range(dm.shape[1])]
            for t in range(dm.shape[0])]
    return html_table([corner, *labels], rows, caption=caption, css_class="kvdoc-map")
