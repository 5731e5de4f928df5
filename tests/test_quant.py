"""The int8 cache: an approximation whose error is bounded by its quantisation step."""

import pytest
import torch

from kvdoc import GPTConfig
from kvdoc.proofs.compare import run_cached
from kvdoc.serving.quant import cache_bytes, dequantize, int8_cache, new_int8_cache, quantize
from kvdoc.teach.serving_checks import measure_int8


def test_round_trip_within_half_a_step():
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(0)) * 5
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.shape == (2, 3, 7, 1)
    assert int(q.abs().max()) == 127  # the largest |value| of each row maps to 127
    # Each value comes back within half a quantisation step (plus FP32 rounding of x / scale).
    assert bool(((dequantize(q, s) - x).abs() <= s * (0.5 + 1e-5)).all())
    zq, zs = quantize(torch.zeros(1, 1, 1, 4))
    assert torch.equal(dequantize(zq, zs), torch.zeros(1, 1, 1, 4))


@pytest.mark.parametrize("n_kv_head", [4, 1])
def test_cache_error_is_bounded_by_the_step(stream, n_kv_head):
    torch.manual_seed(0)
    from kvdoc import Decoder
    model = Decoder(GPTConfig(n_kv_head=n_kv_head)).eval()
    cache = run_cached(model, stream, 5, cache=new_int8_cache(model, 2)).cache
    exact = run_cached(model, stream, 5).cache
    for i in range(model.config.n_layer):
        for got, ref in zip(cache.layer(i), exact.layer(i), strict=True):
            assert got.shape == ref.shape == (2, n_kv_head, 24, 16)  # [B, H_kv, T, D_h]
    # Layer 0 projects the exact embeddings, so its K/V are off by rounding alone; later layers'
    # inputs have already passed through int8 attention, so theirs drift further (measured).
    for got, ref in zip(cache.layer(0), exact.layer(0), strict=True):
        step = ref.abs().amax(-1, keepdim=True) / 127
        assert bool(((got - ref).abs() <= step * (0.5 + 1e-4) + 1e-6).all())


def test_measure_and_sanity_bound(model, stream):
    rows = measure_int8(model, stream, batches=(2,), chunks=(1, 5))
    assert [(r.batch, r.chunk, r.positions) for r in rows] == [(2, 1, 48), (2, 5, 48)]
    for r in rows:
        assert 0 <= r.agree <= r.positions
        # Generous sanity bound only: K/V are within 1/254 of their row maxima, the logits are
        # nowhere near 10% of their own scale off.
        assert r.logit_error < 0.1 * r.logit_scale


def test_bytes():
    b = cache_bytes(GPTConfig(), batch=2, length=10)
    per_row = 2 * 2 * 4  # K and V x layers x H_kv
    assert b["FP32"] == per_row * 2 * 10 * 16 * 4
    assert b["FP16"] == per_row * 2 * 10 * 16 * 2
    assert b["int8 + FP32 scales"] == per_row * 2 * 10 * (16 + 4)


def test_cache_passed_in_is_unchanged_and_bad_writes_refused(model, stream):
    _, cache = model(stream[:, :4], new_int8_cache(model, 2))
    before = [t.clone() for t in cache.tensors()]
    model(stream[:, 4:8], cache)
    assert cache.seq_len == 4
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors(), strict=True))
    k = torch.zeros(2, 4, 1, 16)
    with pytest.raises(ValueError, match="write starts at 0"):
        cache.update(0, k, k, start=0)
    with pytest.raises(ValueError, match=r"must be torch\.float32"):
        cache.begin().update(0, k.double(), k.double(), start=4)
    with pytest.raises(ValueError, match="batch_size"):
        int8_cache(GPTConfig(), 0)


@pytest.mark.parametrize("dtype, unit", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
def test_narrow_dtypes_keep_their_derived_bound(dtype, unit):
    from kvdoc.proofs.contracts import half_step

    x = (torch.randn(4, 4, 256, 16, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    step = x.double().abs().amax(-1, keepdim=True) / 127
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.dtype == dtype
    error = ((dequantize(q, s).double() - x.double()).abs() / step).amax().item()
    assert 0.5 < error <= half_step(unit)  # past half a step: the dtype's rounding of q * s
    naive = torch.round(x / s).clamp(-127, 127) * s  # x / s and q * s in the narrow dtype
    assert ((naive.double() - x.double()).abs() / step).amax().item() > half_step(unit)
