"""A figure of who holds which K/V: one grid per layout, K/V heads by positions, cells by rank.

Each cell of a grid is one (K/V head, position) row of one layer's cache; its label lists the
ranks that cache it (:func:`kvdoc.parallel.decode.who_holds`), and its colour is the first of
them. A cell held by two ranks is a replicated K/V head.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvdoc.core.model import GPTConfig

from .decode import who_holds


def holders(config: GPTConfig, tp: int, cp: int, seq_len: int) -> list[list[list[int]]]:
    """``holders[k][p]``: the ranks whose cache holds K/V head ``k`` at position ``p``.

    >>> from kvdoc.core.model import llama_config
    >>> holders(llama_config(), tp=4, cp=1, seq_len=2)   # 2 K/V heads over 4 ranks
    [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]
    """
    grid: list[list[list[int]]] = [[[] for _ in range(seq_len)] for _ in range(config.n_kv_head)]
    for h in who_holds(config, tp, cp, seq_len):
        for k in h.kv_heads:
            for p in h.positions:
                grid[k][p].append(h.rank)
    return grid


def holders_figure(config: GPTConfig, layouts: Sequence[tuple[int, int]], seq_len: int):
    """One panel per ``(tp, cp)`` layout: K/V heads (rows) by positions (columns)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    # rows of 0.38 in: room for a 12 pt cell label (docs/_ext/matplotlibrc) above and below
    fig, axes = plt.subplots(len(layouts), 1, squeeze=False,
                             figsize=(6.6, 0.5 + (0.75 + 0.38 * config.n_kv_head) * len(layouts)))
    colours = ListedColormap(plt.get_cmap("tab10").colors[:8])
    for ax, (tp, cp) in zip(axes[:, 0], layouts, strict=True):
        grid = holders(config, tp, cp, seq_len)
        ax.imshow([[cell[0] for cell in row] for row in grid], cmap=colours, vmin=0, vmax=7,
                  aspect="auto")
        for k, row in enumerate(grid):
            for p, cell in enumerate(row):
                ax.text(p, k, ",".join(map(str, cell)), ha="center", va="center", color="white")
        ax.set_yticks(range(config.n_kv_head), [f"K/V head {k}" for k in range(config.n_kv_head)])
        ax.set_xticks(range(seq_len))
        ax.set_title(f"TP {tp} x CP {cp}: ranks holding each row")
    axes[-1, 0].set_xlabel("position")
    fig.tight_layout()
    return fig
