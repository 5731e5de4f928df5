"""The 2-d worked example and the two-layer toy lab of Part II, small enough to check by hand.

Two demonstrations, both exact and both computed here rather than typed in:

* **The worked example.** One head, ``d_head = 2``, ``W_q = W_k = W_v = I`` (so ``Q = K = V = x``),
  inputs ``x0 .. x3``. For each decode step ``t`` the *naive* path recomputes ``Q, K, V`` for
  all ``t + 1`` tokens and keeps the last output row; the *cached* path projects the one new
  token and reads ``K_full, V_full`` from the cache. :func:`worked_example` runs both.
* **The toy lab.** Two layers of single-head causal attention over 2-d vectors with residual
  connections and an additive position vector, in plain Python floats with counters in the
  inner loops, so the work counts (K/V pairs computed, ``q . k`` dot products) are *measured*.
  :func:`full_forward` recomputes everything; :meth:`ToyLab.extend` continues a per-layer cache;
  :func:`check_against_full` compares the two; :func:`counts_table` runs the three scenarios
  (first input, append one token, edit a prefix token and recompute the suffix).

Shapes in the worked example: ``T = t + 1`` tokens at step ``t``; ``Q, K, V`` are ``[T, 2]``,
scores and weights ``[T, T]`` (naive) or ``[1, T]`` (cached). In the toy lab one cache entry is a
list per layer of per-position 2-d vectors, i.e. ``[L][T][2]``: the ``[B, H_kv, T, D_h]`` layout of
:mod:`kvdoc.cache` with ``B = H_kv = 1`` and ``D_h = 2``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .mask import offset_causal_mask, top_left_causal_mask

__all__ = [
    "WORKED_INPUTS",
    "SOURCE_FIGURES",
    "NaivePath",
    "CachedPath",
    "WorkedStep",
    "naive_step",
    "cached_step",
    "worked_example",
    "SourceComparison",
    "compare_with_source",
    "latex_matrix",
    "naive_latex",
    "cached_latex",
    "html_table",
    "Counts",
    "ToyWeights",
    "ToyCache",
    "ToyLab",
    "ForwardResult",
    "full_forward",
    "CheckResult",
    "check_against_full",
    "expected_counts",
    "ScenarioCounts",
    "SOURCE_COUNTS",
    "common_prefix_len",
    "counts_table",
    "EditResult",
    "prefix_edit",
    "MaskExercise",
    "mask_exercise",
]

# ---------------------------------------------------------------------------------------------
# The worked example
# ---------------------------------------------------------------------------------------------

WORKED_INPUTS: tuple[tuple[float, float], ...] = ((1.0, 2.0), (3.0, 1.0), (2.0, 3.0), (4.0, 1.0))
"""``x0 = [1, 2]``, ``x1 = [3, 1]``, ``x2 = [2, 3]``, ``x3 = [4, 1]``: the source's four tokens."""

SOURCE_FIGURES: dict[int, dict[str, tuple[float, ...]]] = {
    0: {"scores": (3.536,), "weights": (1.000,), "output": (1.000, 2.000)},
    1: {"scores": (3.536, 7.071), "weights": (0.030, 0.970), "output": (2.940, 1.030)},
    2: {"scores": (5.657, 6.364, 9.192), "weights": (0.007, 0.028, 0.965), "output": (2.014, 2.930)},
    3: {"scores": (4.243, 9.192, 7.778, 12.021), "weights": (0.000, 0.007, 0.001, 0.991),
        "output": (3.980, 1.010)},
}
"""The source's hand-computed figures for the last row at each step (3 decimals), kept as data
to compare with: they are *not* authoritative (:func:`compare_with_source` says where they are wrong)."""


@dataclass(frozen=True)
class NaivePath:
    """The naive path at one step: the whole sequence recomputed, the last row taken.

    Attributes:
        Q, K, V: ``[T, 2]`` projections of all ``T`` tokens.
        scores: ``[T, T]``, ``Q K^T / sqrt(d_head)``.
        masked: ``[T, T]``, scores with ``-inf`` above the diagonal.
        weights: ``[T, T]``, row-wise softmax of ``masked``.
        output: ``[T, 2]``, ``weights @ V``.
    """

    Q: torch.Tensor
    K: torch.Tensor
    V: torch.Tensor
    scores: torch.Tensor
    masked: torch.Tensor
    weights: torch.Tensor
    output: torch.Tensor

    @property
    def last(self) -> torch.Tensor:
        """``[2]``: the row the next-token prediction uses, ``output[-1]``."""
        return self.output[-1]


@dataclass(frozen=True)
class CachedPath:
    """The cached path at one step: one new row projected, old K/V read from the cache.

    Attributes:
        q, k, v: ``[1, 2]`` projections of the new token only.
        K_full, V_full: ``[T, 2]``, the cache's rows with ``k``/``v`` appended.
        scores: ``[1, T]``, ``q K_full^T / sqrt(d_head)`` (no mask needed: every key is visible).
        weights: ``[1, T]``, softmax of ``scores``.
        output: ``[2]``, ``weights @ V_full``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    K_full: torch.Tensor
    V_full: torch.Tensor
    scores: torch.Tensor
    weights: torch.Tensor
    output: torch.Tensor


@dataclass(frozen=True)
class WorkedStep:
    """Both paths at decode step ``step`` (``step + 1`` tokens seen)."""

    step: int
    naive: NaivePath
    cached: CachedPath

    @property
    def max_abs_diff(self) -> float:
        """Largest ``|naive.last - cached.output|`` over the two coordinates."""
        return float((self.naive.last - self.cached.output).abs().max())


def _projections(w: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if w is None:
        eye = torch.eye(2, dtype=torch.float64)
        return eye, eye, eye
    if len(w) != 3 or any(tuple(m.shape) != (2, 2) for m in w):
        raise ValueError("projections must be three [2, 2] matrices (W_q, W_k, W_v)")
    w_q, w_k, w_v = (m.to(torch.float64) for m in w)
    return w_q, w_k, w_v


def _as_inputs(inputs: Sequence[Sequence[float]] | torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(inputs, dtype=torch.float64)
    if x.ndim != 2 or x.shape[1] != 2 or x.shape[0] < 1:
        raise ValueError(f"inputs must be a non-empty [T, 2] array, got shape {tuple(x.shape)}")
    return x


def naive_step(x: torch.Tensor, projections: Sequence[torch.Tensor] | None = None) -> NaivePath:
    """Recompute attention over every row of ``x`` with a causal mask (the naive path).

    Args:
        x: ``[T, 2]`` float64 inputs, the whole sequence so far.
        projections: ``(W_q, W_k, W_v)``, each ``[2, 2]`` (rows act as ``x @ W``); identity if None.

    Returns:
        A :class:`NaivePath`; its ``last`` is ``[2]``.

    >>> p = naive_step(torch.tensor(WORKED_INPUTS[:2], dtype=torch.float64))
    >>> p.scores.shape, p.weights[0].tolist()
    (torch.Size([2, 2]), [1.0, 0.0])
    """
    x = _as_inputs(x)
    w_q, w_k, w_v = _projections(projections)
    Q, K, V = x @ w_q, x @ w_k, x @ w_v  # [T, 2] each
    T = x.shape[0]
    scores = Q @ K.T / math.sqrt(2)  # [T, T]
    allowed = offset_causal_mask(0, T)  # no cache: the ordinary lower triangle
    masked = scores.masked_fill(~allowed, float("-inf"))
    weights = masked.softmax(dim=-1)
    return NaivePath(Q, K, V, scores, masked, weights, weights @ V)


def cached_step(
    x_new: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    projections: Sequence[torch.Tensor] | None = None,
) -> CachedPath:
    """Project the one new token, append its K/V to the cache's, attend with its query alone.

    Args:
        x_new: ``[2]`` (or ``[1, 2]``) float64 input of the new token.
        cache_k, cache_v: ``[P, 2]`` rows already cached (``P`` may be 0).
        projections: ``(W_q, W_k, W_v)`` as in :func:`naive_step`.

    Returns:
        A :class:`CachedPath`; ``K_full``/``V_full`` are the new cache, ``[P + 1, 2]``.

    >>> empty = torch.zeros(0, 2, dtype=torch.float64)
    >>> cached_step(torch.tensor([1.0, 2.0], dtype=torch.float64), empty, empty).output.tolist()
    [1.0, 2.0]
    """
    w_q, w_k, w_v = _projections(projections)
    x_new = torch.as_tensor(x_new, dtype=torch.float64).reshape(1, 2)
    if cache_k.shape != cache_v.shape or cache_k.ndim != 2 or cache_k.shape[1] != 2:
        raise ValueError("cache_k and cache_v must both be [P, 2]")
    q, k, v = x_new @ w_q, x_new @ w_k, x_new @ w_v  # [1, 2] each: the only new projections
    K_full = torch.cat([cache_k, k])  # [P + 1, 2]
    V_full = torch.cat([cache_v, v])
    scores = q @ K_full.T / math.sqrt(2)  # [1, P + 1]
    weights = scores.softmax(dim=-1)
    return CachedPath(q, k, v, K_full, V_full, scores, weights, (weights @ V_full)[0])


def worked_example(
    inputs: Sequence[Sequence[float]] | torch.Tensor = WORKED_INPUTS,
    projections: Sequence[torch.Tensor] | None = None,
) -> list[WorkedStep]:
    """Run the naive and the cached path for every decode step ``0 .. T - 1``.

    Args:
        inputs: ``[T, 2]`` token vectors (default :data:`WORKED_INPUTS`).
        projections: ``(W_q, W_k, W_v)``; identity if None, as in the source.

    Returns:
        One :class:`WorkedStep` per step; the cached path carries its cache from step to step.

    >>> steps = worked_example()
    >>> [s.naive.Q.shape[0] for s in steps], max(s.max_abs_diff for s in steps) < 1e-12
    ([1, 2, 3, 4], True)
    """
    x = _as_inputs(inputs)
    cache_k = cache_v = torch.zeros(0, 2, dtype=torch.float64)
    steps = []
    for t in range(x.shape[0]):
        naive = naive_step(x[: t + 1], projections)
        cached = cached_step(x[t], cache_k, cache_v, projections)
        cache_k, cache_v = cached.K_full, cached.V_full
        steps.append(WorkedStep(t, naive, cached))
    return steps


@dataclass(frozen=True)
class SourceComparison:
    """The source's hand figure for one quantity at one step beside the computed value.

    Attributes:
        step: decode step.
        quantity: ``"scores"``, ``"weights"`` or ``"output"`` (of the last row).
        source: the source's figures.
        computed: the computed values, full precision.
        max_abs_diff: largest ``|source - computed|``.
        agrees: True when every source figure is the computed value rounded to 3 decimals
            (within 0.0005 plus a hair for float rounding).
        from_source_inputs: what the source's own previous figure implies: softmax of its
            scores (for weights) or its weights times ``V`` (for output); None for scores.
    """

    step: int
    quantity: str
    source: tuple[float, ...]
    computed: tuple[float, ...]
    max_abs_diff: float
    agrees: bool
    from_source_inputs: tuple[float, ...] | None


def compare_with_source(
    steps: Sequence[WorkedStep], figures: dict[int, dict[str, tuple[float, ...]]] = SOURCE_FIGURES
) -> list[SourceComparison]:
    """Compare the hand figures of the source with the computed last rows, step by step.

    Args:
        steps: output of :func:`worked_example` on :data:`WORKED_INPUTS`.
        figures: hand figures keyed by step, then quantity.

    Returns:
        One :class:`SourceComparison` per (step, quantity).

    >>> rows = compare_with_source(worked_example())
    >>> [(r.step, r.quantity) for r in rows if not r.agrees]  # doctest: +ELLIPSIS
    [(1, 'weights'), ...]
    """
    out = []
    for s in steps:
        if s.step not in figures:
            continue
        fig = figures[s.step]
        computed = {
            "scores": s.cached.scores[0],
            "weights": s.cached.weights[0],
            "output": s.cached.output,
        }
        for name in ("scores", "weights", "output"):
            src = torch.tensor(fig[name], dtype=torch.float64)
            comp = computed[name]
            if src.shape != comp.shape:
                raise ValueError(f"step {s.step} {name}: source has {src.numel()} values, computed {comp.numel()}")
            diff = float((src - comp).abs().max())
            implied = None
            if name == "weights":
                implied = tuple(torch.tensor(fig["scores"], dtype=torch.float64).softmax(-1).tolist())
            elif name == "output":
                implied = tuple((torch.tensor(fig["weights"], dtype=torch.float64) @ s.cached.V_full).tolist())
            out.append(SourceComparison(s.step, name, tuple(src.tolist()), tuple(comp.tolist()), diff,
                                        diff <= 0.0005 + 1e-9, implied))
    return out


# ---------------------------------------------------------------------------------------------
# Rendering helpers (the pages show tables as HTML and matrices as LaTeX generated from values)
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


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]], caption: str | None = None) -> str:
    """A small HTML table (cells are escaped; floats are shown as given, so format them first).

    >>> html_table(["a"], [[1]])
    '<table class="table kvdoc-table"><thead><tr><th>a</th></tr></thead><tbody><tr><td>1</td></tr></tbody></table>'
    """
    if any(len(r) != len(headers) for r in rows):
        raise ValueError("every row must have one cell per header")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="table kvdoc-table">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _projection_line(names: tuple[str, str, str], values: tuple[torch.Tensor, ...], decimals: int) -> str:
    """``Q = K = V &= [...]`` when the three projections are equal (W_q = W_k = W_v), else one each."""
    m = lambda t: latex_matrix(t, decimals)  # noqa: E731
    if torch.equal(values[0], values[1]) and torch.equal(values[1], values[2]):
        return rf"{names[0]} = {names[1]} = {names[2]} &= {m(values[0])} \\"
    return rf"{names[0]} &= {m(values[0])},\; {names[1]} = {m(values[1])},\; {names[2]} = {m(values[2])} \\"


def naive_latex(s: WorkedStep, decimals: int = 3) -> str:
    """The naive path of one step as an ``aligned`` LaTeX block generated from the values.

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

    >>> print(cached_latex(worked_example()[1]).splitlines()[1])
    q = k = v &= \\begin{bmatrix}3.000 & 1.000\\end{bmatrix} \\\\
    """
    c = s.cached
    m = lambda t: latex_matrix(t, decimals)  # noqa: E731
    proj = _projection_line(("q", "k", "v"), (c.q, c.k, c.v), decimals)
    kv = (rf"K_\text{{full}} = V_\text{{full}} &= {m(c.K_full)} \\" if torch.equal(c.K_full, c.V_full)
          else rf"K_\text{{full}} &= {m(c.K_full)},\; V_\text{{full}} = {m(c.V_full)} \\")
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
# The two-layer toy lab (plain Python floats, instrumented)
# ---------------------------------------------------------------------------------------------

Vec = tuple[float, float]
Mat = tuple[Vec, Vec]


@dataclass
class Counts:
    """Work counters, incremented in the inner loops (never derived from a formula).

    Attributes:
        kv_pairs: K/V pairs computed; one pair is one position's K and V in one layer.
        dot_products: ``q . k`` dot products (one per query-key pair that is scored).
    """

    kv_pairs: int = 0
    dot_products: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.kv_pairs + other.kv_pairs, self.dot_products + other.dot_products)


@dataclass(frozen=True)
class ToyWeights:
    """Fixed weights of the toy model: token vectors and per-layer ``(W_q, W_k, W_v)``, all 2-d.

    A row vector ``h`` projects as ``h @ W``. The position vector added to token ``p``'s
    embedding is ``pos_scale * (sin p, cos p)``.
    """

    embeddings: dict[str, Vec] = field(default_factory=lambda: {
        "A": (1.0, 0.0), "B": (0.0, 1.0), "C": (1.0, 1.0), "D": (-1.0, 0.5), "X": (0.5, -1.0)})
    layers: tuple[tuple[Mat, Mat, Mat], ...] = (
        (((0.9, 0.2), (-0.3, 0.8)), ((0.7, -0.4), (0.5, 0.6)), ((1.0, 0.3), (0.2, 0.9))),
        (((0.6, -0.5), (0.4, 0.7)), ((0.8, 0.1), (-0.2, 1.1)), ((0.5, 0.4), (-0.6, 0.8))),
    )
    pos_scale: float = 0.5

    @property
    def n_layer(self) -> int:
        """Number of attention layers (2 by default)."""
        return len(self.layers)

    def embed(self, token: str, position: int) -> Vec:
        """Token vector plus position vector for ``token`` at absolute ``position``."""
        if token not in self.embeddings:
            raise ValueError(f"unknown token {token!r}; known: {sorted(self.embeddings)}")
        e = self.embeddings[token]
        return (e[0] + self.pos_scale * math.sin(position), e[1] + self.pos_scale * math.cos(position))


def _matvec(h: Vec, w: Mat) -> Vec:  # row vector times [2, 2]
    return (h[0] * w[0][0] + h[1] * w[1][0], h[0] * w[0][1] + h[1] * w[1][1])


def _attend(q: Vec, keys: Sequence[Vec], values: Sequence[Vec], counts: Counts) -> Vec:
    """Softmax attention of one query over the keys it may see; counts every dot product."""
    scores = []
    for k in keys:
        scores.append((q[0] * k[0] + q[1] * k[1]) / math.sqrt(2))
        counts.dot_products += 1
    m = max(scores)
    e = [math.exp(s - m) for s in scores]
    z = sum(e)
    return (sum(w * v[0] for w, v in zip(e, values)) / z, sum(w * v[1] for w, v in zip(e, values)) / z)


@dataclass
class ToyCache:
    """Per-layer K and V rows, ``keys[layer][position]`` is a 2-d vector (``[L][T][2]``).

    Also keeps the tokens it has read, so an edit can find the common prefix.
    """

    keys: list[list[Vec]]
    values: list[list[Vec]]
    tokens: list[str] = field(default_factory=list)

    @classmethod
    def empty(cls, n_layer: int) -> ToyCache:
        """A cache with ``n_layer`` empty layers."""
        return cls([[] for _ in range(n_layer)], [[] for _ in range(n_layer)], [])

    @property
    def seq_len(self) -> int:
        """Positions held (the same in every layer)."""
        return len(self.tokens)

    def truncate(self, n: int) -> ToyCache:
        """A new cache holding positions ``0 .. n - 1`` of every layer (this one is not changed)."""
        if not 0 <= n <= self.seq_len:
            raise ValueError(f"cannot truncate a cache of {self.seq_len} positions to {n}")
        return ToyCache([k[:n] for k in self.keys], [v[:n] for v in self.values], self.tokens[:n])


@dataclass(frozen=True)
class ForwardResult:
    """What a forward (full or cached) returns.

    Attributes:
        outputs: final hidden vectors of the positions this call processed, ``[C][2]``.
        cache: per-layer K/V of every position ``0 .. P + C - 1``.
        counts: work measured during this call only.
        per_layer: the same counts split by layer.
    """

    outputs: list[Vec]
    cache: ToyCache
    counts: Counts
    per_layer: list[Counts]


def full_forward(tokens: Sequence[str], weights: ToyWeights | None = None) -> ForwardResult:
    """Recompute every layer at every position from scratch (the baseline).

    Each layer projects Q, K, V for all ``T`` positions, then position ``i`` attends to keys
    ``0 .. i``: ``T`` K/V pairs and ``T (T + 1) / 2`` dot products per layer.

    >>> r = full_forward("ABC")
    >>> r.counts.kv_pairs, r.counts.dot_products
    (6, 12)
    """
    w = weights or ToyWeights()
    if len(tokens) < 1:
        raise ValueError("need at least one token")
    h = [w.embed(t, p) for p, t in enumerate(tokens)]
    cache = ToyCache.empty(w.n_layer)
    cache.tokens = list(tokens)
    per_layer = []
    for layer, (w_q, w_k, w_v) in enumerate(w.layers):
        c = Counts()
        Q = [_matvec(x, w_q) for x in h]
        K, V = [], []
        for x in h:
            K.append(_matvec(x, w_k))
            V.append(_matvec(x, w_v))
            c.kv_pairs += 1
        cache.keys[layer], cache.values[layer] = K, V
        att = [_attend(Q[i], K[: i + 1], V[: i + 1], c) for i in range(len(h))]  # causal: keys 0..i
        h = [(x[0] + a[0], x[1] + a[1]) for x, a in zip(h, att)]  # residual
        per_layer.append(c)
    total = sum(per_layer, Counts())
    return ForwardResult(h, cache, total, per_layer)


class ToyLab:
    """The cached path of the toy model: continue a :class:`ToyCache` with new tokens.

    >>> lab = ToyLab()
    >>> r = lab.extend(ToyCache.empty(2), "ABC")
    >>> r2 = lab.extend(r.cache, "D")
    >>> r2.counts.kv_pairs, r2.counts.dot_products
    (2, 8)
    """

    def __init__(self, weights: ToyWeights | None = None) -> None:
        self.weights = weights or ToyWeights()

    def extend(self, cache: ToyCache, tokens: Sequence[str]) -> ForwardResult:
        """Process ``tokens`` at positions ``P .. P + C - 1`` after the ``P`` cached ones.

        New token ``i`` is embedded at absolute position ``P + i``; in every layer only the new
        rows are projected, their K/V appended to a copy of the cache, and query ``i`` reads keys
        ``0 .. P + i`` (the offset causal mask). The cache passed in is not modified.
        """
        w = self.weights
        if len(cache.keys) != w.n_layer:
            raise ValueError(f"cache has {len(cache.keys)} layers, model has {w.n_layer}")
        if len(tokens) < 1:
            raise ValueError("need at least one new token")
        P = cache.seq_len
        h = [w.embed(t, P + i) for i, t in enumerate(tokens)]
        new = ToyCache([list(k) for k in cache.keys], [list(v) for v in cache.values], cache.tokens + list(tokens))
        per_layer = []
        for layer, (w_q, w_k, w_v) in enumerate(w.layers):
            c = Counts()
            for x in h:  # only the new positions get K/V
                new.keys[layer].append(_matvec(x, w_k))
                new.values[layer].append(_matvec(x, w_v))
                c.kv_pairs += 1
            K, V = new.keys[layer], new.values[layer]
            att = [_attend(_matvec(x, w_q), K[: P + i + 1], V[: P + i + 1], c) for i, x in enumerate(h)]
            h = [(x[0] + a[0], x[1] + a[1]) for x, a in zip(h, att)]
            per_layer.append(c)
        return ForwardResult(h, new, sum(per_layer, Counts()), per_layer)

    def append_token(self, cache: ToyCache, token: str) -> ForwardResult:
        """Decode step: :meth:`extend` with one token."""
        return self.extend(cache, [token])

    def run_token_by_token(self, tokens: Sequence[str], cache: ToyCache | None = None) -> ForwardResult:
        """Feed ``tokens`` one at a time (as the source's lab does); counts are summed.

        Returns the last call's outputs with the final cache and the total counts.
        """
        cache = cache if cache is not None else ToyCache.empty(self.weights.n_layer)
        total, per_layer, outputs = Counts(), [Counts() for _ in range(self.weights.n_layer)], []
        for t in tokens:
            r = self.append_token(cache, t)
            cache, total, outputs = r.cache, total + r.counts, r.outputs
            per_layer = [a + b for a, b in zip(per_layer, r.per_layer)]
        return ForwardResult(outputs, cache, total, per_layer)


@dataclass(frozen=True)
class CheckResult:
    """Cached vs full: the last output and every layer's K/V at every position.

    Attributes:
        output_diff: ``max |cached last output - full last output|``.
        kv_diff: largest difference over every layer, position and coordinate of K and V.
        positions: positions compared.
        ok: both differences below ``tol``.
    """

    output_diff: float
    kv_diff: float
    positions: int
    tol: float

    @property
    def ok(self) -> bool:
        return self.output_diff < self.tol and self.kv_diff < self.tol


def check_against_full(cached: ForwardResult, weights: ToyWeights | None = None, tol: float = 1e-12) -> CheckResult:
    """Recompute ``cached.cache.tokens`` from scratch and compare with the cached result.

    >>> lab = ToyLab()
    >>> check_against_full(lab.append_token(lab.extend(ToyCache.empty(2), "ABC").cache, "D")).ok
    True
    """
    full = full_forward(cached.cache.tokens, weights)
    out = max(abs(a - b) for a, b in zip(cached.outputs[-1], full.outputs[-1]))
    if full.cache.seq_len != cached.cache.seq_len:
        raise ValueError("caches hold different lengths")
    kv = 0.0
    for which in ("keys", "values"):
        for lc, lf in zip(getattr(cached.cache, which), getattr(full.cache, which)):
            for vc, vf in zip(lc, lf, strict=True):
                kv = max(kv, abs(vc[0] - vf[0]), abs(vc[1] - vf[1]))
    return CheckResult(out, kv, full.cache.seq_len, tol)


def expected_counts(past_len: int, new_len: int, n_layer: int = 2) -> Counts:
    """Closed forms: per layer, new K/V pairs = ``C`` and dot products = ``sum_i (P + i + 1)``.

    >>> expected_counts(3, 1)
    Counts(kv_pairs=2, dot_products=8)
    """
    if past_len < 0 or new_len < 0 or n_layer < 1:
        raise ValueError("lengths must be non-negative and n_layer positive")
    visible = sum(past_len + i + 1 for i in range(new_len))
    return Counts(n_layer * new_len, n_layer * visible)


@dataclass(frozen=True)
class ScenarioCounts:
    """One row of the counts table: full recompute vs the cached path, measured.

    Attributes:
        name: the scenario.
        sequence: the tokens the model has read at the end.
        past_len: cached positions reused (``P``).
        new_len: positions the cached path processed (``C``).
        full: counts of :func:`full_forward` over ``sequence``.
        cached: counts of the cached path.
        check: cached vs full comparison.
    """

    name: str
    sequence: str
    past_len: int
    new_len: int
    full: Counts
    cached: Counts
    check: CheckResult


SOURCE_COUNTS: dict[str, dict[str, int]] = {
    "first input A B C": {"full_kv": 6, "cached_kv": 6, "full_dots": 12, "cached_dots": 12},
    "append D": {"full_kv": 8, "cached_kv": 2, "full_dots": 20, "cached_dots": 8},
    "edit B to X, recompute suffix": {"full_kv": 8, "cached_kv": 6, "full_dots": 20, "cached_dots": 18},
}
"""The source's table of work counts for the three scenarios, kept as data to compare with."""


def common_prefix_len(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common prefix of two token sequences.

    >>> common_prefix_len("ABCD", "AXCD")
    1
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def counts_table(weights: ToyWeights | None = None) -> list[ScenarioCounts]:
    """Run the three scenarios: (a) first input A B C, (b) append D, (c) edit B to X.

    (a) feeds A, B, C one at a time into an empty cache; (b) appends D; (c) truncates every
    layer's cache to the common prefix of A B C D and A X C D (just A) and recomputes X, C, D.

    >>> [(r.cached.kv_pairs, r.cached.dot_products) for r in counts_table()]
    [(6, 12), (2, 8), (6, 18)]
    """
    lab = ToyLab(weights)
    rows = []
    a = lab.run_token_by_token("ABC")
    rows.append(ScenarioCounts("first input A B C", "ABC", 0, 3, full_forward("ABC", lab.weights).counts,
                               a.counts, check_against_full(a, lab.weights)))
    b = lab.append_token(a.cache, "D")
    rows.append(ScenarioCounts("append D", "ABCD", 3, 1, full_forward("ABCD", lab.weights).counts,
                               b.counts, check_against_full(b, lab.weights)))
    edit = prefix_edit(b.cache, "AXCD", lab)
    rows.append(ScenarioCounts("edit B to X, recompute suffix", "AXCD", edit.prefix_len, 4 - edit.prefix_len,
                               full_forward("AXCD", lab.weights).counts, edit.result.counts,
                               check_against_full(edit.result, lab.weights)))
    return rows


@dataclass(frozen=True)
class EditResult:
    """A prefix edit: the cache truncated to the common prefix, then the suffix recomputed.

    Attributes:
        prefix_len: positions kept.
        result: the cached path's result over the new suffix.
        before, after: the caches before and after the edit.
    """

    prefix_len: int
    result: ForwardResult
    before: ToyCache
    after: ToyCache

    def key_changed(self, layer: int, position: int) -> float:
        """``max |K_after - K_before|`` at ``(layer, position)``; 0.0 means unchanged bit for bit."""
        a, b = self.after.keys[layer][position], self.before.keys[layer][position]
        return max(abs(a[0] - b[0]), abs(a[1] - b[1]))


def prefix_edit(cache: ToyCache, new_tokens: Sequence[str], lab: ToyLab | None = None) -> EditResult:
    """Replace the sequence in ``cache`` by ``new_tokens``: keep the common prefix, recompute the rest.

    >>> lab = ToyLab()
    >>> e = prefix_edit(lab.extend(ToyCache.empty(2), "ABCD").cache, "AXCD", lab)
    >>> e.prefix_len, e.key_changed(0, 2) == 0.0, e.key_changed(1, 2) > 0
    (1, True, True)
    """
    lab = lab or ToyLab()
    n = common_prefix_len(cache.tokens, new_tokens)
    if n == len(new_tokens):
        raise ValueError("nothing to recompute: the new sequence is a prefix of the cached one")
    result = lab.extend(cache.truncate(n), list(new_tokens[n:]))
    return EditResult(n, result, cache, result.cache)


# ---------------------------------------------------------------------------------------------
# Exercises
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskExercise:
    """Answers for ``C`` new tokens after ``P`` cached ones.

    Attributes:
        query_positions: absolute positions of the new queries, ``P .. P + C - 1``.
        scores_shape: last two dimensions of the scores, ``(C, P + C)``.
        keys_offset: keys each query may read with the offset mask.
        keys_top_left: keys each query may read with a top-left (``is_causal=True``) mask.
    """

    query_positions: list[int]
    scores_shape: tuple[int, int]
    keys_offset: list[int]
    keys_top_left: list[int]


def mask_exercise(past_len: int, new_len: int) -> MaskExercise:
    """Compute the exercise's answers from :mod:`kvdoc.mask`.

    >>> mask_exercise(10, 3).keys_offset
    [11, 12, 13]
    """
    off = offset_causal_mask(past_len, new_len)
    tl = top_left_causal_mask(past_len, new_len)
    return MaskExercise(
        list(range(past_len, past_len + new_len)),
        (int(off.shape[0]), int(off.shape[1])),
        [int(n) for n in off.sum(dim=1)],
        [int(n) for n in tl.sum(dim=1)],
    )
