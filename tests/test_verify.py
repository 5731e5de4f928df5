"""The equivalence checker: it passes on the real decoder, and every check in it can fail."""

from __future__ import annotations

import math

import pytest
import torch

from kvdoc.__main__ import main as cli
from kvdoc.broken import VARIANTS, stale_prefix
from kvdoc.verify import (FullReport, VariantResult, chunk_lengths, cross_check_transformers, default_model,
                          run_cached, split_error, verify, verify_all)

SMALL = dict(batches=(2,), chunks=(1, 2), dtypes=(torch.float32,))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors run faster on one thread than on two that contend with other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_real_implementation_passes_the_full_grid():
    report = verify()
    assert len(report.rows) == 24  # 2 caches x 2 batches x 3 chunk sizes x 2 dtypes
    assert report.passed, report.to_markdown()
    assert {(r.kind, r.batch, r.chunk, r.dtype) for r in report.rows} == {
        (k, b, c, d) for k in ("dynamic", "static") for b in (1, 2) for c in (1, 2, 5) for d in ("FP32", "FP64")}
    for row in report.rows:
        assert len(row.per_position) == 24
        assert max(row.per_position) == row.logit_error <= row.tol
        assert row.causal_error == 0.0 and row.lifecycle_error == 0.0
    assert report.max_error("FP64") < 1e-3 * report.max_error("FP32")  # FP64 errors are rounding, far smaller


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_broken_variant_is_caught(name):
    report = verify(name, **SMALL)
    assert not report.passed, report.to_markdown()
    assert report.max_error() > 1e-2  # far above any rounding error


def test_each_check_can_fail_on_its_own_bug():
    """Which checks fail says what is broken; some bugs escape one check and are caught by another."""
    cross = verify("cross-layer-cache", **SMALL)
    assert cross.failed_checks() == ["logits"]  # the stored K/V are right; only the logits show it
    nbo = verify("new-before-old", batches=(2,), chunks=(1,), dtypes=(torch.float32,), kinds=("dynamic",))
    row = nbo.rows[0]
    assert row.checks["logits"] and not row.checks["kv"]  # one key at a time: order is invisible to attention
    nbo_static = verify("new-before-old", batches=(1,), chunks=(2,), dtypes=(torch.float32,), kinds=("static",))
    assert not nbo_static.rows[0].checks["lifecycle"]  # rows below the write position were rewritten
    for name in ("no-mask", "off-by-one-mask"):
        assert "causality" in verify(name, **SMALL).failed_checks()
    top_left = verify("top-left-mask", **SMALL)
    assert top_left.row("dynamic", 2, 1, "FP32").logit_error > 1e-2  # is_causal=True breaks one-token decode too


def test_cli_passes_on_the_real_implementation(capsys):
    assert cli(["verify", "--no-variants"]) == 0
    out = capsys.readouterr().out
    assert out.count("| pass |") == 24 and out.rstrip().endswith("PASS")


def test_sweep_fails_if_a_broken_variant_passes():
    full = verify_all(["positions-restart", "cross-layer-cache"], **SMALL)
    assert full.passed and all(v.caught for v in full.variants)
    assert "| yes |" in full.variants_markdown()
    escaped = VariantResult("pretend", "nothing", full.real, False, 0.0, [])  # a variant the grid missed
    assert not FullReport(full.real, [*full.variants, escaped]).passed


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cli_fails_when_pointed_at_a_broken_variant(name, capsys):
    assert cli(["verify", "--variant", name]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_lifecycle_check_sees_a_mutated_dynamic_cache():
    model = default_model()

    class Mutating(type(model)):
        def forward(self, idx, cache=None, **kw):
            if cache is not None and cache.seq_len:
                cache.layer(0)[0].add_(1.0)  # writes into the cache it was given
            return super().forward(idx, cache, **kw)

    model.__class__ = Mutating
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    assert run_cached(model, ids, 2, "dynamic").lifecycle_error >= 1.0


def test_source_experiment_four_cached_two_new():
    model = default_model()
    ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
    assert split_error(model, ids, 4) < 1e-5
    assert split_error(model, ids, 4, "positions-restart") > 1e-1
    assert split_error(model, ids, 4, "top-left-mask") > 1e-2


def test_transformers_cross_check():
    result = cross_check_transformers(chunks=(1, 5), kinds=("dynamic",))
    assert result.n_parameters == (145_280, 145_280)
    assert result.logit_scale > 1e-2
    assert result.full < 1e-5 and result.hf_cached < 1e-5
    assert set(result.cached) == {("dynamic", 1), ("dynamic", 5)}
    assert max(result.cached.values()) < 1e-5


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        verify("no-such-variant")
    with pytest.raises(ValueError, match="sum to 6"):
        chunk_lengths(6, [4, 1])
    with pytest.raises(ValueError, match="positive"):
        chunk_lengths(6, 0)
    with pytest.raises(ValueError, match="rows of ids"):
        verify(batches=(3,))
    with pytest.raises(ValueError, match="cached must be"):
        split_error(default_model(), torch.tensor([[1, 2]]), 2)
    with pytest.raises(ValueError, match="non-empty"):
        stale_prefix(torch.tensor([1, 2]), 97)


def test_errors_are_infinite_on_nan():
    from kvdoc.verify import _max_abs
    assert _max_abs(torch.tensor([float("nan")]), torch.tensor([0.0])) == math.inf
    assert _max_abs(torch.zeros(2), torch.zeros(3)) == math.inf
