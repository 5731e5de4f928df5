"""The ``counted`` check: measure functions against filled caches and counted operations."""

import torch

from kvdoc.proofs.suite import run_suite
from kvdoc.proofs.sweep import sweep_variants


def test_counted_passes_on_each_family_and_ring():
    report = run_suite(models=("gqa", "mistral", "mla", "gemma3"), scenarios=["counted"],
                       dtypes=(torch.float32,), kinds=("dynamic", "window", "hybrid"))
    ran = [r for r in report.select("counted") if r.passed is not None]
    assert report.passed and {(r.model, r.kind) for r in ran} == {
        ("gqa", "dynamic"), ("mistral", "dynamic"), ("mistral", "window"),
        ("mla", "dynamic"), ("gemma3", "dynamic"), ("gemma3", "hybrid")}
    assert all("step_flops" in r.detail for r in ran if r.model in ("gqa", "mistral")
               and r.kind == "dynamic")


def test_each_wrong_measure_is_caught_by_counted_only():
    outcomes = sweep_variants(["mla-bytes-without-rope-key", "step-kv-per-sequence"],
                              stop_at_first=False, dtypes=(torch.float32,), length=24,
                              scenarios=["counted", "bytes", "last_only"])
    assert [(o.name, o.report.failed_checks()) for o in outcomes] == [
        ("mla-bytes-without-rope-key", ["counted"]), ("step-kv-per-sequence", ["counted"])]
