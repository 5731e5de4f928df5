import dataclasses

import pytest

from kvdoc import Decoder, GPTConfig


def test_default_model_is_the_source_model():
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.n_positions, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_inner) == (97, 512, 2, 4, 64, 256)
    assert cfg.n_kv_head == cfg.n_head and cfg.head_dim == 16


def test_parameter_count_matches_closed_form():
    for cfg in (GPTConfig(), GPTConfig(n_layer=3, n_embd=32, n_head=2, n_inner=64, n_kv_head=1, vocab_size=11)):
        d, kv = cfg.n_embd, cfg.kv_dim
        per_layer = 4 * d + (d * (d + 2 * kv) + d + 2 * kv) + (d * d + d) + (d * cfg.n_inner + cfg.n_inner) + (cfg.n_inner * d + d)
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
