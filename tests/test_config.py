import dataclasses

import pytest

from kvdoc import Decoder, GPTConfig


def test_default_model_is_the_source_model():
    cfg = GPTConfig()
    sizes = (cfg.vocab_size, cfg.n_positions, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_inner)
    assert sizes == (97, 512, 2, 4, 64, 256)
    assert cfg.n_kv_head == cfg.n_head and cfg.head_dim == 16


def test_parameter_count_matches_closed_form():
    small = GPTConfig(n_layer=3, n_embd=32, n_head=2, n_inner=64, n_kv_head=1, vocab_size=11)
    for cfg in (GPTConfig(), small):
        d, kv = cfg.n_embd, cfg.kv_dim
        attn = (d * (d + 2 * kv) + d + 2 * kv) + (d * d + d)  # c_attn, c_proj
        mlp = (d * cfg.n_inner + cfg.n_inner) + (cfg.n_inner * d + d)  # c_fc, c_proj
        per_layer = 4 * d + attn + mlp  # + two LayerNorms
        expected = cfg.vocab_size * d * 2 + cfg.n_positions * d + cfg.n_layer * per_layer + 2 * d
        assert Decoder(cfg).num_parameters() == expected


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPTConfig().n_layer = 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_embd=60, n_head=8), "not divisible by n_head"),
        (dict(n_head=4, n_kv_head=3), "not divisible by n_kv_head"),
        (dict(n_layer=0), "n_layer must be a positive integer"),
        (dict(vocab_size=-1), "vocab_size must be a positive integer"),
        (dict(n_embd=64.0), "n_embd must be a positive integer"),
        (dict(n_kv_head=0), "n_kv_head must be a positive integer"),
        (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon must be positive"),
    ],
)
def test_invalid_configs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_llama_and_mistral_configs():
    from kvdoc.core.model import llama_config, mistral_config

    cfg = llama_config()
    switches = (cfg.position, cfg.norm, cfg.mlp, cfg.bias, cfg.sliding_window)
    assert switches == ("rope", "rmsnorm", "swiglu", False, None)
    assert (cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (4, 2, 16)
    assert mistral_config(sliding_window=8).sliding_window == 8
    assert llama_config(n_kv_head=1).n_kv_head == 1
    assert GPTConfig() == GPTConfig(position="learned", norm="layernorm", mlp="gelu", bias=True)


def test_llama_parameter_count_matches_closed_form():
    from kvdoc.core.model import llama_config

    for tied in (False, True):
        cfg = llama_config(tie_word_embeddings=tied)
        d, kv, f = cfg.n_embd, cfg.kv_dim, cfg.n_inner
        per_layer = 2 * d + d * (d + 2 * kv) + d * d + d * 2 * f + f * d  # two RMSNorms, no biases
        expected = cfg.vocab_size * d * (1 if tied else 2) + cfg.n_layer * per_layer + d
        assert Decoder(cfg).num_parameters() == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(position="alibi"), "position must be one of"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(mlp="relu"), "mlp must be one of"),
        (dict(position="rope", n_embd=60, n_head=4), "head_dim=15 must be even"),
        (dict(rope_theta=0.0), "rope_theta must be positive"),
        (dict(sliding_window=0), "sliding_window must be a positive integer"),
        (dict(sliding_window=2.0), "sliding_window must be a positive integer"),
    ],
)
def test_bad_llama_choices_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)
