"""Variants select the models they are built from by trait; an unknown trait is refused."""

import pytest

from kvdoc.proofs import grid
from kvdoc.proofs.traits import TRAITS, grid_traits, traits
from kvdoc.proofs.variants import VARIANTS, BrokenVariant


@pytest.mark.parametrize("name", list(grid.MODELS))
def test_each_grid_model_has_the_traits_its_config_and_modules_say(name):
    model = grid.MODELS[name].build(0)
    cfg, found = model.config, grid_traits(name)
    assert found <= set(TRAITS)
    assert ("learned" in found) == (getattr(model, "wpe", None) is not None)
    attention = [getattr(b, "attn", None) or getattr(b, "self_attn", None) for b in model.h]
    assert ("latent" in found) == any(hasattr(a, "kv_a_proj_with_mqa") for a in attention)
    assert ("state" in found) == any(hasattr(b, "linear_attn") or hasattr(b, "mamba")
                                     for b in model.h)
    heads = (cfg.n_kv_head, cfg.n_head) if "kv" in found else (1, 1)  # a latent: one "head"
    assert ("grouped" in found) == (1 < heads[0] < heads[1])
    assert ("window" in found) == (getattr(cfg, "sliding_window", None) is not None
                                   and not found & {"hybrid", "gemma", "compressed"})
    # what an attention layer caches: K/V rows, a latent or pooled entries, one of them; a model
    # of recurrent layers alone caches a state
    cached = found & {"kv", "latent", "compressed"}
    assert len(cached) == 1 or (not cached and "state" in found)


def test_variants_run_on_every_model_with_their_traits_and_no_other():
    names = list(grid.MODELS)
    for v in VARIANTS.values():
        hosts = v.models_among(names)
        assert hosts, v.name  # every variant runs somewhere on the grid
        with_traits = [n for n in names if set(v.needs) <= grid_traits(n)]
        assert hosts == (with_traits[:1] if v.one_model else with_traits), v.name
    rope_hosts = VARIANTS["rope-restart"].models_among(names)
    assert "llama" in rope_hosts and "mha" not in rope_hosts and "mla" not in rope_hosts


def test_an_unknown_trait_or_config_is_refused():
    with pytest.raises(ValueError, match="unknown trait 'rotary'"):
        BrokenVariant("x", "y", lambda m: m, needs={"rotary"})
    with pytest.raises(ValueError, match="no traits known for a dict"):
        traits({})
    with pytest.raises(ValueError, match="must need one family"):
        BrokenVariant("x", "y", lambda m: m, needs={"rope"})
