"""Diagrams the pages draw with matplotlib: a chain of boxes (:func:`draw_boxes`) and paged
caches' block tables over their shared pool (:func:`draw_block_tables`), read from the live
objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvdoc.serving.paged import PagedCache


def draw_boxes(labels: Sequence[str], notes: Sequence[str] | None = None, title: str | None = None,
               width: float = 6.0, colors: Sequence[str] | None = None):
    """A vertical chain of labelled boxes joined by arrows, bottom to top (the forward direction).

    ``notes`` (same length) are written in each box under its label, e.g. the tensor's shape: a
    second line rather than a second column keeps the figure narrow, so that a phone, which
    scales it to its width, keeps the text readable. Returns the matplotlib figure.

    >>> fig = draw_boxes(["embed", "layer"], ["[1, 5, 64]", ""], title="two steps")
    >>> [t.get_text() for t in fig.axes[0].texts if t.get_text()]  # the arrow is an empty text
    ['embed', '[1, 5, 64]', 'layer']
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    n = len(labels)
    notes = list(notes) if notes is not None else [""] * n
    colors = list(colors) if colors is not None else ["#dde8f5"] * n
    if len(notes) != n or len(colors) != n:
        raise ValueError("labels, notes and colors must have one entry per box")
    two_lines = any(notes)
    pitch = 0.8 if two_lines else 0.6  # inches a box and its arrow take
    half = 0.33 if two_lines else 0.25  # half a box's height, in pitches
    fig, ax = plt.subplots(figsize=(width, pitch * n + (0.6 if title else 0.2)))
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, n - 0.5)
    ax.axis("off")
    for i, (label, note, color) in enumerate(zip(labels, notes, colors, strict=True)):
        ax.add_patch(FancyBboxPatch((0.02, i - half), 0.96, 2 * half, boxstyle="round,pad=0",
                                    facecolor=color, edgecolor="0.3"))
        ax.text(0.5, i + half / 2 if note else i, label, ha="center", va="center")
        if note:
            ax.text(0.5, i - half / 2, note, ha="center", va="center", family="monospace")
        if i + 1 < n:
            ax.annotate("", xy=(0.5, i + 1 - half), xytext=(0.5, i + half),
                        arrowprops={"arrowstyle": "->", "color": "0.3", "shrinkA": 0,
                                    "shrinkB": 0})
    if title:
        ax.set_title(title)
    fig.tight_layout(pad=0.3)
    return fig


# Okabe-Ito colours: told apart with every common colour-vision deficiency.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9")


def _tint(color: str, strength: float = 0.45) -> tuple[float, float, float]:
    """``color`` mixed with white: light enough for black text on it."""
    from matplotlib.colors import to_rgb

    return tuple(1 - strength * (1 - c) for c in to_rgb(color))


def draw_block_tables(caches: Mapping[str, PagedCache], width: float = 6.6):
    """Block tables of paged caches over the pool they share, read from the live objects.

    Top: each sequence of each cache (named by its key, ``name[row]`` where a cache holds several)
    as its logical blocks, ``block_size`` slots each, labelled with positions and shaded up to its
    :attr:`~kvdoc.serving.paged.PagedCache.seq_len`. Bottom: every block of the pool, with its
    reference count (``pool.refs``) or ``free``. An arrow joins each logical block to the physical
    block its table names. Returns the matplotlib figure.

    >>> import torch
    >>> from kvdoc import Decoder, GPTConfig
    >>> from kvdoc.serving.paged import BlockPool, PagedCache
    >>> pool = BlockPool(GPTConfig(), num_blocks=3, block_size=2)
    >>> cache = PagedCache(pool, batch_size=1)
    >>> _ = Decoder(GPTConfig())(torch.tensor([[1, 2, 3]]), cache)
    >>> fig = draw_block_tables({"seq": cache})
    >>> [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("block")]
    ['block 0\\n1 ref', 'block 1\\n1 ref', 'block 2\\nfree']
    >>> len(fig.axes[0].patches)  # 2 blocks of 2 slots, 3 in the pool
    7
    >>> draw_block_tables({})
    Traceback (most recent call last):
    ...
    ValueError: draw_block_tables needs at least one cache
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if not caches:
        raise ValueError("draw_block_tables needs at least one cache")
    pool = next(iter(caches.values())).pool
    if any(c.pool is not pool for c in caches.values()):
        raise ValueError("draw_block_tables draws caches of one pool only")
    S, gap = pool.block_size, 0.6  # x unit: one slot
    rows = [(f"{name}[{r}]" if c.batch_size > 1 else name, c.tables[r], c.seq_len,
             OKABE_ITO[i % len(OKABE_ITO)])
            for i, (name, c) in enumerate(caches.items()) for r in range(c.batch_size)]
    spans, x = [], 0.0
    for _, table, _, _ in rows:  # sequences side by side, one slot's width apart
        spans.append(x)
        x += max(len(table), 1) * (S + gap) - gap + 1
    total = x - 1
    holders: dict[int, set[str]] = {}
    for _, table, _, color in rows:
        for block in table:
            holders.setdefault(block, set()).add(color)
    pitch = total / pool.num_blocks
    box = min(S, pitch - gap / 2)
    fig, ax = plt.subplots(figsize=(width, 3.5))
    y_seq, y_pool = 3.0, 0.0
    for (name, table, length, color), x0 in zip(rows, spans, strict=True):
        ax.text(x0, y_seq + 1.45, f"{name}: {length} positions", va="bottom")
        ax.text(x0, y_seq + 0.95, f"table {table}", va="bottom", family="monospace")
        for j, block in enumerate(table):
            bx = x0 + j * (S + gap)
            for s in range(S):
                pos = j * S + s
                held = pos < length
                ax.add_patch(Rectangle((bx + s, y_seq), 1, 0.8, lw=0.8,
                                       edgecolor="0.2" if held else "0.55",
                                       facecolor=_tint(color if held else "white"),
                                       linestyle="-" if held else "--"))
                ax.text(bx + s + 0.5, y_seq + 0.4, str(pos), ha="center", va="center",
                        color="black" if held else "0.45")
            px = block * pitch + (pitch - box) / 2 + box / 2
            ax.annotate("", xy=(px, y_pool + 1.0), xytext=(bx + S / 2, y_seq),
                        arrowprops={"arrowstyle": "-|>", "color": color, "lw": 1.6,
                                    "shrinkA": 0, "shrinkB": 0})
    for i in range(pool.num_blocks):
        refs, owners = pool.refs(i), holders.get(i, set())
        # a block held once, by a drawn sequence, takes its colour; a shared one stays grey
        fill = _tint(next(iter(owners))) if refs == 1 and owners else "0.85" if refs else "white"
        ax.add_patch(Rectangle((i * pitch + (pitch - box) / 2, y_pool), box, 1.0, lw=0.8,
                               edgecolor="0.2" if refs else "0.55", facecolor=fill,
                               linestyle="-" if refs else "--"))
        label = f"{refs} ref" + ("s" if refs > 1 else "") if refs else "free"
        ax.text(i * pitch + pitch / 2, y_pool + 0.5, f"block {i}\n{label}", ha="center",
                va="center", color="black" if refs else "0.45")
    ax.text(-0.2, y_pool - 0.35, f"the pool: {pool.num_blocks} physical blocks of {S} positions",
            va="top")
    ax.set_xlim(-0.3, total + 0.3)
    ax.set_ylim(y_pool - 0.9, y_seq + 2.1)
    ax.axis("off")
    fig.tight_layout()
    return fig
