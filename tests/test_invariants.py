"""The cache invariants and edges of kvdoc.proofs.cache_invariants: each passes on the real code and
fails on the broken variant made for it, which no older scenario catches."""

from __future__ import annotations

import pytest
import torch

from kvdoc.proofs import cache_invariants, contracts
from kvdoc.proofs.broken.cache_kinds import k_only_paged_cache, requantising_int8_cache
from kvdoc.proofs.compare import default_model
from kvdoc.proofs.suite import SCENARIOS, run_suite
from kvdoc.proofs.sweep import sweep_variants
from kvdoc.proofs.variants import VARIANTS
from kvdoc.serving.paged import new_paged_cache
from kvdoc.serving.quant import new_int8_cache

FP32 = dict(dtypes=(torch.float32,))
NEW = ["bytes", "edges", "padded", "int8"]  # the cache invariants and the int8 contract
LATER = ["counted", "invariant", "imported", "evicted"]  # checks added after these
OLD = [s for s in SCENARIOS if s not in NEW and s not in LATER]

# variant -> the check made for it
MADE_FOR = {"pool-counts-k-only": "bytes", "int8-requantise": "int8", "int8-read-v-scale": "int8",
            "ring-long-chunk": "edges", "ring-shared-until-wrap": "edges",
            "prefix-late-copy": "edges", "decode-without-pad-mask": "padded",
            "fast-ignores-padding": "padded"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("check", NEW)
def test_each_new_check_passes_on_the_real_code_and_applies_somewhere(check):
    models = ("mha", "mistral")
    report = run_suite(models=models, scenarios=(check,), **FP32)
    assert report.passed, report.failures_table()
    ran = [r for r in report.results if r.passed is not None]
    assert ran and all(r.check == check for r in report.results)


@pytest.mark.parametrize("variant", list(MADE_FOR))
def test_each_variant_is_caught_by_its_check_only(variant):
    check = MADE_FOR[variant]
    caught = run_suite(variant, scenarios=(check,), **FP32)
    assert caught.failed_checks() == [check], caught.failures_table()
    # none of the older scenarios sees it: the new check is what catches it
    assert run_suite(variant, scenarios=OLD, **FP32).passed


def test_the_sweep_catches_the_new_variants():
    assert {VARIANTS[v].bug_class for v in MADE_FOR} == {
        "byte accounting", "int8 contract", "window and block edges", "padded batches"}
    outcomes = sweep_variants(list(MADE_FOR), **FP32)
    assert [o.name for o in outcomes] == list(MADE_FOR)
    assert all(o.caught for o in outcomes)
    assert [o.first.check for o in outcomes] == list(MADE_FOR.values())


def test_held_tensors_and_bytes_of_a_paged_cache():
    model = default_model()
    cache = new_paged_cache(model, batch=2, capacity=10)
    _, cache = model(torch.tensor([[1, 2, 3, 4, 5]] * 2), cache)
    pool = cache.pool
    assert cache_invariants.byte_problems(cache) == []
    assert cache_invariants.tensor_bytes(cache_invariants.held_tensors(cache)) == pool.nbytes()
    broken = k_only_paged_cache(model, batch=2, capacity=10)
    assert any("pool reports" in p for p in cache_invariants.byte_problems(broken))


def test_int8_rows_keep_their_own_scale_and_half_a_step():
    torch.manual_seed(0)
    written = torch.randn(1, 2, 3, 16)
    model = default_model()
    real = new_int8_cache(model, 1).begin()
    for cache, ok in ((real, True), (requantising_int8_cache(model, 1).begin(), False)):
        cache.update(0, torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16), 0)
        cache.finish(2)
        k = torch.randn(1, 4, 3, 16)
        cache.update(0, k, k, 2)
        got = cache.layer(0)[0][:, :, 2:]
        assert (contracts._row_problems(got, k) == 0.0) is ok
    assert contracts._row_problems(written, written) > 0  # values off the grid of steps


def test_held_tensors_walk_into_a_layer_defined_outside_kvdoc():
    from kvdoc.core.cache import DynamicLayer, KVCache

    class Outside(DynamicLayer):  # this test module's class, not kvdoc's
        pass

    assert Outside.__module__ == __name__ and not __name__.startswith("kvdoc")
    layer = Outside(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    cache = KVCache([layer, Outside(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))], 3)
    assert len(cache_invariants.held_tensors(cache)) == 4
    assert cache_invariants.tensor_bytes(cache_invariants.held_tensors(cache)) == cache.nbytes()
    assert cache_invariants.byte_problems(cache) == []


def test_registries_refuse_what_they_do_not_know():
    """A layer kind with no byte formula, or a layer with no K/V probe, is an error, never a
    check skipped."""
    from kvdoc.core.cache import CacheLayer, KVCache
    from kvdoc.proofs.compare import full_forward_kv

    class Unknown(CacheLayer):
        def read(self, seq_len):
            return self.k, self.v

        def write(self, k, v, start):
            return k, v

        def tensors(self):
            return []

    with pytest.raises(NotImplementedError, match="a Unknown states no byte formula"):
        KVCache([Unknown(1, 2, (4, 4))]).expected_nbytes()
    model = default_model()
    model.h[0].attn = torch.nn.Identity()  # a layout full_forward_kv has no probe for
    with pytest.raises(ValueError, match="no K/V probe for a Identity"):
        full_forward_kv(model, torch.tensor([[1, 2]]))
    assert not any(h for m in model.modules() for h in m._forward_hooks.values())
