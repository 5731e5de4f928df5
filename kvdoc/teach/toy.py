"""The two-layer toy lab: a cache per layer, in plain Python floats, with the work counted; and
what it shows: cached against full, the work of three scenarios, a prefix edit.

Two layers of single-head causal attention over 2-d vectors, with residual connections and an
additive position vector. Counters sit in the inner loops, so the work (K/V pairs computed,
``q . k`` dot products) is *measured*, not derived. :func:`full_forward` recomputes everything;
:meth:`ToyLab.extend` continues a per-layer cache, ``[L][T][2]``: the ``[B, H_kv, T, D_h]``
layout of :mod:`kvdoc.core.cache` with ``B = H_kv = 1`` and ``D_h = 2``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdoc.serving.radix import common_prefix_len

__all__ = ["ToyLab", "ToyCache", "full_forward", "check_against_full", "work_counts",
           "prefix_edit"]

Vec = tuple[float, float]
Mat = tuple[Vec, Vec]


@dataclass
class Counts:
    """Work counted in the inner loops: K/V pairs (one position's K and V in one layer) and
    ``q . k`` dot products."""

    kv_pairs: int = 0
    dot_products: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.kv_pairs + other.kv_pairs, self.dot_products + other.dot_products)


@dataclass(frozen=True)
class ToyWeights:
    """Token vectors and per-layer ``(W_q, W_k, W_v)``, all 2-d (``h @ W``); token ``p``'s
    position vector is ``pos_scale * (sin p, cos p)``."""

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
        return (e[0] + self.pos_scale * math.sin(position),
                e[1] + self.pos_scale * math.cos(position))


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
    return (sum(w * v[0] for w, v in zip(e, values, strict=True)) / z,
            sum(w * v[1] for w, v in zip(e, values, strict=True)) / z)


@dataclass
class ToyCache:
    """Per-layer K and V rows (``keys[layer][position]``), and the tokens read, so that an edit
    can find the common prefix."""

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
    """A forward's final vectors of its ``C`` positions, the cache of all ``P + C``, and the
    work of the call, in total and per layer."""

    outputs: list[Vec]
    cache: ToyCache
    counts: Counts
    per_layer: list[Counts]


def full_forward(tokens: Sequence[str], weights: ToyWeights | None = None) -> ForwardResult:
    """Recompute every layer at every position, from an empty cache: per layer ``T`` K/V pairs
    and ``T (T + 1) / 2`` dot products.

    >>> r = full_forward("ABC")
    >>> r.counts.kv_pairs, r.counts.dot_products
    (6, 12)
    """
    lab = ToyLab(weights)
    return lab.extend(ToyCache.empty(lab.weights.n_layer), tokens)


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
        """Process ``tokens`` at positions ``P .. P + C - 1`` after ``P`` cached ones.

        New token ``i`` is embedded at absolute position ``P + i``; in every layer only
        the new rows are projected, their K/V appended to a copy of the cache, and query
        ``i`` reads keys ``0 .. P + i`` (the offset causal mask). The cache passed in is
        not modified.
        """
        w = self.weights
        if len(cache.keys) != w.n_layer:
            raise ValueError(f"cache has {len(cache.keys)} layers, "
                             f"model has {w.n_layer}")
        if len(tokens) < 1:
            raise ValueError("need at least one new token")
        P = cache.seq_len
        h = [w.embed(t, P + i) for i, t in enumerate(tokens)]
        new = ToyCache([list(k) for k in cache.keys], [list(v) for v in cache.values],
                       cache.tokens + list(tokens))
        per_layer = []
        for layer, (w_q, w_k, w_v) in enumerate(w.layers):
            c = Counts()
            for x in h:  # only the new positions get K/V
                new.keys[layer].append(_matvec(x, w_k))
                new.values[layer].append(_matvec(x, w_v))
                c.kv_pairs += 1
            K, V = new.keys[layer], new.values[layer]
            att = [_attend(_matvec(x, w_q), K[: P + i + 1], V[: P + i + 1], c)
                   for i, x in enumerate(h)]  # query i reads keys 0 .. P + i
            h = [(x[0] + a[0], x[1] + a[1]) for x, a in zip(h, att, strict=True)]
            per_layer.append(c)
        return ForwardResult(h, new, sum(per_layer, Counts()), per_layer)

    def append_token(self, cache: ToyCache, token: str) -> ForwardResult:
        """Decode step: :meth:`extend` with one token."""
        return self.extend(cache, [token])

    def run_token_by_token(self, tokens: Sequence[str],
                           cache: ToyCache | None = None) -> ForwardResult:
        """Feed ``tokens`` one at a time, as the source's lab does: the last call's outputs,
        the final cache, the summed counts."""
        cache = cache if cache is not None else ToyCache.empty(self.weights.n_layer)
        total, per_layer, outputs = Counts(), [Counts() for _ in range(self.weights.n_layer)], []
        for t in tokens:
            r = self.append_token(cache, t)
            cache, total, outputs = r.cache, total + r.counts, r.outputs
            per_layer = [a + b for a, b in zip(per_layer, r.per_layer, strict=True)]
        return ForwardResult(outputs, cache, total, per_layer)


@dataclass(frozen=True)
class CheckResult:
    """Cached against full: the largest difference of the last output and of any K/V
    coordinate; ``ok`` when both are below ``tol``."""

    output_diff: float
    kv_diff: float
    positions: int
    tol: float

    @property
    def ok(self) -> bool:
        return self.output_diff < self.tol and self.kv_diff < self.tol


def check_against_full(cached: ForwardResult, weights: ToyWeights | None = None,
                       tol: float = 1e-12) -> CheckResult:
    """Recompute ``cached.cache.tokens`` from scratch and compare with the cached result.

    >>> lab = ToyLab()
    >>> check_against_full(lab.append_token(lab.extend(ToyCache.empty(2), "ABC").cache, "D")).ok
    True
    """
    full = full_forward(cached.cache.tokens, weights)
    out = max(abs(a - b) for a, b in zip(cached.outputs[-1], full.outputs[-1], strict=True))
    if full.cache.seq_len != cached.cache.seq_len:
        raise ValueError("caches hold different lengths")
    kv = max(abs(a - b) for which in ("keys", "values")
             for lc, lf in zip(getattr(cached.cache, which), getattr(full.cache, which),
                               strict=True)
             for vc, vf in zip(lc, lf, strict=True) for a, b in zip(vc, vf, strict=True))
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
    """One row of the counts table: ``P`` reused, ``C`` processed, the work of the full and of
    the cached path, and their comparison."""

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
    "edit B to X, recompute suffix": {"full_kv": 8, "cached_kv": 6, "full_dots": 20,
                                      "cached_dots": 18},
}
"""The source's table of work counts for the three scenarios, to compare with."""


def work_counts(weights: ToyWeights | None = None) -> list[ScenarioCounts]:
    """The three scenarios: (a) A, B, C one at a time into an empty cache; (b) append D; (c)
    edit B to X: keep the common prefix (A) and recompute X, C, D.

    >>> [(r.cached.kv_pairs, r.cached.dot_products) for r in work_counts()]
    [(6, 12), (2, 8), (6, 18)]
    """
    lab = ToyLab(weights)
    a = lab.run_token_by_token("ABC")
    b = lab.append_token(a.cache, "D")
    edit = prefix_edit(b.cache, "AXCD", lab)
    runs = [("first input A B C", "ABC", 0, a), ("append D", "ABCD", 3, b),
            ("edit B to X, recompute suffix", "AXCD", edit.prefix_len, edit.result)]
    return [ScenarioCounts(name, seq, past, len(seq) - past, full_forward(seq, lab.weights).counts,
                           run.counts, check_against_full(run, lab.weights))
            for name, seq, past, run in runs]


@dataclass(frozen=True)
class EditResult:
    """A prefix edit: ``prefix_len`` positions kept, the suffix recomputed, the caches before and
    after."""

    prefix_len: int
    result: ForwardResult
    before: ToyCache
    after: ToyCache

    def key_changed(self, layer: int, position: int) -> float:
        """``max |K_after - K_before|`` at ``(layer, position)``; 0.0: unchanged bit for bit."""
        a, b = self.after.keys[layer][position], self.before.keys[layer][position]
        return max(abs(a[0] - b[0]), abs(a[1] - b[1]))


def prefix_edit(cache: ToyCache, new_tokens: Sequence[str],
                lab: ToyLab | None = None) -> EditResult:
    """Replace the sequence in ``cache`` by ``new_tokens``: keep the common prefix, recompute the
    rest.

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
