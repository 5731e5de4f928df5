"""The two-layer toy lab: a cache per layer, in plain Python floats, with the work counted.

Two layers of single-head causal attention over 2-d vectors with residual connections and an
additive position vector, in plain Python floats with counters in the inner loops, so the work
counts (K/V pairs computed, ``q . k`` dot products) are *measured*. :func:`full_forward`
recomputes everything; :meth:`ToyLab.extend` continues a per-layer cache. What the lab shows
with them (cached vs full, the work of three scenarios, a prefix edit) is in
:mod:`kvdoc.teach.toy_scenarios`. Layers are numbered from 0, as in :mod:`kvdoc.core.model`.

One cache entry is a list per layer of per-position 2-d vectors, ``[L][T][2]``: the
``[B, H_kv, T, D_h]`` layout of :mod:`kvdoc.core.cache` with ``B = H_kv = 1`` and ``D_h = 2``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ToyLab", "ToyCache", "full_forward"]

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
        h = [(x[0] + a[0], x[1] + a[1]) for x, a in zip(h, att, strict=True)]  # residual
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
        """Feed ``tokens`` one at a time (as the source's lab does); counts are summed.

        Returns the last call's outputs with the final cache and the total counts.
        """
        cache = cache if cache is not None else ToyCache.empty(self.weights.n_layer)
        total, per_layer, outputs = Counts(), [Counts() for _ in range(self.weights.n_layer)], []
        for t in tokens:
            r = self.append_token(cache, t)
            cache, total, outputs = r.cache, total + r.counts, r.outputs
            per_layer = [a + b for a, b in zip(per_layer, r.per_layer, strict=True)]
        return ForwardResult(outputs, cache, total, per_layer)
