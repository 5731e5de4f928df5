"""A transformers ``config.json`` as a :class:`~kvdoc.measure.model_caches.ModelCache`: what
``python -m kvdoc memory --config`` counts.

Sizes are read by :mod:`kvdoc.interop.hf_config`'s rules, the ones the weight loaders use.
Importing this module does not import torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# torch-free: the command line imports this module, and loading torch takes seconds
from kvdoc.interop.hf_config import attention_sizes, config_fields, positive

from .model_caches import (
    LayerCache,
    ModelCache,
    attention_layer,
    every_nth_full,
    gated_delta_layer,
    mla_layer,
)

#: model types whose transformers config alternates window and full layers when
#: ``layer_types`` is absent (layer 0 windowed)
_ALTERNATING = {"gemma2", "gpt_oss"}
_GEMMA3 = {"gemma3", "gemma3_text"}
_DELTA = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
          "linear_value_head_dim", "linear_conv_kernel_dim")
_STATE_SPACE = {"mamba", "mamba2", "jamba", "falcon_h1", "zamba", "zamba2", "bamba", "rwkv"}


def _layer_types(c: Mapping[str, Any], layers: int, where: str) -> list[str]:
    types = c.get("layer_types")
    model_type = c.get("model_type", "")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ValueError(f"{where}: layer_types must list num_hidden_layers = {layers} "
                             f"entries, got {types!r:.80}")
        return types
    if c.get("sliding_window_pattern") is not None or model_type in _GEMMA3:
        pattern = {"sliding_window_pattern": c.get("sliding_window_pattern", 6)}  # Gemma 3's
        return every_nth_full(layers, positive(pattern, "sliding_window_pattern", where))
    if model_type in _ALTERNATING:
        return every_nth_full(layers, 2)
    if c.get("full_attention_interval") is not None:
        every = positive(c, "full_attention_interval", where)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(layers)]
    windowed = c.get("sliding_window") is not None and c.get("use_sliding_window") is not False
    return ["sliding_attention" if windowed else "full_attention"] * layers


def cache_from_config(config: Mapping[str, Any], name: str = "config.json") -> ModelCache:
    """The :class:`~kvdoc.measure.model_caches.ModelCache` a parsed ``config.json`` describes:
    attention, MLA, sliding-window and Gated DeltaNet layers, placed by ``layer_types`` or the
    family's own rule (a Gemma pattern, an alternation, Qwen3-Next's interval). A
    linear-attention layer's state is counted when the config gives its sizes; else the note
    says it is not. State-space layers and anything malformed are a ValueError.

    >>> m = cache_from_config({"num_hidden_layers": 32, "num_attention_heads": 32,
    ...                        "num_key_value_heads": 8, "hidden_size": 4096,
    ...                        "max_position_embeddings": 8192})
    >>> m.kind, m.bytes_per_token("float16")
    ('plain', 131072)
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"{name}: expected a JSON object, got {type(config).__name__}")
    c = config_fields(config, name)
    model_type = str(c.get("model_type") or "")
    if model_type in _STATE_SPACE or c.get("state_size") is not None:
        raise ValueError(f"{name}: model_type {model_type!r} has state-space layers; kvdoc "
                         "reads attention, MLA, sliding-window and Gated DeltaNet layers")
    layers = positive(c, "num_hidden_layers", name)
    context = positive(c, "max_position_embeddings", name)
    types = _layer_types(c, layers, name)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"{name}: unknown layer types {unknown}; kvdoc reads full_attention, "
                         "sliding_attention and linear_attention")
    note, heads = "", None
    if c.get("kv_lora_rank") is not None:
        full = mla_layer(positive(c, "kv_lora_rank", name), positive(c, "qk_rope_head_dim", name))
        window = None
    else:
        heads, kv_heads, head_dim = attention_sizes(c, name)
        full = attention_layer(kv_heads, head_dim)
        window = (positive(c, "sliding_window", name) if "sliding_attention" in types else None)
    linear = LayerCache(0)
    if "linear_attention" in types:
        if all(c.get(k) is not None for k in _DELTA):
            linear = gated_delta_layer(*(positive(c, k, name) for k in _DELTA))
        else:
            note = (f"{types.count('linear_attention')} linear-attention layers: state not "
                    "counted (the config does not give Gated DeltaNet's sizes); only the "
                    f"{layers - types.count('linear_attention')} attention layers are")
    per_type = {"full_attention": full, "sliding_attention": full._replace(window=window),
                "linear_attention": linear}
    return ModelCache(str(c.get("_name_or_path") or name), tuple(per_type[t] for t in types),
                      context, name, note, heads)


def read_config(path: str | Path) -> ModelCache:
    """:func:`cache_from_config` of the ``config.json`` at ``path``, or in the folder ``path``
    (a checkpoint folder, as transformers' ``from_pretrained`` takes it).

    Raises:
        ValueError: the file is missing, not JSON, or not a config kvdoc can read.
    """
    if Path(path).is_dir():
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"{path} is a folder without a config.json")
        path = Path(path) / "config.json"
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON: {err}") from None
    return cache_from_config(config, str(path))
