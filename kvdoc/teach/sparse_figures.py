"""Figures of what each query of a sparse layer reads (:mod:`kvdoc.teach.sparse_reads`): an
indexed layer's picks across a stream, and a compressed layer's window rows, entries and
buffered rows for a few queries. Colours are :data:`~kvdoc.teach.display.OKABE_ITO`; text stays at
the site's base size (``docs/_ext/matplotlibrc``), so the figures are at most 7.5 in wide.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .display import OKABE_ITO, _tint
from .sparse_reads import CompressedReads, unfinished

READ, SKIPPED, WAITING = OKABE_ITO[0], "0.85", OKABE_ITO[1]


def draw_selection(reads: torch.Tensor, title: str | None = None, width: float = 6.4):
    """The keys each query reads, ``reads`` bool ``[T, T]`` (query ``i``, key ``j``): read
    cells dark, earlier keys not read light grey, later keys white.

    >>> fig = draw_selection(torch.ones(4, 4, dtype=torch.bool).tril())
    >>> fig.axes[0].get_xlabel(), len(fig.axes[0].get_legend().get_texts())
    ('key position j', 2)
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    T = reads.shape[-1]
    earlier = np.tril(np.ones((T, T), dtype=bool))
    cells = np.where(reads.cpu().numpy(), 2, np.where(earlier, 1, 0))
    fig, ax = plt.subplots(figsize=(width, width * 0.95))
    ax.imshow(cells, cmap=ListedColormap(["white", SKIPPED, READ]), vmin=0, vmax=2,
              interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, T), minor=True)
    ax.set_yticks(np.arange(-0.5, T), minor=True)
    ax.grid(which="minor", color="0.7", linewidth=0.4)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks(range(0, T, 5))
    ax.set_yticks(range(0, T, 5))
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    if title:
        ax.set_title(title)
    ax.legend(handles=[Patch(facecolor=READ, label="read"),
                       Patch(facecolor=SKIPPED, edgecolor="0.5", label="earlier, not read")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def draw_compressed(reads: CompressedReads, queries: Sequence[int], title: str | None = None,
                    width: float = 7.4):
    """For each query ``t`` of ``queries``, strips over positions ``0 .. T - 1``: the rows it
    reads from the window (dark); the unfinished block's positions, whose rows wait in the
    buffer (orange); one box per finished block, green if the query reads its entry, grey if not
    (a CSA indexer's choice). Batch row 0 of ``reads``.

    >>> from kvdoc.teach.sparse_reads import CompressedReads
    >>> window = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    >>> fig = draw_compressed(CompressedReads(window, window[..., :3], 2), [4])
    >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
    ['entries', 'buffer', 'window']
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    T, rate = reads.window.shape[-1], reads.rate
    strips = 1 if rate is None else 3
    pitch = strips + 1.1  # a query's strips and its label
    n = len(queries)
    fig, ax = plt.subplots(figsize=(width, 0.42 * pitch * n + 1.9))
    labels, ys = [], []
    entry = _tint(OKABE_ITO[2])
    for k, t in enumerate(queries):
        base = pitch * (n - 1 - k)  # the first query at the top
        top = base + strips - 1  # the window's strip
        for j in range(t + 1):
            ax.add_patch(Rectangle((j, top), 1, 0.85, lw=0.5, edgecolor="0.4",
                                   facecolor=READ if reads.window[0, t, j] else "white"))
        if rate is not None:
            for j in unfinished(t, rate):
                ax.add_patch(Rectangle((j, base + 1), 1, 0.85, lw=0.5, edgecolor="0.4",
                                       facecolor=WAITING))
            for w in range((t + 1) // rate):
                ax.add_patch(Rectangle((w * rate + 0.08, base), rate - 0.16, 0.85, lw=0.8,
                                       edgecolor="0.3",
                                       facecolor=entry if reads.entries[0, t, w] else SKIPPED))
            labels += ["entries", "buffer"]
            ys += [base + 0.42, base + 1.42]
        labels.append("window")
        ys.append(top + 0.42)
        ax.text(0, top + 0.95, f"query at position {t}", va="bottom")
    ax.set_yticks(ys, labels)
    ax.set_xlim(-0.3, T + 0.3)
    ax.set_ylim(-0.2, pitch * n)
    ax.set_xticks(range(0, T + 1, 5))
    ax.set_xlabel("position")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    if title:
        ax.set_title(title)
    handles = [Patch(facecolor=READ, label="window row read")]
    if rate is not None:
        handles += [Patch(facecolor=entry, edgecolor="0.3", label="entry read"),
                    Patch(facecolor=WAITING, edgecolor="0.4", label="row in the buffer")]
        finished = [(t, w) for t in queries for w in range((t + 1) // rate)]
        if any(not reads.entries[0, t, w] for t, w in finished):  # a CSA indexer's choice
            handles.insert(2, Patch(facecolor=SKIPPED, edgecolor="0.3", label="entry not read"))
    ax.legend(handles=handles, loc="upper center", ncol=2, frameon=False,
              bbox_to_anchor=(0.5, -0.8 / (0.42 * pitch * n)))
    fig.tight_layout()
    return fig
