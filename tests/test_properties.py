"""Property-based: for random small decoders and random ways to cut a stream into chunks, cached
equals full."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoc import Decoder, GPTConfig
from kvdoc.proofs.compare import TOLERANCE, full_forward_kv, run_cached
from kvdoc.proofs.references import mha_reference
from kvdoc.proofs.variants import VARIANTS


@st.composite
def configs(draw, min_width: int = 1) -> GPTConfig:
    n_kv_head = draw(st.integers(1, 3))
    n_head = n_kv_head * draw(st.integers(1, 3))  # MHA, GQA and MQA
    head_dim = draw(st.integers(1, 8))
    # a multiple of n_head, >= min_width
    n_embd = max(n_head * head_dim, n_head * -(-min_width // n_head))
    return GPTConfig(vocab_size=draw(st.integers(2, 31)), n_positions=16,
                     n_layer=draw(st.integers(1, 3)), n_head=n_head, n_kv_head=n_kv_head,
                     n_embd=n_embd, n_inner=draw(st.integers(1, 32)))


@st.composite
def splits(draw) -> list[int]:
    """A stream of 1 to 16 tokens cut into chunks of random positive lengths."""
    return draw(st.lists(st.integers(1, 6), min_size=1, max_size=6).filter(lambda c: sum(c) <= 16))


@settings(max_examples=30, deadline=None)
@given(config=configs(), chunks=splits(), batch=st.integers(1, 3), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["dynamic", "static"]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_cached_equals_full(config, chunks, batch, seed, kind, dtype):
    torch.manual_seed(seed)
    model = Decoder(config).to(dtype).eval()
    ids = torch.randint(0, config.vocab_size, (batch, sum(chunks)))
    full, full_kv = full_forward_kv(model, ids)
    run = run_cached(model, ids, chunks, kind)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(run.logits, full, atol=tol, rtol=tol)
    assert run.lifecycle_error == 0.0
    assert run.cache.seq_len == ids.shape[1]
    for layer, (k_ref, v_ref) in enumerate(full_kv):
        k, v = run.cache.layer(layer)
        assert k.shape == v.shape == (batch, config.n_kv_head, ids.shape[1], config.head_dim)
        torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
        torch.testing.assert_close(v, v_ref, atol=tol, rtol=tol)


@settings(max_examples=10, deadline=None)
@given(config=configs(min_width=2), chunks=splits().filter(lambda c: len(c) > 1),
       seed=st.integers(0, 2**16))
def test_the_property_fails_for_a_broken_variant(config, chunks, seed):
    """The property can fail: with positions restarted at 0 on each call, cached differs from full.

    Width 1 is left out: LayerNorm over a single feature outputs its bias whatever the input,
    so such a model ignores positions altogether and no position bug can show.
    """
    torch.manual_seed(seed)
    model = Decoder(config).to(torch.float64).eval()
    ids = torch.randint(0, config.vocab_size, (1, sum(chunks)))
    full = model(ids).logits
    run = run_cached(VARIANTS["positions-restart"].build(model), ids, chunks)
    tol = TOLERANCE[torch.float64]
    assert not torch.allclose(run.logits, full, atol=tol, rtol=tol)


@settings(max_examples=15, deadline=None)
@given(config=configs(), seed=st.integers(0, 2**16), length=st.integers(1, 16))
def test_gqa_equals_mha_with_copied_kv_heads(config, seed, length):
    """The independent GQA reference: copying each K/V head over its group of query heads changes
    nothing."""
    torch.manual_seed(seed)
    model = Decoder(config).to(torch.float64).eval()
    ids = torch.randint(0, config.vocab_size, (2, length))
    with torch.no_grad():
        tol = TOLERANCE[torch.float64]
        torch.testing.assert_close(mha_reference(model)(ids), model(ids).logits, atol=tol, rtol=tol)
