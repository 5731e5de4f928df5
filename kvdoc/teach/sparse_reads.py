"""What each query of a sparse layer reads, recorded from the running model, and drawn.

Two kinds of layer read fewer rows than every earlier position: an indexed layer
(:mod:`kvdoc.core.indexed`, DeepSeek-V3.2) reads the top ``k`` positions its indexer scores; a
compressed layer (:mod:`kvdoc.core.v4`, DeepSeek-V4) reads a window of rows and the entries of
finished blocks. The functions here record those reads off the layers' own methods (no second
implementation of the rule), so that a page can show them and check what a cache must keep; the
figures colour them with :data:`~kvdoc.teach.display.OKABE_ITO`, text at the site's base size
(``docs/_ext/matplotlibrc``), so at most 7.5 in wide.

>>> unfinished(9, 4), unfinished(11, 4)   # after 10 positions, rows 8 and 9 wait; after 12, none
(range(8, 10), range(12, 12))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch

from kvdoc.core.feed import chunk_lengths
from kvdoc.proofs.compare import run_cached
from kvdoc.teach.dependency_maps import token_dependency_map
from kvdoc.teach.display import OKABE_ITO, _tint


@contextmanager
def _recording(objects: Sequence[object], method: str) -> Iterator[list[torch.Tensor]]:
    """Within the block, each object's ``method`` also appends what it returns (or, for
    ``attend``, its mask argument) to the yielded list, in call order."""
    seen: list[torch.Tensor] = []
    for obj in objects:
        original = getattr(obj, method)

        def spy(*args, original=original, **kwargs):
            out = original(*args, **kwargs)
            seen.append(args[2] if method == "attend" else out)
            return out
        setattr(obj, method, spy)
    try:
        yield seen
    finally:
        for obj in objects:
            delattr(obj, method)  # the class's method shows through again


class IndexedTrace(NamedTuple):
    """``reads`` bool ``[B, L, T, T]``: query ``i`` of layer ``l`` reads key ``j``;
    ``scores`` ``[B, L, T, T]``: the indexer's score of key ``j`` for query ``i`` (``-inf``
    after the query)."""

    reads: torch.Tensor
    scores: torch.Tensor


@torch.no_grad()
def indexed_trace(model: torch.nn.Module, ids: torch.Tensor,
                  chunks: int | Sequence[int] | None = None) -> IndexedTrace:
    """The keys every query of an :class:`~kvdoc.core.indexed.IndexedDecoder` reads, and its
    indexer's scores, in a full forward of ``ids`` ``[B, T]`` (``chunks`` None) or fed through
    a new cache in ``chunks`` (as :func:`~kvdoc.proofs.compare.run_cached`).

    >>> from kvdoc.core.indexed import IndexedConfig, IndexedDecoder
    >>> _ = torch.manual_seed(0)
    >>> model = IndexedDecoder(IndexedConfig(index_topk=3)).eval()
    >>> ids = torch.tensor([[5, 1, 8, 2, 9, 4]])
    >>> trace = indexed_trace(model, ids)
    >>> trace.reads.sum(-1)[0, 0].tolist()          # query i reads min(i + 1, 3) keys
    [1, 2, 3, 3, 3, 3]
    >>> torch.equal(indexed_trace(model, ids, [4, 1, 1]).reads, trace.reads)
    True
    """
    B, T = ids.shape
    layers = [block.attn for block in model.h]
    L = len(layers)
    reads = torch.zeros(B, L, T, T, dtype=torch.bool)
    scores = torch.full((B, L, T, T), float("-inf"), dtype=torch.float64)
    indexers = [attn.indexer for attn in layers]
    with _recording(layers, "choose") as chosen, _recording(indexers, "scores") as scored:
        if chunks is None:
            model(ids)
            lengths = [T]
        else:
            lengths = chunk_lengths(T, chunks)
            run_cached(model, ids, lengths)
    starts = [sum(lengths[:n]) for n in range(len(lengths))]
    for n, (start, C) in enumerate(zip(starts, lengths, strict=True)):
        for layer in range(L):
            picked, s = chosen[n * L + layer], scored[n * L + layer]  # [B, C, keys so far]
            keys = picked.shape[-1]
            reads[:, layer, start:start + C, :keys] = picked
            if s.shape[-1] != keys:  # a variant that scores other keys than it picks from
                continue
            causal = torch.ones(C, keys, dtype=torch.bool).tril(start)
            scores[:, layer, start:start + C, :keys] = s.double().masked_fill(~causal,
                                                                              float("-inf"))
    return IndexedTrace(reads, scores)


def unfinished(t: int, rate: int) -> range:
    """The positions of the unfinished block once query ``t`` has been read (``t + 1``
    positions): the rows a compressed layer holds in its buffer, ``(t + 1) mod rate`` of them."""
    return range((t + 1) // rate * rate, t + 1)


class CompressedReads(NamedTuple):
    """What every query of one compressed layer reads: ``window`` bool ``[B, T, T]`` (query
    ``t`` reads the K = V row of position ``j``), ``entries`` bool ``[B, T, N]`` (query ``t``
    reads entry ``w``, which pools positions ``w x rate .. (w + 1) x rate - 1``; None for a
    window-only layer), and the layer's ``rate`` (None: window-only)."""

    window: torch.Tensor
    entries: torch.Tensor | None
    rate: int | None


@torch.no_grad()
def compressed_reads(model: torch.nn.Module, ids: torch.Tensor) -> list[CompressedReads]:
    """Per layer of a :class:`~kvdoc.core.v4.CompressedDecoder`, what each query of a full
    forward of ``ids`` ``[B, T]`` reads: the mask its softmax is given, split into the window's
    rows and the entries.

    >>> from kvdoc.core.v4 import CompressedConfig, CompressedDecoder
    >>> _ = torch.manual_seed(0)
    >>> model = CompressedDecoder(CompressedConfig()).eval()      # csa (4), hca (8), sliding
    >>> reads = compressed_reads(model, torch.randint(0, 97, (1, 20)))
    >>> [r.rate for r in reads], reads[1].entries[0, 19].tolist()  # 20 rows: 2 blocks of 8
    ([4, 8, None], [True, True])
    >>> reads[0].entries[0].sum(-1).max().item()                    # CSA: the top 2 of 5
    2
    """
    T = ids.shape[1]
    layers = [block.attn for block in model.h]
    with _recording(layers, "attend") as masks:
        model(ids)
    out = []
    for attn, mask in zip(layers, masks, strict=True):
        rate = None if attn.compressor is None else attn.compressor.rate
        out.append(CompressedReads(mask[..., :T], None if rate is None else mask[..., T:], rate))
    return out


@torch.no_grad()
def entries_changed(model: torch.nn.Module, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """bool ``[T, N]``: whether entry ``w`` of layer ``layer``'s compressed cache, after a
    prefill of ``ids`` ``[1, T]``, changes (bit for bit) when the token at position ``p`` is
    replaced by the next id (:func:`~kvdoc.teach.dependency_maps.token_dependency_map`): which
    positions an entry depends on.

    >>> from kvdoc.core.v4 import CompressedConfig, CompressedDecoder
    >>> _ = torch.manual_seed(0)
    >>> model = CompressedDecoder(CompressedConfig(layer_types=("hca",))).eval()
    >>> c = entries_changed(model, torch.randint(0, 97, (1, 17)), 0)   # blocks of 8
    >>> c[:8, 0].all().item(), c[8:16, 1].all().item(), c.sum().item()   # position 16 waits
    (True, True, 16)
    """
    def entries(tokens: torch.Tensor) -> torch.Tensor:
        _, cache = model(tokens, model.new_cache(1))
        return cache.layers[layer].entries[0]  # [N, E]

    return token_dependency_map(entries, ids, model.config.vocab_size).depends.T


def ties_at_k(scores: torch.Tensor, k: int) -> int:
    """Rows of ``scores`` (``[..., T]``, ``-inf`` where a key may not be read) whose k-th and
    (k+1)-th best scores are equal and finite: the rows where a tie rule decides what is read
    (:func:`kvdoc.teach.crosscheck.path_gaps` measures what that does in transformers).

    >>> ties_at_k(torch.tensor([[3., 0., 0., -float('inf')], [3., 2., 1., 0.]]), 2)
    1
    """
    if scores.shape[-1] <= k:
        return 0
    ranked = scores.sort(dim=-1, descending=True).values
    return int(((ranked[..., k - 1] == ranked[..., k]) & ranked[..., k].isfinite()).sum())


# --- figures -----------------------------------------------------------------------------------

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
