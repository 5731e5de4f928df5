"""kvdoc and transformers (GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3) on the same random
weights: equal logits, full and cached; configs and weights exported back."""

import pytest
import torch
from transformers import DynamicCache as HFDynamicCache
from transformers import GPT2LMHeadModel

from kvdoc import GPTConfig
from kvdoc.core.feed import feed
from kvdoc.interop.hf_config import config_from_transformers, gpt2_config
from kvdoc.interop.hf_weights import decoder_from_gpt2, from_transformers, to_transformers


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(gpt2_config(GPTConfig())).eval()
    return hf, from_transformers(hf)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(5))


def test_same_parameter_count(pair):
    hf, ours = pair
    assert sum(p.numel() for p in hf.parameters()) == ours.num_parameters() == 145_280


def test_full_forward_matches(pair, ids):
    hf, ours = pair
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids).logits
    assert expected.abs().max() > 1e-2  # the weights are not degenerate
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_cached_decode_matches_transformers(pair, ids, chunk, kind):
    hf, ours = pair
    with torch.no_grad():
        expected = hf(ids).logits
        logits = feed(ours, ids, ours.new_cache(2, kind), chunk).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_transformers_own_cache_agrees(pair, ids):
    """The reference: transformers' cached decode against its own full forward."""
    hf, _ = pair
    with torch.no_grad():
        expected = hf(ids).logits
        out = hf(ids[:, :9], use_cache=True)
        logits = [out.logits]
        cache = out.cache
        assert isinstance(cache, HFDynamicCache)
        for t in range(9, ids.shape[1]):
            out = hf(ids[:, t:t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(logits, 1), expected, atol=1e-5, rtol=1e-5)


def test_state_dict_needs_config(pair):
    hf, ours = pair
    with pytest.raises(ValueError, match="pass config="):
        decoder_from_gpt2(hf.state_dict())
    loaded = decoder_from_gpt2(hf.state_dict(), config=GPTConfig())
    for (name, a), (_, b) in zip(loaded.state_dict().items(), ours.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_mismatched_weights_are_refused(pair):
    hf, _ = pair
    with pytest.raises(ValueError, match="do not match the config"):
        decoder_from_gpt2(hf.state_dict(), config=GPTConfig(n_layer=3))
    with pytest.raises(ValueError, match="config expects"):
        decoder_from_gpt2(hf.state_dict(), config=GPTConfig(n_inner=128))


def test_unsupported_variants_are_refused(pair):
    hf, _ = pair
    cfg = gpt2_config(GPTConfig())
    cfg.activation_function = "relu"
    with pytest.raises(ValueError, match="activation_function='relu'"):
        config_from_transformers(cfg)
    with pytest.raises(ValueError, match="no grouped-query attention"):
        gpt2_config(GPTConfig(n_kv_head=2))


# --- Llama and Mistral (random weights, built offline from a config) ---------------------------

import dataclasses  # noqa: E402

from kvdoc.core.model import (  # noqa: E402
    Decoder,
    llama_config,
    mistral_config,
)
from kvdoc.interop.hf_config import (  # noqa: E402
    transformers_config,
    transformers_model,
)
from kvdoc.interop.hf_float64 import float64_islands_lifted  # noqa: E402
from kvdoc.proofs.compare import TOLERANCE  # noqa: E402
from kvdoc.teach.crosscheck import match_transformers  # noqa: E402

# crosses window 32 three times
LONG = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(6))
# Qwen2, Qwen3 and Phi-3 at sizes off every default: 6 query heads over 3 K/V heads (an odd
# group count), width 96, RoPE base 5e5; Qwen3's heads 20 wide, not 96 / 6 = 16
QWEN2 = llama_config(n_head=6, n_kv_head=3, n_embd=96, n_inner=160, rope_theta=5e5,
                     qkv_bias=True)
QWEN3 = llama_config(n_head=6, n_kv_head=3, n_embd=96, n_inner=160, rope_theta=5e5,
                     head_size=20, qk_norm=True, tie_word_embeddings=True)
PHI3 = llama_config(n_head=6, n_kv_head=3, n_embd=96, n_inner=160, rope_theta=5e5,
                    sliding_window=32)


def jittered(hf):
    """``hf`` with every bias and norm weight drawn (transformers starts them at 0 and 1, where
    a bias dropped or a q/k norm swapped would not show)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family, config", [
    ("gpt2", None), ("llama", None), ("llama", llama_config(n_kv_head=1, tie_word_embeddings=True)),
    ("llama", llama_config(n_kv_head=4)), ("mistral", None), ("qwen2", QWEN2), ("qwen3", QWEN3),
    ("phi3", PHI3)],
    ids=["gpt2", "llama-gqa", "llama-mqa-tied", "llama-mha", "mistral-w32", "qwen2", "qwen3",
         "phi3-w32"])
def test_all_families_match_transformers_full_and_cached(family, config, dtype):
    tol = TOLERANCE[dtype]
    hf = jittered(transformers_model(family, config, seed=1, dtype=dtype))
    m = match_transformers(hf, LONG.to(hf.device), chunks=(1, 7), prefill_len=10)
    assert m.n_parameters[0] == m.n_parameters[1]
    assert m.logit_scale > 0.1  # the logits are not all near zero
    assert m.worst() <= tol and m.hf_cached <= tol
    windowed = family in ("mistral", "phi3")
    expected_kinds = {"dynamic", "static"} | ({"window"} if windowed else set())
    assert {kind for kind, _ in m.cached} == expected_kinds


@pytest.mark.parametrize("family, config", [("qwen2", QWEN2), ("qwen3", QWEN3), ("phi3", PHI3)])
def test_qwen_and_phi3_export_back_bitwise(family, config):
    """Loaded, then exported to the same family: every parameter comes back bitwise, under its
    own name (Phi-3's stacked ones whole, Qwen's split again)."""
    hf = jittered(transformers_model(family, config, seed=2))
    ours = from_transformers(hf)
    assert ours.config == config
    back = to_transformers(ours, family)
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    with torch.no_grad():
        assert torch.equal(back(LONG).logits, hf(LONG).logits)


@pytest.mark.parametrize("family, config, off, dropped", [
    ("qwen2", QWEN2, dict(qkv_bias=False), "c_attn.bias"),
    ("qwen3", QWEN3, dict(qk_norm=False), "_norm."), ("phi3", PHI3, dict(sliding_window=None), "")])
def test_what_qwen_and_phi3_add_is_used(family, config, off, dropped):
    """Each family's feature changes the logits: the same weights without Qwen2's biases,
    Qwen3's q/k norms or Phi-3's window compute something else."""
    ours = from_transformers(jittered(transformers_model(family, config, seed=1)))
    plain = Decoder(dataclasses.replace(config, **off)).eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items()
                           if not dropped or dropped not in k})
    with torch.no_grad():
        assert not torch.allclose(plain(LONG).logits, ours(LONG).logits, atol=1e-3)


def test_mistral_window_changes_transformers_logits_too():
    """The cross-check is not vacuous: transformers' Mistral without its window differs."""
    hf = transformers_model("mistral", seed=1)
    ours = from_transformers(hf)
    assert {layer.window for layer in ours.new_cache(2).layers} == {32}
    plain = transformers_model("mistral", mistral_config(sliding_window=512), seed=1)
    with torch.no_grad():
        windowed, unwindowed = ours(LONG).logits, plain(LONG).logits
        assert not torch.allclose(windowed[:, 32:], unwindowed[:, 32:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(windowed[:, :32], unwindowed[:, :32], atol=1e-5, rtol=1e-5)


def test_config_round_trip():
    for cfg in (GPTConfig(), llama_config(), llama_config(n_kv_head=1, tie_word_embeddings=True),
                mistral_config(8), QWEN2, QWEN3, llama_config(head_size=24)):
        assert config_from_transformers(transformers_config(cfg)) == cfg
    for cfg in (PHI3, llama_config()):
        hf_cfg = transformers_config(cfg, "phi3")
        assert hf_cfg.model_type == "phi3" and config_from_transformers(hf_cfg) == cfg
    published = {"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "intermediate_size": 4864, "num_hidden_layers": 24,
                 "max_position_embeddings": 32768, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
                 "max_window_layers": 21, "hidden_act": "silu", "tie_word_embeddings": True}
    cfg = config_from_transformers(published)  # Qwen2.5-0.5B's config.json: no window used
    assert (cfg.qkv_bias, cfg.sliding_window, cfg.head_dim, cfg.n_kv_head) == (True, None, 64, 2)


def test_unsupported_llama_variants_are_refused():
    hf_cfg = transformers_config(llama_config())
    hf_cfg.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type='linear'"):
        config_from_transformers(hf_cfg)
    hf_cfg = transformers_config(llama_config())
    hf_cfg.mlp_bias = True
    with pytest.raises(ValueError, match="mlp_bias=True"):
        config_from_transformers(hf_cfg)
    from transformers import BertConfig
    with pytest.raises(ValueError, match="not 'bert'"):
        config_from_transformers(BertConfig())
    with pytest.raises(ValueError, match="RMSNorm"):
        transformers_config(GPTConfig(position="rope"))
    with pytest.raises(ValueError, match="family must be"):
        transformers_model("gpt-j")


@pytest.mark.parametrize("family, field, value, says", [
    ("qwen2", "use_sliding_window", True, "use_sliding_window=True"),
    ("qwen2", "layer_types", ["full_attention", "sliding_attention"], "layer_types="),
    ("qwen3", "attention_bias", True, "attention_bias=True"),
    ("phi3", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4,
                                 "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
     "rope_type='longrope'"),
    ("phi3", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                 "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5")])
def test_unsupported_qwen_and_phi3_variants_are_refused(family, field, value, says):
    hf_cfg = transformers_config({"qwen2": QWEN2, "qwen3": QWEN3, "phi3": PHI3}[family], family)
    setattr(hf_cfg, field, value)
    with pytest.raises(ValueError, match=says):
        config_from_transformers(hf_cfg)


def test_paths_without_q_k_norms_refuse_a_qwen3_model():
    """FastDecoder's fused step and a tensor-parallel shard have no q/k norms: they refuse."""
    from kvdoc.core.fast import FastDecoder
    from kvdoc.parallel.tensor import ShardedAttention, head_shard

    model = Decoder(QWEN3).eval()
    with pytest.raises(ValueError, match="no q/k norms"):
        FastDecoder(model)
    with pytest.raises(ValueError, match="no q/k norms"):
        ShardedAttention(model.h[0].attn, head_shard(QWEN3, 1, 0), comm=None)
    FastDecoder(Decoder(QWEN2).eval())  # Q/K/V biases: the fused step adds c_attn's bias


def test_configs_no_family_holds_are_not_exported():
    with pytest.raises(ValueError, match="q/k norms and Q/K/V biases"):
        transformers_config(llama_config(qk_norm=True, qkv_bias=True))
    with pytest.raises(ValueError, match="without sliding windows"):
        transformers_config(dataclasses.replace(QWEN2, sliding_window=32))
    with pytest.raises(ValueError, match="a qwen3 model's, not phi3's"):
        transformers_config(QWEN3, "phi3")
    with pytest.raises(ValueError, match="head_size must be a positive integer"):
        llama_config(head_size=0)


def test_lifting_restores_transformers_afterwards():
    hf = transformers_model("llama", dtype=torch.float64)
    with torch.no_grad():
        before = hf(LONG).logits
        with float64_islands_lifted(hf):
            pass
        assert torch.equal(hf(LONG).logits, before)
    assert all("forward" not in vars(m) for m in hf.modules())
