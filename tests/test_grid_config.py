"""Every function-changing configuration value is off its default on some model of the grid, so
that a code path ignoring it (a hard-coded RoPE base, norm epsilon, head count) is caught."""

from __future__ import annotations

import dataclasses

import pytest

from kvdoc.core.config import GPTConfig
from kvdoc.proofs import grid

EXEMPT: dict[str, str] = {}
"""Fields that need no off-default model, each with the reason (none today: every field of
GPTConfig changes the function computed, its shapes or what the model accepts)."""

CONFIGS = {name: spec.build(0).config for name, spec in grid.MODELS.items()}


def at_default(config: GPTConfig, field: dataclasses.Field) -> bool:
    """Whether ``config`` holds ``field``'s default, as resolved in context (``n_kv_head=None``
    means ``n_head``): the config is unchanged when the field is reset to its default."""
    try:
        return dataclasses.replace(config, **{field.name: field.default}) == config
    except ValueError:  # the default does not even fit the rest of this config
        return False


@pytest.mark.parametrize("field", dataclasses.fields(GPTConfig), ids=lambda f: f.name)
def test_every_config_field_is_off_its_default_on_some_grid_model(field):
    if field.name in EXEMPT:
        pytest.skip(EXEMPT[field.name])
    assert field.default is not dataclasses.MISSING, f"{field.name} has no plain default"
    off = [name for name, config in CONFIGS.items() if not at_default(config, field)]
    assert off, (f"GPTConfig.{field.name} is at its default ({field.default!r}) on every grid "
                 f"model; give one of kvdoc.proofs.grid.MODELS another value")


def test_the_check_sees_a_field_at_its_default():
    field = {f.name: f for f in dataclasses.fields(GPTConfig)}
    assert at_default(GPTConfig(n_kv_head=4), field["n_kv_head"])  # None resolves to n_head
    assert not at_default(GPTConfig(n_kv_head=2), field["n_kv_head"])
    assert at_default(GPTConfig(), field["rope_theta"])
    assert not at_default(CONFIGS["llama"], field["rope_theta"])
