"""The core promise: the cached path computes the same function as full recompute."""

import pytest
import torch

from kvdoc import Decoder, GPTConfig, decode_step, generate, llama_config, prefill
from kvdoc.proofs.compare import TOLERANCE
from kvdoc.serving.quant import Int8Layer


def chunked(model, ids, chunk, kind):
    """Feed ids in chunks of `chunk` (the last may be short); return logits [B, T, V], cache."""
    cache = model.new_cache(ids.shape[0], kind)
    out = []
    for s in range(0, ids.shape[1], chunk):
        logits, cache = model(ids[:, s:s + chunk], cache)
        out.append(logits)
    return torch.cat(out, dim=1), cache


def full_kv(model, ids):
    """Every layer's K and V of a full forward, read off the attention projections."""
    _, cache = model(ids, model.new_cache(ids.shape[0], "dynamic"))
    return [cache.layer(i) for i in range(model.config.n_layer)]


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("batch", [1, 2])
def test_cached_equals_full(model, stream, kind, dtype, chunk, batch):
    model = model.to(dtype)
    ids = stream[:batch]
    with torch.no_grad():
        full = model(ids).logits
        cached, cache = chunked(model, ids, chunk, kind)
        # K/V: a single full pass through a fresh cache, against the chunked cache.
        reference = full_kv(model, ids)
    tol = TOLERANCE[dtype]
    assert cached.shape == full.shape == (batch, 24, 97)
    torch.testing.assert_close(cached, full, atol=tol, rtol=tol)
    assert cache.seq_len == 24
    for layer, (k_ref, v_ref) in enumerate(reference):
        k, v = cache.layer(layer)
        assert k.shape == v.shape == (batch, 4, 24, 16)
        torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
        torch.testing.assert_close(v, v_ref, atol=tol, rtol=tol)


def test_cached_path_is_not_trivially_equal(model, stream):
    """The comparison above can fail: feeding a chunk at the wrong position changes the logits."""
    with torch.no_grad():
        full = model(stream[:1]).logits
        _, cache = model(stream[:1, :4], model.new_cache(1))
        restarted = model(stream[:1, 4:6]).logits  # same tokens, positions 0-1 instead of 4-5
    assert (restarted - full[:, 4:6]).abs().max() > 1e-2


def test_dynamic_cache_passed_in_is_unchanged(model, stream):
    with torch.no_grad():
        _, cache = model(stream[:, :6], model.new_cache(2))
        before = [tuple(t.clone() for t in cache.layer(i)) for i in range(2)]
        _, after = model(stream[:, 6:9], cache)
    assert cache.seq_len == 6 and after.seq_len == 9 and after is not cache
    for i in range(2):
        for old, now in zip(before[i], cache.layer(i), strict=True):
            assert torch.equal(old, now)


def test_static_cache_keeps_rows_below_write_position(model, stream):
    cache = model.new_cache(2, "static", capacity=16)
    with torch.no_grad():
        model(stream[:, :6], cache)
        before = [tuple(t.clone() for t in cache.layer(i)) for i in range(2)]
        _, same = model(stream[:, 6:9], cache)
    assert same is cache and cache.seq_len == 9
    for i in range(2):
        k, v = cache.layer(i)
        assert torch.equal(k[:, :, :6], before[i][0]) and torch.equal(v[:, :, :6], before[i][1])


def test_last_only_matches_last_row(model, stream):
    with torch.no_grad():
        full = model(stream).logits
        last = model(stream, last_only=True).logits
    assert last.shape == (2, 1, 97)
    torch.testing.assert_close(last, full[:, -1:])


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_generate_equals_argmax_of_full_recompute(model, kind):
    prompt = torch.tensor([[5, 9, 2], [1, 1, 1]])
    out = generate(model, prompt, 6, cache=kind)
    ids = prompt
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)


def test_generate_fills_a_cache_it_is_given(model):
    from kvdoc.serving.paged import new_paged_cache

    prompt = torch.tensor([[5, 9, 2], [1, 1, 1]])
    want = generate(model, prompt, 6)
    for cache in (model.new_cache(2, "static", capacity=9), new_paged_cache(model, 2, 9)):
        assert torch.equal(generate(model, prompt, 6, cache=cache), want)
    with torch.no_grad():
        filled = model(prompt, model.new_cache(2)).cache
    with pytest.raises(ValueError, match="fills an empty cache, not one of 3 positions"):
        generate(model, prompt, 6, cache=filled)
    with pytest.raises(ValueError, match="over capacity"):  # the model's own check, first
        generate(model, prompt, 6, cache=model.new_cache(2, "static", capacity=4))


def test_prefill_and_decode_step(model, stream):
    with torch.no_grad():
        logits, cache = prefill(model, stream[:, :5])
        assert logits.shape == (2, 1, 97) and cache.seq_len == 5
        step, cache = decode_step(model, stream[:, 5], cache)
        full = model(stream[:, :6]).logits[:, -1]
        torch.testing.assert_close(step[:, 0], full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one token per row"):
        decode_step(model, stream[:, 6:8], cache)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention(kv_heads):
    torch.manual_seed(3)
    model = Decoder(GPTConfig(n_kv_head=kv_heads)).double()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        full = model(ids).logits
        cached, cache = chunked(model, ids, 3, "static")
    assert cache.layer(0)[0].shape == (2, kv_heads, 11, 16)
    torch.testing.assert_close(cached, full, atol=1e-10, rtol=1e-10)


# Bad input (a clear error, the cache exactly as it was) is tested from the catalogue in
# kvdoc.teach.refusals, by tests/test_bad_inputs.py.


def test_crop_is_in_place_for_every_kind(model, stream):
    """crop means one thing: forget positions from ``length`` on, in this cache, and return it."""
    from kvdoc.core.model import mistral_config
    from kvdoc.serving.paged import new_paged_cache, new_shared_prefix_cache
    from kvdoc.serving.quant import new_int8_cache

    with torch.no_grad():
        want = model(stream[:, :3], model.new_cache(2)).cache
        caches = [model.new_cache(2), model.new_cache(2, "static", capacity=10),
                  new_paged_cache(model, 2, 10), new_shared_prefix_cache(model, 2, 10),
                  new_int8_cache(model, 2)]
        for empty in caches:
            cache = model(stream[:, :8], empty).cache
            assert cache.crop(3) is cache and cache.seq_len == 3, type(cache).__name__
            if not isinstance(cache.layers[0], Int8Layer):  # int8 rows are rounded
                for i in range(2):
                    torch.testing.assert_close(cache.layer(i)[0], want.layer(i)[0])
            with pytest.raises(ValueError, match="cannot crop"):
                cache.crop(9)
        windowed = Decoder(mistral_config(sliding_window=4)).eval()
        ring = windowed(stream[:, :8], windowed.new_cache(2)).cache
        with pytest.raises(ValueError, match="cannot go back"):
            ring.crop(3)
        assert ring.seq_len == 8


# --- per-row positions: RoPE turned at each row's own positions --------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_apply_rope_with_positions_equals_the_int_path_row_by_row(dtype):
    from kvdoc.core.model import apply_rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, 8, generator=g, dtype=dtype)
    starts = [0, 7, 300]
    rows = apply_rope(x, torch.tensor([[s + j for j in range(5)] for s in starts]), 500000.0)
    for b, s in enumerate(starts):
        assert torch.equal(rows[b], apply_rope(x, s, 500000.0)[b])
    assert torch.equal(apply_rope(x, torch.arange(7, 12), 10.0), apply_rope(x, 7, 10.0))
    model = Decoder(llama_config()).eval()  # the model checks positions once, before any write
    with pytest.raises(ValueError, match=r"positions must be \[C\] or \[B, C\]"):
        model(torch.zeros(3, 5, dtype=torch.long), positions=torch.arange(4))


@pytest.mark.parametrize("name", ["llama", "mistral", "mla", "gemma3"])
def test_positions_turn_a_rope_model_as_its_cache_length_would(name):
    from kvdoc.proofs.grid import MODELS

    model = MODELS[name].build(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 26),
                        generator=torch.Generator().manual_seed(5))
    _, cache = model(ids[:, :20], model.new_cache(2, "dynamic"))
    step = model(ids[:, 20:], cache).logits
    # the same call with its positions stated; with other positions it differs
    stated = model(ids[:, 20:], cache, positions=torch.arange(20, 26).expand(2, 6)).logits
    assert torch.equal(stated, step)
    wrong = model(ids[:, 20:], cache, positions=torch.arange(6).expand(2, 6)).logits
    assert not torch.allclose(wrong, step, atol=1e-3)
    with pytest.raises(ValueError, match="positions must be"):
        model(ids[:, 20:], cache, positions=torch.arange(5))
