"""kvdoc and transformers' GPT-2 on the same random weights: equal logits, full and cached."""

import pytest
import torch
from transformers import DynamicCache as HFDynamicCache
from transformers import GPT2LMHeadModel

from kvdoc import GPTConfig
from kvdoc.core.feed import feed
from kvdoc.interop.hf_config import config_from_transformers, gpt2_config
from kvdoc.interop.hf_weights import decoder_from_gpt2, from_transformers


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

from kvdoc.core.model import llama_config, mistral_config  # noqa: E402
from kvdoc.interop.hf_config import (  # noqa: E402
    transformers_config,
    transformers_model,
)
from kvdoc.interop.hf_float64 import float64_islands_lifted  # noqa: E402
from kvdoc.proofs.compare import TOLERANCE  # noqa: E402
from kvdoc.teach.crosscheck import match_transformers  # noqa: E402

# crosses window 32 three times
LONG = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family, config", [
    ("gpt2", None), ("llama", None), ("llama", llama_config(n_kv_head=1, tie_word_embeddings=True)),
    ("llama", llama_config(n_kv_head=4)), ("mistral", None)],
    ids=["gpt2", "llama-gqa", "llama-mqa-tied", "llama-mha", "mistral-w32"])
def test_all_families_match_transformers_full_and_cached(family, config, dtype):
    tol = TOLERANCE[dtype]
    hf = transformers_model(family, config, seed=1, dtype=dtype)
    m = match_transformers(hf, LONG.to(hf.device), chunks=(1, 7), prefill_len=10)
    assert m.n_parameters[0] == m.n_parameters[1]
    assert m.logit_scale > 0.1  # the logits are not all near zero
    assert m.worst() <= tol and m.hf_cached <= tol
    expected_kinds = {"dynamic", "static"} | ({"window"} if family == "mistral" else set())
    assert {kind for kind, _ in m.cached} == expected_kinds


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
                mistral_config(8)):
        assert config_from_transformers(transformers_config(cfg)) == cfg


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


def test_lifting_restores_transformers_afterwards():
    hf = transformers_model("llama", dtype=torch.float64)
    with torch.no_grad():
        before = hf(LONG).logits
        with float64_islands_lifted(hf):
            pass
        assert torch.equal(hf(LONG).logits, before)
    assert all("forward" not in vars(m) for m in hf.modules())
