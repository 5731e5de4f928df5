"""What the pages share for display: token labels, HTML and LaTeX renderers, diagrams, and the
landing page's reading times (:func:`reading_minutes`).

Nothing here computes a result the site relies on; it turns results into something a reader can
look at. Token ids are shown as characters with the pages' display convention ``id = ord(ch) - 32``
(the printable ASCII characters are ids 0..94 of the default 97-token vocabulary), so prompts read
as ``"ABCDE"``; an id outside the printable capital letters is shown as ``id N`` rather than as a
stray glyph.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdoc.core.model import Decoder
from kvdoc.proofs.deps import CheckedMap, DependencyMap
from kvdoc.proofs.sites import decoder_values
from kvdoc.serving.paged import PagedCache

from .worked import WorkedStep

# ---------------------------------------------------------------------------------------------
# Tokens
# ---------------------------------------------------------------------------------------------

def token_ids(text: str) -> torch.Tensor:
    """The ids of ``text``, one character per token (``id = ord(ch) - 32``), as ``[1, T]``.

    >>> token_ids("ABC")
    tensor([[33, 34, 35]])
    """
    bad = [ch for ch in text if not 32 <= ord(ch) < 127]
    if not text or bad:
        raise ValueError(f"token_ids takes a non-empty string of printable ASCII, got {text!r}")
    return torch.tensor([[ord(ch) - 32 for ch in text]])


def token_label(token_id: int | torch.Tensor) -> str:
    """A capital letter for the ids of ``A``..``Z``, else ``id N``: no stray glyphs in tables.

    >>> token_label(33), token_label(76)
    ('A', 'id 76')
    """
    i = int(token_id)
    return chr(i + 32) if "A" <= chr(i + 32) <= "Z" else f"id {i}"


def token_text(ids: Sequence[int] | torch.Tensor) -> str:
    """The labels of a 1-d sequence of ids, joined by spaces.

    >>> token_text(token_ids("AB")[0])
    'A B'
    """
    return " ".join(token_label(i) for i in ids)


# ---------------------------------------------------------------------------------------------
# Dependency maps, small enough to sit beside their claim
# ---------------------------------------------------------------------------------------------

def map_table(m: CheckedMap | DependencyMap, labels: Sequence[str],
              out_labels: Sequence[str] | None = None, corner: str = "out \\ in",
              caption: str | None = None) -> str:
    """A dependency map as a small HTML table: ``●`` where the output row needs the input row.

    ``labels`` name the input rows; the output rows take the labels of their indices unless
    ``out_labels`` is given (for instance for a map whose output is a single row). The table has
    the class ``kvdoc-map`` (docs/_static/kvdoc.css keeps it small, so that maps sit side by side).

    >>> from kvdoc.proofs.deps import jacobian_map
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


# ---------------------------------------------------------------------------------------------
# HTML and LaTeX (the worked example's tables and matrices, generated from values)
# ---------------------------------------------------------------------------------------------



def _fmt(v: float, decimals: int) -> str:
    if v == float("-inf"):
        return r"-\infty"
    s = f"{v:.{decimals}f}"
    return "0." + "0" * decimals if s == "-0." + "0" * decimals else s


def latex_matrix(t: torch.Tensor | Sequence, decimals: int = 3) -> str:
    """A ``bmatrix`` of ``t`` (1-d or 2-d) with ``decimals`` places; ``-inf`` becomes ``-\\infty``.

    >>> latex_matrix(torch.tensor([[1.0, float("-inf")]]))
    '\\\\begin{bmatrix}1.000 & -\\\\infty\\\\end{bmatrix}'
    """
    t = torch.as_tensor(t, dtype=torch.float64)
    if t.ndim == 1:
        t = t[None, :]
    if t.ndim != 2:
        raise ValueError("latex_matrix takes a 1-d or 2-d array")
    rows = [" & ".join(_fmt(float(v), decimals) for v in row) for row in t]
    return r"\begin{bmatrix}" + r" \\ ".join(rows) + r"\end{bmatrix}"


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


def _projection_line(names: tuple[str, str, str], values: tuple[torch.Tensor, ...],
                     decimals: int) -> str:
    """``Q = K = V &= [...]`` when the three projections are equal (W_q = W_k = W_v), else one
    each."""
    m = lambda t: latex_matrix(t, decimals)  # noqa: E731
    if torch.equal(values[0], values[1]) and torch.equal(values[1], values[2]):
        return rf"{names[0]} = {names[1]} = {names[2]} &= {m(values[0])} \\"
    return (rf"{names[0]} &= {m(values[0])},\; {names[1]} = {m(values[1])},\; "
            rf"{names[2]} = {m(values[2])} \\")


def naive_latex(s: WorkedStep, decimals: int = 3) -> str:
    """The naive path of one step as an ``aligned`` LaTeX block generated from the values.

    >>> from kvdoc.teach.worked import worked_example
    >>> print(naive_latex(worked_example()[0]).splitlines()[1])
    Q = K = V &= \\begin{bmatrix}1.000 & 2.000\\end{bmatrix} \\\\
    """
    n = s.naive
    m = lambda t: latex_matrix(t, decimals)  # noqa: E731
    proj = _projection_line(("Q", "K", "V"), (n.Q, n.K, n.V), decimals)
    lines = [
        r"\begin{aligned}",
        proj,
        rf"\text{{scores}} = QK^\top/\sqrt{{2}} &= {m(n.scores)} \\",
        rf"\text{{masked}} &= {m(n.masked)} \\",
        rf"\text{{weights}} = \operatorname{{softmax}}(\text{{masked}}) &= {m(n.weights)} \\",
        rf"\text{{output}} = \text{{weights}}\, V &= {m(n.output)} \\",
        rf"\text{{output}}[-1] &= {m(n.last)}",
        r"\end{aligned}",
    ]
    return "\n".join(lines)


def cached_latex(s: WorkedStep, decimals: int = 3) -> str:
    """The cached path of one step as an ``aligned`` LaTeX block generated from the values.

    >>> from kvdoc.teach.worked import worked_example
    >>> print(cached_latex(worked_example()[1]).splitlines()[1])
    q = k = v &= \\begin{bmatrix}3.000 & 1.000\\end{bmatrix} \\\\
    """
    c = s.cached
    m = lambda t: latex_matrix(t, decimals)  # noqa: E731
    proj = _projection_line(("q", "k", "v"), (c.q, c.k, c.v), decimals)
    if torch.equal(c.K_full, c.V_full):
        kv = rf"K_\text{{full}} = V_\text{{full}} &= {m(c.K_full)} \\"
    else:
        kv = rf"K_\text{{full}} &= {m(c.K_full)},\; V_\text{{full}} = {m(c.V_full)} \\"
    lines = [
        r"\begin{aligned}",
        proj,
        kv,
        rf"\text{{scores}} = q K_\text{{full}}^\top/\sqrt{{2}} &= {m(c.scores)} \\",
        rf"\text{{weights}} = \operatorname{{softmax}}(\text{{scores}}) &= {m(c.weights)} \\",
        rf"\text{{output}} = \text{{weights}}\, V_\text{{full}} &= {m(c.output)}",
        r"\end{aligned}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Diagrams
# ---------------------------------------------------------------------------------------------

def draw_boxes(labels: Sequence[str], notes: Sequence[str] | None = None, title: str | None = None,
               width: float = 7.0, colors: Sequence[str] | None = None):
    """A vertical chain of labelled boxes joined by arrows, bottom to top (the forward direction).

    ``notes`` (same length) are written to the right of each box, e.g. the tensor's shape.
    Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    n = len(labels)
    notes = list(notes) if notes is not None else [""] * n
    colors = list(colors) if colors is not None else ["#dde8f5"] * n
    if len(notes) != n or len(colors) != n:
        raise ValueError("labels, notes and colors must have one entry per box")
    fig, ax = plt.subplots(figsize=(width, 0.55 * n + 0.6))
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.6, n - 0.2)
    ax.axis("off")
    for i, (label, note, color) in enumerate(zip(labels, notes, colors, strict=True)):
        ax.add_patch(FancyBboxPatch((0.3, i - 0.18), 4.8, 0.36, boxstyle="round,pad=0.04",
                                    facecolor=color, edgecolor="0.3"))
        ax.text(2.7, i, label, ha="center", va="center", fontsize=9)
        ax.text(5.4, i, note, ha="left", va="center", fontsize=9, family="monospace")
        if i + 1 < n:
            ax.annotate("", xy=(2.7, i + 0.76), xytext=(2.7, i + 0.24),
                        arrowprops={"arrowstyle": "->", "color": "0.3"})
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
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
    fig, ax = plt.subplots(figsize=(width, 3.2))
    y_seq, y_pool = 3.0, 0.0
    for (name, table, length, color), x0 in zip(rows, spans, strict=True):
        ax.text(x0, y_seq + 1.25, f"{name}: {length} positions", fontsize=10, va="bottom")
        ax.text(x0, y_seq + 1.0, f"table {table}", fontsize=10, va="bottom", family="monospace")
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
                        fontsize=10, color="black" if held else "0.45")
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
                va="center", fontsize=10, color="black" if refs else "0.45")
    ax.text(-0.2, y_pool - 0.35, f"the pool: {pool.num_blocks} physical blocks of {S} positions",
            fontsize=10, va="top")
    ax.set_xlim(-0.3, total + 0.3)
    ax.set_ylim(y_pool - 0.9, y_seq + 1.8)
    ax.axis("off")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Shapes through the decoder
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeRow:
    """One step of the forward pass: what it is, which class of operation, its output shape."""

    step: str
    op_class: str
    shape: tuple[int, ...]
    symbols: str


def gpt2_shapes(model: Decoder, idx: torch.Tensor, layer: int = 0) -> list[ShapeRow]:
    """The shapes of one full forward of ``idx`` (``[B, T]``), measured on ``model``, in forward
    order.

    The decoder layer is shown once (layer ``layer``); the head split, the scores and the
    attention weights are measured on that layer's real Q and K. Ends with the last-row slice
    and the LM head of next-token prediction.

    >>> from kvdoc import GPTConfig
    >>> rows = gpt2_shapes(Decoder(GPTConfig()), torch.tensor([[1, 2, 3]]))
    >>> rows[-1].shape
    (1, 97)
    """
    cfg = model.config
    with torch.no_grad():
        v = decoder_values(model, idx)
        B, T = idx.shape
        H, Hkv, Dh = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        q = v[f"h{layer}.q"].view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, D_h]
        k = v[f"h{layer}.k"].view(B, T, Hkv, Dh).transpose(1, 2)  # [B, H_kv, T, D_h]
        k = k.repeat_interleave(H // Hkv, dim=1)
        scores = q @ k.transpose(-2, -1)  # [B, H, T, T]
        last = v["ln_f.out"][:, -1, :]  # [B, d]
        logits = model.lm_head(last)  # [B, V]
    h = f"h{layer}"
    return [
        ShapeRow("token ids", "input", tuple(idx.shape), "B, T"),
        ShapeRow("token embedding wte", "lookup (row-local)", tuple(v["wte"].shape),
                 "T, d_model (broadcast over B)" if v["wte"].dim() == 2 else "B, T, d_model"),
        ShapeRow("position embedding wpe", "lookup (row-local)", tuple(v["wpe"].shape),
                 "T, d_model"),
        ShapeRow("wte + wpe", "element-wise", tuple(v["embed"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: ln_1", "row-wise", tuple(v[f"{h}.ln_1"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: Q = ln_1 @ W_q", "matmul by a weight", tuple(v[f"{h}.q"].shape),
                 "B, T, H·d_k"),
        ShapeRow(f"{h}: K = ln_1 @ W_k", "matmul by a weight", tuple(v[f"{h}.k"].shape),
                 "B, T, H_kv·d_k"),
        ShapeRow(f"{h}: V = ln_1 @ W_v", "matmul by a weight", tuple(v[f"{h}.v"].shape),
                 "B, T, H_kv·d_k"),
        ShapeRow(f"{h}: split heads of Q", "reshape (row-local)", tuple(q.shape), "B, H, T, d_k"),
        ShapeRow(f"{h}: scores = Q K^T / sqrt(d_k)", "matmul of two activations",
                 tuple(scores.shape), "B, H, T, T"),
        ShapeRow(f"{h}: softmax(masked scores) @ V, heads merged", "matmul of two activations",
                 tuple(v[f"{h}.heads"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: c_proj, + residual", "matmul by a weight; element-wise",
                 tuple(v[f"{h}.mid"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: ln_2", "row-wise", tuple(v[f"{h}.ln_2"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: MLP up c_fc, GELU", "matmul by a weight; element-wise",
                 tuple(v[f"{h}.fc"].shape), "B, T, d_ff"),
        ShapeRow(f"{h}: MLP down c_proj, + residual", "matmul by a weight; element-wise",
                 tuple(v[f"{h}.out"].shape), "B, T, d_model"),
        ShapeRow("ln_f (after the last layer)", "row-wise", tuple(v["ln_f.out"].shape),
                 "B, T, d_model"),
        ShapeRow("last row x[:, -1, :]", "slice", tuple(last.shape), "B, d_model"),
        ShapeRow("LM head", "matmul by a weight", tuple(logits.shape), "B, V"),
    ]


# ---------------------------------------------------------------------------------------------
# Reading times (the landing page's reading paths)
# ---------------------------------------------------------------------------------------------

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
    r"""Words of a MyST page a reader reads: its front matter, code cells, other fenced code,
    doctests, raw reST and the table of contents left out, as are directive options and the
    syntax of roles and links; a glued value counts as one word, maths as its symbols.

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
