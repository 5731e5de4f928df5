"""kvdoc.core.fast: the fast decode step computes the model's function, follows its weights,
refuses alike."""

from __future__ import annotations

import pytest
import torch

from kvdoc import Decoder, GPTConfig
from kvdoc.core.fast import FastDecoder
from kvdoc.core.feed import feed
from kvdoc.core.mla import MLAConfig, MLADecoder
from kvdoc.proofs.compare import TOLERANCE as TOL
from kvdoc.teach import refusals


def _model(dtype: torch.dtype = torch.float32, **cfg) -> Decoder:
    torch.manual_seed(0)
    return Decoder(GPTConfig(**cfg)).eval().to(dtype)


def _decode(step, model: Decoder, ids: torch.Tensor, prompt: int,
            kind: str) -> tuple[torch.Tensor, object]:
    """Prefill ``prompt`` tokens, then feed the rest one at a time through ``step``; stacked
    logits."""
    _, cache = model(ids[:, :prompt], model.new_cache(ids.shape[0], kind, capacity=ids.shape[1]))
    return feed(step, ids[:, prompt:], cache, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 3])
def test_equals_the_full_forward(dtype, n_kv_head, kind, batch):
    model = _model(dtype, n_kv_head=n_kv_head)
    fast = FastDecoder(model)
    ids = torch.randint(0, 97, (batch, 11), generator=torch.Generator().manual_seed(batch))
    full = model(ids).logits  # [B, 11, V]: one forward over the whole sequence
    logits, cache = _decode(fast, model, ids, 6, kind)
    assert logits.shape == (batch, 5, 97) and logits.dtype == dtype
    torch.testing.assert_close(logits, full[:, 6:], atol=TOL[dtype], rtol=0)
    # the cache it wrote holds what the model's own cached path writes
    _, reference = _decode(model, model, ids, 6, kind)
    assert type(cache) is type(reference) and cache.seq_len == reference.seq_len == 11
    for layer in range(model.config.n_layer):
        for mine, theirs in zip(cache.layer(layer), reference.layer(layer), strict=True):
            assert mine.shape == theirs.shape == (batch, n_kv_head, 11, model.config.head_dim)
            torch.testing.assert_close(mine, theirs, atol=TOL[dtype], rtol=0)


def test_single_token_decode_does_not_call_the_model():
    model = _model()
    fast = FastDecoder(model)
    _, cache = fast(torch.tensor([[1, 2, 3]]), model.new_cache(1, "static", capacity=8))
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    fast(torch.tensor([[4]]), cache)
    assert calls == []
    fast(torch.tensor([[5, 6]]), cache)  # a chunk: delegated to the model
    assert calls == [1] and cache.seq_len == 6


def test_same_cache_semantics_as_the_model():
    model = _model()
    fast = FastDecoder(model)
    _, dynamic = model(torch.tensor([[1, 2, 3]]), model.new_cache(1))
    before = [t.clone() for t in dynamic.tensors()]
    _, longer = fast(torch.tensor([[4]]), dynamic)
    assert longer is not dynamic and dynamic.seq_len == 3 and longer.seq_len == 4
    # the passed-in cache is untouched
    assert all(torch.equal(a, b) for a, b in zip(before, dynamic.tensors(), strict=True))
    static = model.new_cache(1, "static", capacity=8)
    _, static = model(torch.tensor([[1, 2, 3]]), static)
    _, same = fast(torch.tensor([[4]]), static)
    assert same is static and static.seq_len == 4  # written in place, like the model


def _check_follows(model: Decoder, fast: FastDecoder) -> None:
    dtype = model.wte.weight.dtype
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    logits, _ = _decode(fast, model, ids, 3, "static")
    # a tied head gives logits of magnitude ~10, so the tolerance is relative as well
    torch.testing.assert_close(logits, model(ids).logits[:, 3:], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("change",
                         ["in-place", "load_state_dict", "tie", "dtype", "data", "module",
                          "bias", "norm-data"])
def test_never_serves_stale_weights(change):
    model = _model()
    fast = FastDecoder(model)
    _check_follows(model, fast)  # copies taken and used once
    with torch.no_grad():
        if change == "in-place":
            model.h[1].mlp.c_fc.weight.mul_(1.5)
        elif change == "load_state_dict":
            torch.manual_seed(1)
            model.load_state_dict(Decoder(GPTConfig()).state_dict())
        elif change == "tie":
            model.lm_head.weight = model.wte.weight
        elif change == "dtype":
            model.double()
        elif change == "data":
            model.h[0].attn.c_attn.weight.data = torch.randn_like(model.h[0].attn.c_attn.weight)
        elif change == "module":
            torch.manual_seed(2)
            model.ln_f = torch.nn.LayerNorm(64).eval()
            model.ln_f.bias.normal_()
        elif change == "bias":  # read from the parameter itself, not a copy
            model.h[1].attn.c_attn.bias.add_(0.5)
        elif change == "norm-data":
            model.h[0].ln_2.weight.data = torch.rand_like(model.h[0].ln_2.weight) + 0.5
    _check_follows(model, fast)


def test_refuses_models_without_version_counters():
    with torch.inference_mode():
        model = Decoder(GPTConfig())
    with pytest.raises(ValueError, match="inference_mode"):
        FastDecoder(model)
    with pytest.raises(ValueError, match="wraps a kvdoc Decoder"):
        FastDecoder(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"got MLADecoder \(config MLAConfig\)"):
        FastDecoder(MLADecoder(MLAConfig()))


MODEL_CALLS = [r for r in refusals.CATALOGUE if r.call.startswith("model(")]


@pytest.mark.parametrize("refusal", MODEL_CALLS, ids=[r.key for r in MODEL_CALLS])
def test_refusals_identical_to_the_model(refusal, monkeypatch):
    expected = refusals.attempt(refusal)
    make = refusals.Fixtures.make

    def with_fast() -> refusals.Fixtures:
        fx = make()
        fx.model = FastDecoder(fx.model)
        return fx

    monkeypatch.setattr(refusals.Fixtures, "make", staticmethod(with_fast))
    outcome = refusals.attempt(refusal)
    assert outcome.ok, outcome.explain()
    assert (outcome.raised, outcome.message) == (expected.raised, expected.message)


def test_single_token_refusals_leave_the_cache_unchanged():
    model = _model()
    fast = FastDecoder(model)
    _, cache = model(torch.tensor([[1, 2, 3]]), model.new_cache(1, "static", capacity=4))
    before = [t.clone() for t in cache.tensors()]
    for bad in (torch.tensor([[97]]), torch.tensor([[-3]])):
        with pytest.raises(ValueError, match="outside the vocabulary") as ours:
            fast(bad, cache)
        with pytest.raises(ValueError, match="outside the vocabulary") as theirs:
            model(bad, cache)
        assert str(ours.value) == str(theirs.value)
        assert "outside the vocabulary 0..96" in str(ours.value)
    assert cache.seq_len == 3
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors(), strict=True))


def test_runs_through_the_verify_harness():
    """What kvdoc.proofs.compare needs to run the fast step as one more implementation: chunked runs
    through ``run_cached`` agree with the model's full forward, K/V included, and never write
    to what a cache already held."""
    from kvdoc.proofs.compare import default_stream, full_forward_kv, run_cached

    model = _model()
    fast = FastDecoder(model)
    ids = default_stream()
    full, full_kv = full_forward_kv(model, ids)
    for kind in ("dynamic", "static"):
        for chunk in (1, 2, 5):
            run = run_cached(fast, ids, chunk, kind)
            torch.testing.assert_close(run.logits, full, atol=TOL[torch.float32], rtol=0)
            assert run.lifecycle_error == 0.0
            for layer, (k, v) in enumerate(full_kv):
                got_k, got_v = run.cache.layer(layer)
                torch.testing.assert_close(got_k, k, atol=TOL[torch.float32], rtol=0)
                torch.testing.assert_close(got_v, v, atol=TOL[torch.float32], rtol=0)


def test_refresh_after_an_edit_through_data():
    model = _model()
    fast = FastDecoder(model)
    model.h[0].mlp.c_proj.weight.data.mul_(3.0)  # bypasses version counters, as documented
    fast.refresh()
    _check_follows(model, fast)


def test_index_dtypes_behave_as_in_the_model():
    model = _model()
    fast = FastDecoder(model)
    for dtype in (torch.int32, torch.int16):
        outcomes = []
        for step in (model, fast):
            _, cache = model(torch.tensor([[1, 2, 3]]), model.new_cache(1, "static", capacity=8))
            try:
                outcomes.append(step(torch.tensor([[4]], dtype=dtype), cache).logits)
            except Exception as exc:
                outcomes.append((type(exc), str(exc), cache.seq_len))
        if isinstance(outcomes[0], torch.Tensor):
            torch.testing.assert_close(outcomes[1], outcomes[0], atol=1e-5, rtol=0)
        else:
            assert outcomes[1] == outcomes[0], dtype


def test_padding_keywords_go_to_the_model():
    model = _model()
    fast = FastDecoder(model)
    _, cache = model(torch.tensor([[1, 2, 3]]), model.new_cache(1, "static", capacity=8))
    seen = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs),
                                           with_kwargs=True)
    token, positions = torch.tensor([[4]]), torch.tensor([[3]])
    mask = torch.ones(1, 1, 4, dtype=torch.bool)
    logits, cache = fast(token, cache, positions=positions, attn_mask=mask)
    assert len(seen) == 1 and seen[0]["positions"] is positions and seen[0]["attn_mask"] is mask
    hook.remove()
    _, reference = model(torch.tensor([[1, 2, 3]]), model.new_cache(1, "static", capacity=8))
    torch.testing.assert_close(logits, model(token, reference).logits, atol=TOL[torch.float32],
                               rtol=0)
    with pytest.raises(TypeError):  # a keyword neither takes
        fast(torch.tensor([[5]]), cache, unknown_hook=True)
    assert cache.seq_len == 4
