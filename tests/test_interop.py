"""kvdoc and transformers' GPT-2 on the same random weights: equal logits, full and cached."""

import pytest
import torch
from transformers import DynamicCache as HFDynamicCache
from transformers import GPT2LMHeadModel

from kvdoc import Decoder, GPTConfig
from kvdoc.interop import config_from_gpt2, decoder_from_gpt2, gpt2_config


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(gpt2_config(GPTConfig())).eval()
    return hf, Decoder.from_gpt2(hf)


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
        cache = ours.new_cache(2, kind)
        out = []
        for s in range(0, ids.shape[1], chunk):
            logits, cache = ours(ids[:, s:s + chunk], cache)
            out.append(logits)
    torch.testing.assert_close(torch.cat(out, 1), expected, atol=1e-5, rtol=1e-5)


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
    for (name, a), (_, b) in zip(loaded.state_dict().items(), ours.state_dict().items()):
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
        config_from_gpt2(cfg)
    with pytest.raises(ValueError, match="no grouped-query attention"):
        gpt2_config(GPTConfig(n_kv_head=2))
