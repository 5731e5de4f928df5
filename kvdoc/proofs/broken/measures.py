"""BROKEN measure functions, each a wrong figure a page could print (keys of
:data:`kvdoc.proofs.figures.MEASURES`)."""

from __future__ import annotations

import dataclasses

from kvdoc.measure.costs import StepTraffic, step_traffic
from kvdoc.measure.model_caches import LayerCache, ModelCache, config_cache


def latent_without_rope_key(config: object, windows: bool = True) -> ModelCache:
    """BROKEN: ``config_cache``, an MLA layer counting ``c_KV`` but not its rotary key."""
    model = config_cache(config, windows)
    if model.kind != "MLA":
        return model
    # BUG: kv_lora_rank alone, without qk_rope_head_dim
    return dataclasses.replace(model, layers=(LayerCache(config.kv_lora_rank),) * config.n_layer)


def batch_as_sequence(model, batch: int, context: int) -> StepTraffic:
    """BROKEN: ``step_traffic``, a step's K/V bytes one sequence's, not the batch's."""
    traffic = step_traffic(model, batch, context)
    return dataclasses.replace(traffic, kv_bytes=traffic.kv_bytes // batch)  # BUG: per sequence
