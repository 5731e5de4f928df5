"""What the toy lab shows: the cached path against a full recompute, the measured work of three
scenarios against closed forms and the source's table, and a prefix edit.

:func:`check_against_full` compares a cached result with :func:`~kvdoc.teach.toy.full_forward`;
:func:`work_counts` runs the three scenarios (first input, append one token, edit a prefix token
and recompute the suffix); :func:`prefix_edit` shows which cached keys an edit invalidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .toy import Counts, ForwardResult, ToyCache, ToyLab, ToyWeights, full_forward

__all__ = ["check_against_full", "work_counts", "prefix_edit"]

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
    kv = 0.0
    for which in ("keys", "values"):
        for lc, lf in zip(getattr(cached.cache, which), getattr(full.cache, which),
                          strict=True):
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
        full: counts of :func:`~kvdoc.teach.toy.full_forward` over ``sequence``.
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
    "edit B to X, recompute suffix": {"full_kv": 8, "cached_kv": 6, "full_dots": 20,
                                      "cached_dots": 18},
}
"""The source's table of work counts for the three scenarios, kept as data to compare with."""


def common_prefix_len(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common prefix of two token sequences.

    >>> common_prefix_len("ABCD", "AXCD")
    1
    """
    n = 0
    for x, y in zip(a, b, strict=False):  # the sequences may differ in length
        if x != y:
            break
        n += 1
    return n


def work_counts(weights: ToyWeights | None = None) -> list[ScenarioCounts]:
    """Run the three scenarios: (a) first input A B C, (b) append D, (c) edit B to X.

    (a) feeds A, B, C one at a time into an empty cache; (b) appends D; (c) truncates every
    layer's cache to the common prefix of A B C D and A X C D (just A) and recomputes X, C, D.

    >>> [(r.cached.kv_pairs, r.cached.dot_products) for r in work_counts()]
    [(6, 12), (2, 8), (6, 18)]
    """
    lab = ToyLab(weights)
    rows = []
    a = lab.run_token_by_token("ABC")
    rows.append(ScenarioCounts("first input A B C", "ABC", 0, 3,
                               full_forward("ABC", lab.weights).counts, a.counts,
                               check_against_full(a, lab.weights)))
    b = lab.append_token(a.cache, "D")
    rows.append(ScenarioCounts("append D", "ABCD", 3, 1, full_forward("ABCD", lab.weights).counts,
                               b.counts, check_against_full(b, lab.weights)))
    edit = prefix_edit(b.cache, "AXCD", lab)
    rows.append(ScenarioCounts("edit B to X, recompute suffix", "AXCD", edit.prefix_len,
                               4 - edit.prefix_len, full_forward("AXCD", lab.weights).counts,
                               edit.result.counts,
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
