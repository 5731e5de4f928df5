"""The FP8 cache: e4m3 values under fixed scales, its refusals, its bytes and its contract."""

from __future__ import annotations

import pytest
import torch

from kvdoc import Decoder, GPTConfig
from kvdoc.measure.kv_bytes import fp8_kv_bytes, int8_kv_bytes
from kvdoc.proofs import contracts
from kvdoc.proofs.broken.cache_kinds import rescaling_fp8_cache, tensor_scale_fp8_cache
from kvdoc.proofs.compare import default_model, default_stream, run_cached
from kvdoc.proofs.suite import SCENARIOS, run_suite
from kvdoc.serving.fp8 import (
    amax_scale,
    calibrate,
    dequantize,
    element_error_bound,
    fp8_cache,
    new_fp8_cache,
    quantize,
    read_error_bound,
    scale_table,
)
from kvdoc.serving.quant import new_int8_cache
from kvdoc.teach import lossy_caches

E4M3 = torch.float8_e4m3fn
FP32 = dict(dtypes=(torch.float32,))
pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("fp8, u", [(torch.float8_e4m3fn, 2**-4), (torch.float8_e5m2, 2**-3)])
def test_each_element_within_its_bound_and_the_bound_is_the_mantissa(fp8, u):
    x = _randn(2, 3, 50, 16, scale=3.0)
    s = torch.tensor(8.0 / torch.finfo(fp8).max)  # values past 8 saturate
    back = dequantize(quantize(x, s, fp8), s, x.dtype)
    err = (back - x).abs().double()
    bound = element_error_bound(x, s, fp8)
    assert bool((err <= bound).all())
    y = x.abs() / s
    fmax, tiny = torch.finfo(fp8).max, torch.finfo(fp8).smallest_normal
    normal = (y >= tiny) & (y <= fmax)
    # within range the relative error is at most u = 2^-(mantissa bits + 1), and reaches near it
    rel = (err / x.abs().double())[normal]
    assert rel.max() <= u * (1 + 1e-6) and rel.max() > u / 2
    saturated = y > fmax
    assert saturated.any() and torch.equal(back[saturated].abs(), torch.full_like(
        back[saturated], fmax * s.item()))
    # every value read back is an FP8 number times the scale
    steps = back.double() / s.double()
    torch.testing.assert_close(steps.to(fp8).double(), steps, rtol=1e-6, atol=0)


def test_first_prefill_scales_are_the_first_rows_and_stay_fixed():
    model = default_model()
    ids = default_stream(length=20)
    for granularity, heads in (("per-tensor", 1), ("per-head", model.config.n_kv_head)):
        empty = new_fp8_cache(model, 2, granularity=granularity)
        _, first = model(ids[:, :5], empty)
        assert not empty.layers[0].fixed and empty.seq_len == 0  # the cache passed in: unchanged
        exact = run_cached(model, ids[:, :5], 5).cache
        for layer in first.layers:
            assert layer.scales[0].shape == (1, heads, 1, 1)
            assert layer.scales[0].dtype == torch.float32
        # layer 0 projects the exact embeddings (later layers' inputs passed through FP8 reads)
        for s, x in zip(first.layers[0].scales, exact.layer(0), strict=True):
            torch.testing.assert_close(s, amax_scale(x, granularity), rtol=1e-6, atol=0)
        held = [t.clone() for t in first.tensors()]
        _, later = model(ids[:, 5:], first)
        for a, b in zip(first.layers, later.layers, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a.scales, b.scales, strict=True))
            assert torch.equal(b.rows[0][:, :, :5], a.rows[0])  # held rows: bitwise
        assert all(torch.equal(a, b) for a, b in zip(held, first.tensors(), strict=True))


def test_calibrated_scales_are_used_as_given_and_values_beyond_saturate():
    model = default_model()
    scales = calibrate(model, default_stream(seed=3, length=20), "per-head") / 4  # too small
    _, cache = model(default_stream(length=20), new_fp8_cache(model, 2, scales=scales))
    assert torch.equal(scale_table(cache), scales)
    k = cache.layers[0].rows[0].float()
    assert k.abs().max() == 448  # a quarter of the range: the largest values saturate


@pytest.mark.parametrize("kwargs, message", [
    (dict(fp8="float8_e4m3"), "cannot store an FP8 cache as 'float8_e4m3'"),
    (dict(fp8=torch.float16), "cannot store an FP8 cache as torch.float16"),
    (dict(fp8=torch.int8), "cannot store an FP8 cache as torch.int8"),
    (dict(granularity="per-channel"), "granularity must be one of per-tensor, per-head"),
    (dict(scales=torch.ones(2, 2)), r"scales must have shape \(2, 2, 4\), got \(2, 2\)"),
    (dict(scales=torch.ones(2, 2, 4, dtype=torch.int32)), "must be a floating-point tensor"),
    (dict(scales=torch.zeros(2, 2, 4)), "must be positive and finite"),
    (dict(scales=torch.full((2, 2, 4), -1.0)), "must be positive and finite"),
    (dict(scales=torch.full((2, 2, 4), float("inf"))), "must be positive and finite"),
    (dict(scales=torch.full((2, 2, 4), float("nan"))), "must be positive and finite"),
    (dict(granularity="per-tensor", scales=torch.ones(2, 2, 4)),
     r"scales must have shape \(2, 2\)"),
    (dict(dtype=torch.int64), "a float of 16 bits or more"),
    (dict(dtype=torch.float8_e4m3fn), "a float of 16 bits or more"),
])
def test_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fp8_cache(GPTConfig(), 1, **kwargs)


def test_a_refused_first_prefill_leaves_the_cache_unchanged():
    cache = fp8_cache(GPTConfig(), 1)
    work = cache.begin()
    k = torch.zeros(1, 4, 3, 16)
    k[0, 0, 0, 0] = float("nan")
    before = [t.clone() for t in work.tensors()]
    with pytest.raises(ValueError, match="not finite"):
        work.update(0, k, torch.zeros_like(k), 0)
    assert not work.layers[0].fixed and work.seq_len == 0
    assert all(torch.equal(a, b) for a, b in zip(before, work.tensors(), strict=True))
    with pytest.raises(ValueError, match=r"must be torch\.float32"):
        work.update(0, k.double(), k.double(), 0)


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
def test_bytes_count_the_real_tensors(granularity):
    config = GPTConfig(n_kv_head=2)
    torch.manual_seed(0)
    model = Decoder(config).eval()
    cache = run_cached(model, default_stream(length=11), 3,
                       cache=new_fp8_cache(model, 2, granularity=granularity)).cache
    real = sum(t.numel() * t.element_size() for t in cache.tensors())
    assert all(t.dtype in (E4M3, torch.float32) for t in cache.tensors())
    assert real == cache.nbytes() == cache.expected_nbytes() == fp8_kv_bytes(
        2, config.n_layer, 11, config.n_kv_head, config.head_dim, granularity)
    int8 = run_cached(model, default_stream(length=11), 3, cache=new_int8_cache(model, 2)).cache
    assert int8.nbytes() == int8_kv_bytes(2, config.n_layer, 11, config.n_kv_head,
                                          config.head_dim)


def test_read_bound_holds_with_groups_and_saturation():
    q = _randn(2, 6, 5, 8, seed=1)
    k, v = _randn(2, 2, 9, 8, seed=2, scale=2.0), _randn(2, 2, 9, 8, seed=3)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))

    def error(K, sk, V, sv):
        K, V = dequantize(K, sk, k.dtype), dequantize(V, sv, v.dtype)
        return (torch.nn.functional.scaled_dot_product_attention(
            q, K.repeat_interleave(3, 1), V.repeat_interleave(3, 1)) - exact).abs()

    for shrink in (1, 4):  # scales a quarter of the range: the largest K and V saturate
        sk, sv = amax_scale(k, "per-head") / shrink, amax_scale(v, "per-head") / shrink
        bound = read_error_bound(q, k, v, sk, sv)
        assert bool((error(quantize(k, sk), sk, quantize(v, sv), sv) <= bound).all())
    # a read of V that forgot its scale is far outside it
    sk, sv = amax_scale(k, "per-head"), amax_scale(v, "per-head")
    forgot = error(quantize(k, sk), sk, quantize(v, sv), torch.ones_like(sv))
    assert not bool((forgot <= read_error_bound(q, k, v, sk, sv)).all())


def test_row_breach_sees_a_scale_applied_per_tensor():
    x = torch.stack([_randn(1, 1, 4, 8, seed=4), _randn(1, 1, 4, 8, seed=5) * 10], 1)[:, :, 0]
    s = amax_scale(x, "per-head")
    assert contracts.row_breach(dequantize(quantize(x, s), s, x.dtype), x, s) == 0.0
    wrong = dequantize(quantize(x, s.amax()), s, x.dtype)  # per-tensor write, per-head read
    assert contracts.row_breach(wrong, x, s) > 1.0


def test_the_contract_passes_and_only_it_catches_the_broken_cache():
    report = run_suite(models=("mha", "gqa", "llama"), kinds=("dynamic",), impls=("model",),
                       scenarios=("fp8",), **FP32)
    assert report.passed, report.failures_table()
    ran = [r for r in report.results if r.passed is not None]
    # each model and setting in FP32, and again rounded to BF16 and FP16
    assert len(ran) == 3 * len(contracts.FP8_SETTINGS) * 3
    assert {r.dtype for r in ran} == {"FP32", "BF16", "FP16"}
    others = [s for s in SCENARIOS if s != "fp8"]
    for variant in ("fp8-tensor-scale-write", "fp8-rescale-each-write"):
        caught = run_suite(variant, scenarios=("fp8",), **FP32)
        assert caught.failed_checks() == ["fp8"], caught.failures_table()
        assert run_suite(variant, scenarios=others, **FP32).passed
    # the broken layer is right with per-tensor scales: the per-head setting is what shows it
    model = default_model(config=GPTConfig(n_kv_head=2))
    ids = default_stream(length=9)
    for granularity, same in (("per-tensor", True), ("per-head", False)):
        good = run_cached(model, ids, 3, cache=new_fp8_cache(model, 2, granularity=granularity))
        bad = run_cached(model, ids, 3,
                         cache=tensor_scale_fp8_cache(model, 2, granularity=granularity))
        assert torch.equal(good.logits, bad.logits) == same


def test_rescaling_is_right_for_one_call_and_wrong_after():
    model = default_model()
    ids = default_stream(length=9)
    one = [model(ids, new(model, 2))[0] for new in (new_fp8_cache, rescaling_fp8_cache)]
    assert torch.equal(*one)  # a single call takes its scales once either way
    two = [run_cached(model, ids, 3, cache=new(model, 2)).cache
           for new in (new_fp8_cache, rescaling_fp8_cache)]
    good, bad = (c.layer(0)[0][:, :, :3] for c in two)  # the first call's rows, read at the end
    assert not torch.equal(good, bad)


def test_measurements_are_observations_with_sane_ranges(model):
    rows = lossy_caches.measure_fp8(model, default_stream(length=30), default_stream(seed=2))
    assert [(r.granularity, r.source) for r in rows] == [
        ("per-tensor", "first prefill"), ("per-tensor", "calibrated"),
        ("per-head", "first prefill"), ("per-head", "calibrated")]
    for r in rows:
        assert 0 <= r.agree <= r.positions == 60
        # generous sanity bound only: K/V within 2^-4 of themselves move the logits far less
        assert r.logit_error < 0.1 * r.logit_scale
    settings = [("per-tensor", None), ("per-head", None)]
    agreements = lossy_caches.greedy_agreement(model, torch.tensor([[1, 2, 3]]), 30, settings)
    assert len(agreements) == 2
    for a in agreements:
        assert a.steps == 30 and 0 <= a.first <= 30
        assert (a.margin is None) == (a.first == 30)
