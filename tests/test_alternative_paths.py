"""Checks of issue 46 on the grid: an alternative path held to the function outside it (the
batch-invariant mode, from_transformers), an option's other value (FP8 e5m2), and policies
judged by the state they leave (evictions, speculative rollback, a perfect draft). Each check
passes on the implementation and catches its broken variant, which no older check catches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvdoc.proofs import contracts, variants
from kvdoc.proofs.calls import rounds_of_a_perfect_draft
from kvdoc.proofs.suite import run_suite
from kvdoc.serving.speculative import speculative_generate, truncated_draft

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_CHECKS = {"invariant", "invariant_bits", "imported", "evicted", "speculative_state",
              "speculative_perfect"}
"""The checks this file is about: a variant caught by none of the others was missed before."""
FP32, FP64 = (torch.float32,), (torch.float64,)


def _caught(variant: str, **axes) -> list[str]:
    return run_suite(variant, **axes).failed_checks()


@pytest.mark.parametrize(("model", "kind", "scenario", "dtypes"), [
    ("gqa", "dynamic", "invariant", FP32 + FP64),
    ("gemma3", "dynamic", "invariant", FP64),
    ("mla-absorbed", "dynamic", "invariant", FP64),
    ("qwen2", "dynamic", "imported", FP32 + FP64),
    ("mla", "dynamic", "imported", FP32),
    ("llama", "paged", "evicted", FP32 + FP64),
    ("gemma3", "paged", "evicted", FP32),
    ("mistral", "static", "speculative", FP32),
    ("llama", "dynamic", "speculative", FP64)])
def test_the_checks_pass_on_the_implementation(model, kind, scenario, dtypes):
    report = run_suite(models=(model,), kinds=(kind,), impls=("model",), dtypes=dtypes,
                       scenarios=(scenario,), length=40)
    ran = [r for r in report.results if r.passed is not None]
    assert report.passed and ran, report.failures_table()


@pytest.mark.parametrize(("variant", "axes", "by"), [
    ("invariant-tiled-gqa", dict(models=("llama",), dtypes=FP32), "invariant"),
    ("invariant-fp32-in-fp64", dict(models=("gqa",), dtypes=FP64), "invariant"),
    ("import-top-level-rope-theta", dict(dtypes=FP32), "imported"),
    ("evict-first-block", dict(dtypes=FP32), "evicted"),
    ("speculative-stale-draft-row", dict(dtypes=FP32), "speculative_state")])
def test_each_variant_is_caught_by_its_new_check_only(variant, axes, by):
    assert _caught(variant, length=40, **axes) == [by]


def test_the_fp32_mode_in_fp64_is_within_fp32s_tolerance():
    # the bug rounds through FP32: FP32's tolerance cannot see it, FP64's does
    assert _caught("invariant-fp32-in-fp64", models=("gqa",), dtypes=FP32, length=40) == []


def test_the_e5m2_setting_catches_what_e4m3_alone_passes(monkeypatch):
    axes = dict(dtypes=FP32, scenarios=("fp8",), length=40)
    assert "float8_e5m2" in {storage for *_, storage in contracts.FP8_SETTINGS}
    assert _caught("fp8-e5m2-saturates-at-448", **axes) == ["fp8"]
    e4m3 = tuple(s for s in contracts.FP8_SETTINGS if s[2] == "float8_e4m3fn")
    monkeypatch.setattr(contracts, "FP8_SETTINGS", e4m3)
    assert _caught("fp8-e5m2-saturates-at-448", **axes) == []


def test_a_rollback_that_costs_only_acceptance_is_seen_by_a_perfect_draft(monkeypatch):
    def always_the_truncated_draft(target, draft, *args, **kwargs):  # BROKEN: ignores `draft`
        return speculative_generate(target, truncated_draft(target, 1), *args, **kwargs)

    broken = dataclasses.replace(variants.VARIANTS["speculative-stale-draft-row"],
                                 name="ignores-draft",
                                 caches={"speculative": always_the_truncated_draft})
    monkeypatch.setitem(variants.VARIANTS, "ignores-draft", broken)
    assert _caught("ignores-draft", dtypes=FP32, scenarios=("speculative",),
                   length=40) == ["speculative_perfect"]


def test_a_perfect_draft_accepts_k_a_round_until_the_last():
    assert rounds_of_a_perfect_draft(9, 4) == [4, 3]
    assert sum(rounds_of_a_perfect_draft(40, 3)) + len(rounds_of_a_perfect_draft(40, 3)) == 40
    assert rounds_of_a_perfect_draft(0, 3) == []
