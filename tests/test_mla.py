"""Multi-head latent attention: the latent cache, plain and absorbed decode, DeepSeek-V3 interop."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvdoc import Decoder, DynamicCache, GPTConfig, StaticCache, generate
from kvdoc.core.mla import (
    LatentAttention,
    MLAConfig,
    MLADecoder,
)
from kvdoc.interop.hf_config import random_model
from kvdoc.interop.hf_deepseek import (
    config_from_deepseek,
    deepseek_config,
    from_deepseek,
    to_deepseek,
)
from kvdoc.proofs.compare import TOLERANCE, close, max_abs, run_cached
from kvdoc.serving.speculative import speculative_generate, truncated_draft

CONFIGS = {"no q LoRA": MLAConfig(), "q LoRA": MLAConfig(q_lora_rank=12)}


def model_pair(config: MLAConfig, dtype: torch.dtype) -> tuple[MLADecoder, MLADecoder]:
    """The same weights, plain and absorbed."""
    torch.manual_seed(0)
    plain = MLADecoder(config).to(dtype).eval()
    absorbed = MLADecoder(replace(config, absorb=True)).to(dtype).eval()
    absorbed.load_state_dict(plain.state_dict())
    return plain, absorbed


def stream(length: int = 19, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_plain_and_absorbed_decode_equal_the_full_forward(dtype, name, kind):
    ids = stream()
    for model in model_pair(CONFIGS[name], dtype):
        full = model(ids).logits
        for chunk in (1, 4):
            run = run_cached(model, ids, chunk, kind)
            assert close(run.logits, full, TOLERANCE[dtype]), (model.config.absorb, chunk)
            assert run.lifecycle_error == 0.0


def test_the_absorbed_path_is_what_runs_and_a_wrong_one_is_caught(monkeypatch):
    """The absorbed path with DeepSeek's scale taken from the latent's width (a natural slip:
    the dot products are r + d_R wide there) fails the comparison; with the right scale it
    passes, so the check sees the absorbed path."""
    plain, absorbed = model_pair(MLAConfig(), torch.float64)
    ids = stream()
    full = plain(ids).logits
    calls = []
    original = LatentAttention.attend_absorbed

    def counted(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(LatentAttention, "attend_absorbed", counted)
    right = run_cached(absorbed, ids, 5).logits
    assert calls and close(right, full, TOLERANCE[torch.float64])

    def wrong_scale(self, q_nope, q_rope, c_kv, k_rope, mask):
        c = self.config
        w_uk, w_uv = self.up_projections()
        q = torch.cat((torch.einsum("bhcn,hnr->bhcr", q_nope, w_uk), q_rope), dim=-1)
        k = torch.cat((c_kv, k_rope), dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, c_kv, attn_mask=mask, enable_gqa=True)  # scale 1/sqrt(r + d_R)
        assert not math.isclose(q.shape[-1] ** -0.5, c.softmax_scale)
        return torch.einsum("bhcr,hvr->bhcv", out, w_uv)

    monkeypatch.setattr(LatentAttention, "attend_absorbed", wrong_scale)
    wrong = run_cached(absorbed, ids, 5).logits
    assert max_abs(wrong[:, 5:], full[:, 5:]) > 1e-3  # the first chunk has no cache: plain


def test_the_cache_holds_only_the_latent_and_the_rotary_key():
    config = MLAConfig(q_lora_rank=12)
    model = model_pair(config, torch.float32)[0]
    ids = stream(length=11)
    _, cache = model(ids, model.new_cache(2))
    assert type(cache) is DynamicCache  # the kind every model uses, sized by the layout
    for i in range(config.n_layer):
        c_kv, k_rope = cache.layer(i)
        assert c_kv.shape == (2, 1, 11, config.kv_lora_rank)
        assert k_rope.shape == (2, 1, 11, config.qk_rope_head_dim)
    assert len(cache.tensors()) == 2 * config.n_layer
    per_token = config.n_layer * (config.kv_lora_rank + config.qk_rope_head_dim) * 4  # FP32
    assert cache.nbytes() == 2 * 11 * per_token
    static = model.new_cache(2, "static", capacity=11)
    assert static.nbytes() == 2 * 11 * per_token
    model(ids, static)
    for i in range(config.n_layer):
        assert all(torch.equal(a, b) for a, b in zip(static.layer(i), cache.layer(i), strict=True))


def test_crop_and_continue():
    model = model_pair(MLAConfig(), torch.float64)[1]
    ids, other = stream(length=20), stream(length=20, batch=2).flip(1)
    for kind in ("dynamic", "static"):
        _, cache = model(ids, model.new_cache(2, kind, capacity=20))
        cache = cache.crop(8)
        target = torch.cat((ids[:, :8], other[:, 8:]), dim=1)
        got = model(target[:, 8:], cache).logits
        assert close(got, model(target).logits[:, 8:], TOLERANCE[torch.float64])


def test_speculative_decoding_crops_the_latent_cache():
    model = model_pair(MLAConfig(), torch.float32)[1]
    prompt = stream(length=5, batch=1)
    for kind in ("dynamic", "static"):
        run = speculative_generate(model, truncated_draft(model, 1), prompt, 20, k=3, cache=kind)
        assert torch.equal(run.tokens, generate(model, prompt, 20, cache=kind))


def test_bad_caches_are_refused_and_left_as_they_were():
    model = model_pair(MLAConfig(), torch.float32)[0]
    ids = stream(length=6)
    with pytest.raises(ValueError, match=r"model has \(1, \(32, 8\)\)"):
        model(ids, Decoder(GPTConfig()).new_cache(2))
    with pytest.raises(ValueError, match=r"model has \(4, \(16, 16\)\)"):
        Decoder(GPTConfig())(ids, model.new_cache(2))
    with pytest.raises(ValueError, match="another model"):
        model(ids, DynamicCache.empty(MLAConfig(kv_lora_rank=16), 2))
    static = StaticCache(model.config, 2, capacity=8)
    model(ids[:, :4], static)
    before = [t.clone() for t in static.tensors()]
    with pytest.raises(ValueError, match="over capacity"):
        model(ids, static)
    assert static.seq_len == 4
    assert all(torch.equal(a, b) for a, b in zip(before, static.tensors(), strict=True))
    with pytest.raises(ValueError, match="needs a model with sliding windows"):
        model.new_cache(1, "window")
    with pytest.raises(ValueError, match="must be even"):
        MLAConfig(qk_rope_head_dim=5)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers_deepseek_v3_full_and_cached(interleave, name):
    hf = random_model(deepseek_config(CONFIGS[name], interleave), seed=1)
    ids = stream()
    with torch.no_grad():
        want = hf(ids).logits
    plain = from_deepseek(hf)
    absorbed = MLADecoder(replace(plain.config, absorb=True)).eval()
    absorbed.load_state_dict(plain.state_dict())
    for ours in (plain, absorbed):
        tol = TOLERANCE[torch.float32]
        assert close(ours(ids).logits, want, tol)
        assert close(run_cached(ours, ids, 4).logits, want, tol)
        assert close(run_cached(ours, ids, 1, "static").logits, want, tol)
    with torch.no_grad():
        back = to_deepseek(from_deepseek(hf), interleave)(ids).logits
    assert torch.equal(back, want)  # the same weights in the same model


def test_the_one_loader_takes_deepseek_too():
    from kvdoc.interop.hf_weights import from_transformers

    hf = random_model(deepseek_config(MLAConfig()), seed=1)
    ours = from_transformers(hf)
    assert isinstance(ours, MLADecoder)
    assert torch.equal(ours(stream()).logits, from_deepseek(hf)(stream()).logits)


def test_the_rotary_rows_must_be_permuted():
    """Loading interleaved weights as if they were half-split gives another model."""
    hf = random_model(deepseek_config(MLAConfig(), True), seed=1)
    ours = from_deepseek(hf)
    hf.config.rope_interleave = False  # the same weights, read the other way (every layer)
    ids = stream()
    with torch.no_grad():
        assert max_abs(ours(ids).logits, hf(ids).logits) > 1e-4


def test_configs_round_trip_and_moe_is_refused():
    for config in CONFIGS.values():
        assert config_from_deepseek(deepseek_config(config)) == config
    from transformers import DeepseekV3Config

    moe = DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64,
                           num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="MoE"):
        config_from_deepseek(moe)
