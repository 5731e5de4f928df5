"""Gemma-3-style window and global layers: the hybrid cache, transformers interop, memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvdoc import Decoder, decode_step, generate, mistral_config, prefill
from kvdoc.core.cache import KVCache
from kvdoc.core.frame import GLOBAL, SLIDING
from kvdoc.core.gemma import Gemma3Config, Gemma3Decoder, GemmaRMSNorm
from kvdoc.core.window import WindowLayer, window_cache
from kvdoc.interop.hf_config import random_model
from kvdoc.interop.hf_float64 import float64_islands_lifted
from kvdoc.interop.hf_gemma import config_from_gemma, gemma_config
from kvdoc.interop.hf_weights import from_transformers, to_transformers
from kvdoc.measure.kv_bytes import kv_bytes_per_layer
from kvdoc.measure.model_caches import MODELS, config_cache, model_cache
from kvdoc.proofs.cache_invariants import byte_problems
from kvdoc.proofs.compare import TOLERANCE, Snapshot, close, max_abs, run_cached


def _bytes(config, length, batch=1, dtype=torch.float32):
    """The one byte formula (:func:`kvdoc.measure.model_caches.config_cache`), FP32 by default."""
    return config_cache(config).kv_bytes(length, batch, dtype)


W = 6
CONFIG = Gemma3Config(sliding_window=W, n_layer=4, sliding_window_pattern=2,
                      query_pre_attn_scalar=24, rope_theta=5e5, rope_local_base_freq=1e3,
                      final_logit_softcapping=5.0, tie_word_embeddings=False)
"""Window and global layers alternating, a window the streams pass several times."""


def hf_model(config: Gemma3Config = CONFIG, seed: int = 1):
    """transformers' Gemma 3 with random weights, its norm weights off zero (so a norm swapped for
    another, or ``w`` for ``1 + w``, shows)."""
    hf = random_model(gemma_config(config), seed=seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return hf


def stream(length: int = 30, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_full_and_cached_match_transformers(dtype):
    hf = hf_model().to(dtype)
    ours = from_transformers(hf)
    assert isinstance(ours, Gemma3Decoder) and ours.config == CONFIG
    ids, prompt = stream(), 7
    with torch.no_grad(), float64_islands_lifted(hf):
        want = hf(ids).logits
        out = hf(ids[:, :prompt], use_cache=True)  # transformers' own cache, for its own sake
        theirs = [out.logits]
        for t in range(prompt, ids.shape[1]):
            out = hf(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            theirs.append(out.logits)
    tol = TOLERANCE[dtype]
    assert close(torch.cat(theirs, dim=1), want, tol)
    assert close(ours(ids).logits, want, tol)
    for kind in ("hybrid", "dynamic", "static"):  # prefill, then one decode step at a time
        logits, cache = ours(ids[:, :prompt], ours.new_cache(2, kind, capacity=ids.shape[1]))
        steps = [logits]
        for t in range(prompt, ids.shape[1]):
            logits, cache = decode_step(ours, ids[:, t], cache)
            steps.append(logits)
        assert close(torch.cat(steps, dim=1), want, tol), kind
    assert [cache.held(i) for i in range(4)] == [range(0, 30)] * 4  # static: every position
    assert max_abs(hf_model()(ids).logits, to_transformers(from_transformers(hf_model()))(
        ids).logits) == 0.0  # there and back: the same weights


@pytest.mark.parametrize("chunk", [1, 4, W, W + 3])
def test_hybrid_cache_equals_the_full_forward_and_the_dynamic_cache(chunk):
    torch.manual_seed(0)
    model = Gemma3Decoder(CONFIG).eval()
    ids = stream()
    full = model(ids).logits
    hybrid = run_cached(model, ids, chunk, "hybrid")
    dynamic = run_cached(model, ids, chunk, "dynamic")
    assert close(hybrid.logits, full, 1e-5) and close(dynamic.logits, full, 1e-5)
    assert hybrid.lifecycle_error == 0.0
    cache = hybrid.cache
    assert [cache.held(i) for i in range(4)] == [range(30 - W, 30), range(30)] * 2
    for i in range(4):  # a window layer's rows are the last W of what the dynamic cache holds
        for got, every in zip(cache.layer(i), dynamic.cache.layer(i), strict=True):
            assert close(got, every[:, :, cache.held(i).start:], 1e-5)


def test_window_and_global_layers_differ():
    """The window matters: the same weights with a window wider than the stream differ from
    position W on, and a model whose every layer is global needs no ring."""
    torch.manual_seed(0)
    model = Gemma3Decoder(CONFIG).eval()
    wide = Gemma3Decoder(dataclasses.replace(CONFIG, sliding_window=64)).eval()
    wide.load_state_dict(model.state_dict())
    ids = stream()
    a, b = model(ids).logits, wide(ids).logits
    assert torch.allclose(a[:, :W], b[:, :W], atol=1e-6)
    assert not torch.allclose(a[:, W:], b[:, W:], atol=1e-3)
    for pattern in (1, 5):  # every layer global; every layer a window layer
        config = dataclasses.replace(CONFIG, sliding_window_pattern=pattern)
        only = Gemma3Decoder(config).eval()
        run = run_cached(only, ids, 4, "hybrid")
        assert close(run.logits, only(ids).logits, 1e-5)
        assert {layer.window for layer in run.cache.layers} == ({None} if pattern == 1 else {W})


def test_bytes_held_rows_and_the_formulas_agree():
    torch.manual_seed(0)
    model = Gemma3Decoder(CONFIG).eval()
    cache, ids = model.new_cache(2), stream()
    for end in (0, 3, W, 11, 30):
        if end:
            _, cache = model(ids[:, cache.seq_len:end], cache)
        assert byte_problems(cache) == []
        assert cache.nbytes() == _bytes(CONFIG, end, 2)
        held = sum(len(cache.held(i)) for i in range(4))
        assert _bytes(CONFIG, end, 2) == 2 * 2 * 2 * 16 * 4 * held
        assert _bytes(CONFIG, end, 2) == sum(kv_bytes_per_layer(2, end, 2, 16, "float32",
                                                                 CONFIG.layer_windows))
    _, every = model(ids, model.new_cache(2, "dynamic"))  # every layer keeps all 30 positions
    all_global = dataclasses.replace(CONFIG, sliding_window_pattern=1)
    assert every.nbytes() == _bytes(all_global, 30, 2) > cache.nbytes()


def test_a_call_leaves_the_hybrid_cache_it_was_given_unchanged():
    torch.manual_seed(0)
    model = Gemma3Decoder(CONFIG).eval()
    ids = stream()
    _, prefix = model(ids[:, :9], model.new_cache(2))
    before = Snapshot.of(prefix)
    for tail in (ids[:, 9:], (ids[:, 9:] + 1) % 97):  # two branches of one prefix
        logits, _ = model(tail, prefix)
        want = model(torch.cat((ids[:, :9], tail), dim=1)).logits[:, 9:]
        assert close(logits, want, 1e-5)
    assert prefix.seq_len == 9 and before.changed(prefix) == 0.0


def test_bad_input_is_refused_and_leaves_the_cache_as_it_was():
    torch.manual_seed(0)
    model = Gemma3Decoder(CONFIG).eval()
    _, cache = model(stream(8), model.new_cache(2))
    before = Snapshot.of(cache)
    work = cache.begin()
    k = torch.zeros(2, 2, 1, 16)
    with pytest.raises(ValueError, match="write starts at 3"):
        work.update(0, k, k, 3)
    with pytest.raises(ValueError, match=r"\(B, H, width of K, width of V\)"):
        work.update(1, torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), 8)
    with pytest.raises(ValueError, match=r"layer 4 is outside 0\.\.3"):
        work.update(4, k, k, 8)
    with pytest.raises(ValueError, match="batch size"):
        model(stream(2, batch=1), cache)
    with pytest.raises(ValueError, match="window of 4 positions cannot serve layer 0"):
        model(stream(2), window_cache(dataclasses.replace(CONFIG, sliding_window=4), 2))
    rings = KVCache([WindowLayer.empty(2, s.heads, s.widths, CONFIG.sliding_window)
                     for s in CONFIG.cache_layout])
    with pytest.raises(ValueError, match="which reads every key"):
        model(stream(2), rings)
    with pytest.raises(ValueError, match="another model"):
        Decoder(mistral_config()).eval()(stream(2), window_cache(CONFIG, 2))
    with pytest.raises(ValueError, match="unknown cache kind 'paged'"):
        model.new_cache(2, "paged")
    assert cache.seq_len == 8 and before.changed(cache) == 0.0


def test_prefill_decode_and_generate_with_the_hybrid_cache():
    torch.manual_seed(0)
    model = Gemma3Decoder(CONFIG).eval()
    prompt = stream(5, batch=1)
    out = generate(model, prompt, 20)  # the hybrid cache by default, 25 positions past W
    assert torch.equal(out, generate(model, prompt, 20, cache="dynamic"))
    logits, cache = prefill(model, prompt, model.new_cache(1))
    assert [layer.window for layer in cache.layers] == list(CONFIG.layer_windows)
    assert close(logits, model(prompt).logits[:, -1:], 1e-5)


def test_config_round_trip_and_refusals():
    assert config_from_gemma(gemma_config(CONFIG)) == CONFIG
    assert gemma_config(CONFIG).layer_types == [SLIDING, GLOBAL] * 2
    # a layout no pattern gives (global first) goes both ways as the list of global layers
    first = dataclasses.replace(CONFIG, global_layers=(0, 3))
    assert gemma_config(first).layer_types == [GLOBAL, SLIDING, SLIDING, GLOBAL]
    assert config_from_gemma(gemma_config(first)) == first
    for change, match in ((dict(rope_parameters={"full_attention": {"rope_type": "linear",
                                                                    "factor": 8.0}}), "rope_type"),
                          (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
                          (dict(hidden_activation="gelu"), "hidden_activation"),
                          (dict(layer_types=[GLOBAL, SLIDING, "chunked_attention", GLOBAL]),
                           "chunked_attention")):
        hf_config = gemma_config(CONFIG)
        for name, value in change.items():
            setattr(hf_config, name, value)
        with pytest.raises(ValueError, match=match):
            config_from_gemma(hf_config)
    with pytest.raises(ValueError, match="n_head=4 must be a multiple of n_kv_head=3"):
        Gemma3Config(n_kv_head=3)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        Gemma3Config(final_logit_softcapping=0.0)


def test_norms_scale_by_one_plus_weight():
    norm = GemmaRMSNorm(4, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.0, 1.0, -1.0, 0.5]))
    x = torch.tensor([2.0, -2.0, 2.0, -2.0])
    assert torch.allclose(norm(x), torch.tensor([1.0, -2.0, 0.0, -1.5]))


def test_published_hybrid_bytes():
    for p in (m for m in MODELS.values() if m.name.startswith("Gemma")):
        windows = [layer.window for layer in p.layers]
        cfg = Gemma3Config(n_head=p.heads, n_kv_head=p.kv_heads, n_embd=p.hidden,
                           head_dim=p.head_dim, n_layer=len(windows),
                           n_positions=p.max_positions, sliding_window=p.sliding_window,
                           sliding_window_pattern=windows.index(None) + 1)
        for T in (p.sliding_window, 8192, 131072):
            got = p.kv_bytes(T, 1, torch.bfloat16)
            assert got == _bytes(cfg, T, dtype=torch.bfloat16)
            all_global = dataclasses.replace(cfg, sliding_window_pattern=1)
            assert p.kv_bytes(T, 1, "bf16", windows=False) == _bytes(all_global, T,
                                                                     dtype=torch.bfloat16)
        # past the window, only the global layers grow: one position more adds their rows only
        W, globals_ = p.sliding_window, windows.count(None)
        step = p.kv_bytes(W + 1, 1, "bf16") - p.kv_bytes(W, 1, "bf16")
        assert step == 2 * globals_ * p.kv_heads * p.head_dim * 2
    assert [layer.window for layer in model_cache("gemma-3-27b").layers].count(None) == 62 // 6
    with pytest.raises(ValueError, match="unknown model"):
        model_cache("gemma-4")
