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

from .layer_caches import (
    LayerCache,
    attention_layer,
    compressed_layer,
    gated_delta_layer,
    indexed_mla_layer,
    mamba2_layer,
    mla_layer,
)
from .model_caches import ModelCache, every_nth_full

#: model types whose transformers config alternates window and full layers when
#: ``layer_types`` is absent (layer 0 windowed)
_ALTERNATING = {"gemma2", "gpt_oss"}
_GEMMA3 = {"gemma3", "gemma3_text"}
_DELTA = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
          "linear_value_head_dim", "linear_conv_kernel_dim")
_STATE_SPACE = {"mamba", "mamba2", "jamba", "falcon_h1", "zamba", "zamba2", "rwkv", "nemotron_h"}
#: Mamba-2 hybrids whose mixer sizes are ``mamba_*`` fields (transformers 5.24.0's names)
_MAMBA2 = {"bamba", "granitemoehybrid"}
_V4_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4,
             "heavily_compressed_attention": 128}


def _mamba2(c: Mapping[str, Any], where: str) -> LayerCache:
    heads = positive(c, "mamba_n_heads", where)
    inner = positive(c, "mamba_expand", where) * positive(c, "hidden_size", where)
    head_dim = c.get("mamba_d_head", "auto")  # "auto": the inner width split over the heads
    head_dim = inner // heads if head_dim == "auto" else positive(c, "mamba_d_head", where)
    return mamba2_layer(heads, head_dim, positive(c, "mamba_n_groups", where),
                        positive(c, "mamba_d_state", where), positive(c, "mamba_d_conv", where))


def _deepseek_v4(c: Mapping[str, Any], layers: int, where: str) -> list[LayerCache]:
    """DeepSeek-V4's layers: ``layer_types`` (or the release's ``compress_ratios``, one a layer
    and a trailing one for the prediction layer) and ``compress_rates``, as transformers
    5.24.0's ``DeepseekV4Config`` reads them."""
    types = c.get("layer_types")
    if types is None and isinstance(c.get("compress_ratios"), list):
        by_rate = {rate: name for name, rate in _V4_TYPES.items()}
        types = [by_rate.get(r, f"compress ratio {r!r}") for r in c["compress_ratios"][:layers]]
    if not isinstance(types, list) or len(types) != layers or set(types) - set(_V4_TYPES):
        raise ValueError(f"{where}: DeepSeek-V4 needs layer_types (or compress_ratios) of "
                         f"{layers} entries among {sorted(_V4_TYPES)}, got {types!r:.80}")
    rates = {**_V4_TYPES, **dict(c.get("compress_rates") or {})}
    head_dim, window = positive(c, "head_dim", where), positive(c, "sliding_window", where)
    index = positive(c, "index_head_dim", where)
    return [compressed_layer(head_dim, window, rates[t],
                             index if t == "compressed_sparse_attention" else 0) for t in types]


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
    attention, MLA (DeepSeek-V3.2's with indexer keys), sliding-window, Gated DeltaNet, Mamba-2
    (Bamba, Granite 4) and DeepSeek-V4's compressed layers, placed by ``layer_types`` or the
    family's own rule (a Gemma pattern, an alternation, Qwen3-Next's interval, Bamba's
    ``attn_layer_indices``, V4's ``compress_ratios``). A
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
        raise ValueError(f"{name}: model_type {model_type!r} has state-space layers kvdoc does "
                         "not count; it reads attention, MLA, sliding-window, Gated DeltaNet "
                         "and Bamba / Granite 4 Mamba-2 layers")
    layers = positive(c, "num_hidden_layers", name)
    context = positive(c, "max_position_embeddings", name)
    if model_type == "deepseek_v4":
        return ModelCache(str(c.get("_name_or_path") or name), tuple(_deepseek_v4(c, layers, name)),
                          context, name)
    if model_type == "bamba":
        attention = set(c.get("attn_layer_indices") or ())
        c = {**c, "layer_types": ["full_attention" if i in attention else "linear_attention"
                                  for i in range(layers)]}
    types = _layer_types(c, layers, name)
    if model_type == "deepseek_v32":  # every layer indexed
        types = ["full_attention" if t == "indexed_attention" else t for t in types]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"{name}: unknown layer types {unknown}; kvdoc reads full_attention, "
                         "sliding_attention and linear_attention")
    note, heads = "", None
    if c.get("kv_lora_rank") is not None and model_type == "deepseek_v32":
        full = indexed_mla_layer(positive(c, "kv_lora_rank", name),
                                 positive(c, "qk_rope_head_dim", name),
                                 positive(c, "index_head_dim", name))
        window = None
    elif c.get("kv_lora_rank") is not None:
        full = mla_layer(positive(c, "kv_lora_rank", name), positive(c, "qk_rope_head_dim", name))
        window = None
    else:
        heads, kv_heads, head_dim = attention_sizes(c, name)
        full = attention_layer(kv_heads, head_dim)
        window = (positive(c, "sliding_window", name) if "sliding_attention" in types else None)
    linear = LayerCache(0)
    if "linear_attention" in types:
        if model_type in _MAMBA2:
            linear = _mamba2(c, name)
        elif all(c.get(k) is not None for k in _DELTA):
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
