"""What the pages share for display: one-character tokens, HTML tables, diagrams drawn from
live objects, and the landing page's reading times.

A token is one printable ASCII character, ``id = ord(ch) - 32``: ids 0..94 of the default
97-token vocabulary, so prompts read as ``"ABCDE"``.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from kvdoc.serving.paged import PagedCache


def token_ids(text: str) -> torch.Tensor:
    """The ids of ``text``, one character per token, as ``[1, T]``.

    >>> token_ids("ABC")
    tensor([[33, 34, 35]])
    """
    bad = [ch for ch in text if not 32 <= ord(ch) < 127]
    if not text or bad:
        raise ValueError(f"token_ids takes a non-empty string of printable ASCII, got {text!r}")
    return torch.tensor([[ord(ch) - 32 for ch in text]])


def token_text(ids: Sequence[int] | torch.Tensor) -> str:
    """A 1-d sequence of ids, joined by spaces: a capital letter for the ids of ``A``..``Z``,
    else ``id N`` (no stray glyphs in tables).

    >>> token_text(token_ids("AB")[0]), token_text([76])
    ('A B', 'id 76')
    """
    return " ".join(chr(i + 32) if "A" <= chr(i + 32) <= "Z" else f"id {i}" for i in map(int, ids))


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]], caption: str | None = None,
               css_class: str = "table kvdoc-table") -> str:
    """A small HTML table; cells are escaped and shown as given, so format floats first.

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


def draw_boxes(labels: Sequence[str], notes: Sequence[str] | None = None, title: str | None = None,
               width: float = 6.0, colors: Sequence[str] | None = None):
    """A vertical chain of labelled boxes joined by arrows, bottom to top; a note goes under its
    box's label, not in a second column, so that the text stays readable on a phone.

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


def _tint(color: str) -> tuple[float, float, float]:
    """``color`` mixed with white: light enough for black text on it."""
    from matplotlib.colors import to_rgb

    return tuple(1 - 0.45 * (1 - c) for c in to_rgb(color))


def draw_block_tables(caches: Mapping[str, PagedCache], width: float = 6.6):
    """Block tables of paged caches over the pool they share, read from the live objects: each
    sequence's logical blocks (shaded up to its length) above the pool's blocks with their
    reference counts, an arrow from each logical block to the block its table names.

    >>> from kvdoc import Decoder, GPTConfig
    >>> from kvdoc.serving.paged import BlockPool
    >>> pool = BlockPool(GPTConfig(), num_blocks=3, block_size=2)
    >>> cache = PagedCache(pool, batch_size=1)
    >>> _ = Decoder(GPTConfig())(torch.tensor([[1, 2, 3]]), cache)
    >>> fig = draw_block_tables({"seq": cache})
    >>> [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("block")]
    ['block 0\\n1 ref', 'block 1\\n1 ref', 'block 2\\nfree']
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


#: Words a minute behind the landing page's reading times: MyST's own default for its reading
#: time (myst-parser's ``words_per_minute``), a common figure for technical prose.
WORDS_PER_MINUTE = 200

_FENCE = re.compile(r"^(`{3,}|~{3,}|:{3,})\s*(?:\{([\w:.-]+)\})?\s*(\S*)")
# Fenced blocks a reader does not read as prose: code, doctests, raw reST, the table of contents.
_NOT_PROSE = {"code-cell", "code-block", "code", "doctest", "eval-rst", "toctree", "raw"}
_ROLE = re.compile(r"\{[\w:.-]+\}`([^`]*)`")  # {glue:text}`key`, {term}`logits`: the content
_LINK_TARGET = re.compile(r"\]\([^)]*\)")  # [text](target): the text
_WORD = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")


def prose_words(text: str) -> int:
    r"""Words of a MyST page a reader reads: not its front matter, code, doctests, raw reST,
    table of contents, directive options or the syntax of roles and links; a glued value counts
    as one word, maths as its symbols.

    >>> prose_words("---\nkernelspec: {}\n---\n# A title\n\n```{code-cell} python\n"
    ...             "x = 1\n```\n\nThe {term}`KV cache` holds [keys](a.md).\n")
    7
    """
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        text = text[end + 5:] if end >= 0 else text
    words = 0
    skipping: str | None = None  # the fence of the code block being skipped
    kept: list[str] = []  # fences of the open directives whose content is prose (admonitions)

    def closes(stripped: str, marker: str) -> bool:
        return len(stripped) >= len(marker) and set(stripped) == {marker[0]}

    for line in text.splitlines():
        stripped = line.strip()
        if skipping is not None:
            if closes(stripped, skipping):
                skipping = None
            continue
        fence = _FENCE.match(stripped)
        if fence:
            marker, directive, info = fence.groups()
            if kept and directive is None and not info and closes(stripped, kept[-1]):
                kept.pop()
            elif directive is None or directive in _NOT_PROSE:
                skipping = marker  # code (with or without a language), or a non-prose block
            else:  # an admonition, a note, a figure: its title and content are prose
                kept.append(marker)
                words += len(_WORD.findall(stripped.split("}", 1)[1]))
            continue
        if re.match(r"^:[\w-]+:", stripped):
            continue  # a directive's option (:class: dropdown, :tags: [...])
        words += len(_WORD.findall(_LINK_TARGET.sub("]", _ROLE.sub(r"\1", line))))
    return words


def page_title(path: Path) -> str:
    """The title of a MyST page: its first level-one heading (``#`` and a space)."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    raise ValueError(f"{path} has no '# ' title")


def reading_minutes(pages: Iterable[Path]) -> int:
    """Minutes to read ``pages`` (MyST files) at :data:`WORDS_PER_MINUTE`, rounded up."""
    total = sum(prose_words(Path(p).read_text(encoding="utf-8")) for p in pages)
    return math.ceil(total / WORDS_PER_MINUTE)
