"""The worked example and the two-layer toy lab: equalities, measured counts vs closed forms, the
edit."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvdoc.teach.display import html_table, token_ids, token_text
from kvdoc.teach.toy import (
    Counts,
    ToyCache,
    ToyLab,
    check_against_full,
    common_prefix_len,
    expected_counts,
    full_forward,
    prefix_edit,
    work_counts,
)
from kvdoc.teach.worked import (
    SOURCE_FIGURES,
    WORKED_INPUTS,
    compare_with_source,
    latex_matrix,
    naive_step,
    worked_example,
)


def _explicit_attention_last_row(x: torch.Tensor) -> torch.Tensor:
    """Independent reference: softmax(x_T x^T / sqrt 2) x for the last row only."""
    s = x[-1] @ x.T / 2**0.5
    return torch.softmax(s, -1) @ x


def test_worked_example_paths_agree_and_match_reference():
    steps = worked_example()
    assert len(steps) == len(WORKED_INPUTS)
    x = torch.tensor(WORKED_INPUTS, dtype=torch.float64)
    for s in steps:
        T = s.step + 1
        assert s.naive.Q.shape == s.naive.K.shape == s.naive.V.shape == (T, 2)
        assert s.naive.scores.shape == s.naive.weights.shape == (T, T)
        assert s.cached.q.shape == (1, 2) and s.cached.K_full.shape == (T, 2)
        assert s.cached.scores.shape == (1, T)
        assert torch.equal(s.cached.K_full, x[:T]) and torch.equal(s.cached.V_full, x[:T])
        assert s.max_abs_diff < 1e-12
        assert torch.allclose(s.cached.output, _explicit_attention_last_row(x[:T]), atol=1e-12)
        # Masked entries are exactly zero weight; rows sum to one.
        assert torch.all(s.naive.weights.triu(1) == 0)
        assert torch.allclose(s.naive.weights.sum(-1), torch.ones(T, dtype=torch.float64))


def test_worked_example_with_other_projections_still_agrees():
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(2, 2, generator=g, dtype=torch.float64) for _ in range(3)]
    x = torch.randn(6, 2, generator=g, dtype=torch.float64)
    assert max(s.max_abs_diff for s in worked_example(x, w)) < 1e-12


def test_bad_worked_inputs_raise():
    with pytest.raises(ValueError, match=r"must be a non-empty \[T, 2\] array"):
        worked_example([[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=r"projections must be three \[2, 2\] matrices"):
        naive_step(torch.zeros(2, 2, dtype=torch.float64), [torch.eye(3)] * 3)


def test_source_comparison_flags_exactly_the_wrong_figures():
    rows = compare_with_source(worked_example())
    assert len(rows) == 3 * len(SOURCE_FIGURES)
    for r in rows:
        rounded = tuple(round(v, 3) for v in r.computed)
        # agrees iff every hand figure is within half a unit of the third decimal of the computed
        # value
        assert r.agrees == all(abs(a - b) <= 0.0005 + 1e-9
                               for a, b in zip(r.source, r.computed, strict=True))
        if r.agrees:
            assert all(abs(a - b) <= 0.001 + 1e-9 for a, b in zip(r.source, rounded, strict=True))
    # The scores are all right (they are plain dot products); the source's softmax at steps 2 and 3
    # is not.
    assert all(r.agrees for r in rows if r.quantity == "scores")
    bad = {(r.step, r.quantity) for r in rows if not r.agrees}
    assert {(2, "weights"), (3, "weights"), (2, "output"), (3, "output")} <= bad
    # The source's weights do not follow from its own scores at steps 2 and 3.
    for r in rows:
        if r.quantity == "weights" and r.step in (2, 3):
            assert max(abs(a - b)
                       for a, b in zip(r.from_source_inputs, r.source, strict=True)) > 0.01


def test_full_forward_counts_match_closed_forms():
    for n in range(1, 7):
        r = full_forward("ABCDXA"[:n])
        assert r.counts == expected_counts(0, n)
        assert r.per_layer == [expected_counts(0, n, n_layer=1)] * 2


@pytest.mark.parametrize("past, new", [(0, 1), (0, 4), (2, 1), (3, 2), (5, 3)])
def test_cached_counts_match_closed_forms_and_full_forward(past, new):
    tokens = list(itertools.islice(itertools.cycle("ABCDX"), past + new))
    lab = ToyLab()
    cache = lab.extend(ToyCache.empty(2), tokens[:past]).cache if past else ToyCache.empty(2)
    r = lab.extend(cache, tokens[past:])
    assert r.counts == expected_counts(past, new)
    assert r.per_layer == [expected_counts(past, new, n_layer=1)] * 2
    check = check_against_full(r)
    assert check.ok and check.positions == past + new
    assert cache.seq_len == past  # extend did not modify the cache passed in


def test_check_detects_a_wrong_cache():
    lab = ToyLab()
    r = lab.extend(ToyCache.empty(2), "ABC")
    r.cache.keys[1][0] = (r.cache.keys[1][0][0] + 1e-6, r.cache.keys[1][0][1])
    assert not check_against_full(r).ok


def test_work_counts_rows_obey_closed_forms():
    rows = work_counts()
    assert [r.sequence for r in rows] == ["ABC", "ABCD", "AXCD"]
    for r in rows:
        T = len(r.sequence)
        assert r.past_len + r.new_len == T
        assert r.full == expected_counts(0, T)
        assert r.cached == expected_counts(r.past_len, r.new_len)
        assert r.check.ok
    # Appending one token computes one K/V pair per layer but still reads every key.
    assert rows[1].cached.kv_pairs == 2 and rows[1].cached.dot_products == 2 * 4


def test_prefix_edit_keeps_layer0_key_and_changes_layer1_key():
    lab = ToyLab()
    before = lab.extend(ToyCache.empty(2), "ABCD").cache
    e = prefix_edit(before, "AXCD", lab)
    assert e.prefix_len == common_prefix_len("ABCD", "AXCD") == 1
    assert e.key_changed(0, 0) == 0.0 and e.key_changed(1, 0) == 0.0  # A: untouched prefix
    assert e.key_changed(0, 2) == 0.0  # C in layer 0: its own embedding and position only
    assert e.key_changed(1, 2) > 1e-3  # C in layer 1: it read X instead of B
    assert check_against_full(e.result).ok
    with pytest.raises(ValueError, match="nothing to recompute"):
        prefix_edit(before, "AB", lab)


def test_toy_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown token 'Q'"):
        full_forward("AQ")
    with pytest.raises(ValueError, match="cache has 3 layers, model has 2"):
        ToyLab().extend(ToyCache.empty(3), "A")
    with pytest.raises(ValueError, match="cannot truncate a cache of 0 positions to 1"):
        ToyCache.empty(2).truncate(1)


def test_display_helpers():
    assert latex_matrix(torch.tensor([-0.0001, 2.0])) == (
        r"\begin{bmatrix}0.000 & 2.000\end{bmatrix}")
    assert "<td>a&amp;b</td>" in html_table(["h"], [["a&b"]])
    with pytest.raises(ValueError, match="one cell per header"):
        html_table(["a", "b"], [[1]])
    assert Counts(1, 2) + Counts(3, 4) == Counts(4, 6)


def test_token_helpers_round_trip_and_refuse_bad_text():
    text = "AXCD"
    ids = token_ids(text)
    assert ids.shape == (1, len(text))
    assert token_text(ids[0]).replace(" ", "") == text  # capital letters come back as themselves
    assert token_text([ord("l") - 32]) == f"id {ord('l') - 32}"  # anything else is shown as its id
    for bad in ("", "é", "a\n"):
        with pytest.raises(ValueError, match="non-empty string of printable ASCII"):
            token_ids(bad)
