"""Every function-changing configuration value is off its default on some model of the grid, so
that a code path ignoring it (a hard-coded RoPE base, norm epsilon, head count) is caught."""

from __future__ import annotations

import dataclasses

import pytest

from kvdoc.core.deltanet import DeltaNetConfig
from kvdoc.core.gemma import Gemma3Config
from kvdoc.core.gptoss import GptOssConfig
from kvdoc.core.indexed import IndexedConfig
from kvdoc.core.mamba2 import Mamba2Config
from kvdoc.core.mla import MLAConfig
from kvdoc.core.model import GPTConfig
from kvdoc.core.v4 import CompressedConfig
from kvdoc.proofs import grid

EXEMPT: dict[str, str] = {
    "MLAConfig.tie_word_embeddings": "the DeepSeek-V3 loader does not tie the head (V3 does not)",
    "IndexedConfig.tie_word_embeddings": "as MLAConfig's: DeepSeek-V3.2 does not tie the head",
    "IndexedConfig.absorb": "the absorbed path is MLA's (mla-absorbed); tests/test_indexed.py runs "
                            "it under the selection",
}
"""Fields that need no off-default model, each with the reason (``Class.field``)."""

CONFIGS = {name: spec.build(0).config for name, spec in grid.MODELS.items()}
FIELDS = [(cls, f) for cls in (GPTConfig, MLAConfig, Gemma3Config, DeltaNetConfig, Mamba2Config,
                                IndexedConfig, CompressedConfig, GptOssConfig)
          for f in dataclasses.fields(cls)]


def at_default(config: GPTConfig, field: dataclasses.Field) -> bool:
    """Whether ``config`` holds ``field``'s default, as resolved in context (``n_kv_head=None``
    means ``n_head``): the config is unchanged when the field is reset to its default."""
    try:
        return dataclasses.replace(config, **{field.name: field.default}) == config
    except ValueError:  # the default does not even fit the rest of this config
        return False


def test_every_config_class_is_on_the_grid():
    assert {type(c) for c in CONFIGS.values()} == {cls for cls, _ in FIELDS}


@pytest.mark.parametrize(("cls", "field"), FIELDS,
                         ids=[f"{cls.__name__}.{f.name}" for cls, f in FIELDS])
def test_every_config_field_is_off_its_default_on_some_grid_model(cls, field):
    key = f"{cls.__name__}.{field.name}"
    if key in EXEMPT:
        assert field.default == getattr(CONFIGS[next(n for n, c in CONFIGS.items()
                                                     if isinstance(c, cls))], field.name)
        return  # exempt, with its reason
    assert field.default is not dataclasses.MISSING, f"{key} has no plain default"
    off = [name for name, config in CONFIGS.items()
           if isinstance(config, cls) and not at_default(config, field)]
    assert off, (f"{key} is at its default ({field.default!r}) on every grid model of that "
                 f"class; give one of kvdoc.proofs.grid.MODELS another value")


def test_the_check_sees_a_field_at_its_default():
    field = {f.name: f for f in dataclasses.fields(GPTConfig)}
    assert at_default(GPTConfig(n_kv_head=4), field["n_kv_head"])  # None resolves to n_head
    assert not at_default(GPTConfig(n_kv_head=2), field["n_kv_head"])
    assert at_default(GPTConfig(), field["rope_theta"])
    assert not at_default(CONFIGS["llama"], field["rope_theta"])
