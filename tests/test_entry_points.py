"""``generate_padded`` on the grid, and split-K crossed with a padded batch."""

import torch

from kvdoc.proofs.suite import run_suite
from kvdoc.proofs.sweep import sweep_variants


def test_generate_padded_rows_equal_their_solo_runs_on_every_model():
    report = run_suite(scenarios=["generate_padded"], kinds=("dynamic",), impls=("model",),
                       dtypes=(torch.float32,), length=24)
    ran = [r for r in report.select("generate_padded") if r.passed is not None]
    assert report.passed and len(ran) == len({r.model for r in report.results}) >= 8


def test_unmasked_decode_is_caught_by_generate_padded_only():
    (outcome,) = sweep_variants(["generate-padded-unmasked-decode"], stop_at_first=False,
                                dtypes=(torch.float32,), length=24,
                                scenarios=["generate_padded", "padded", "last_only"])
    assert outcome.report.failed_checks() == ["generate_padded"]


def test_split_k_pad_leak_is_caught_by_both_padded_checks():
    (outcome,) = sweep_variants(["split-k-pad-leak"], stop_at_first=False,
                                dtypes=(torch.float32,), length=24,
                                scenarios=["generate_padded", "padded", "last_only", "stream"])
    assert sorted(outcome.report.failed_checks()) == ["generate_padded", "padded"]
