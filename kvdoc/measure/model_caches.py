"""Models' sizes as :class:`~kvdoc.measure.layer_caches.ModelCache` s: the published ones
(:data:`MODELS`, :func:`model_cache`), a kvdoc config (:func:`config_cache`) and a transformers
``config.json`` (:func:`read_config`, read by :mod:`kvdoc.interop.hf_config`'s rules).

>>> llama = model_cache("Llama-3-8B")
>>> llama.kind, llama.attention, len(llama.layers), llama.bytes_per_token("float16")
('plain', 'GQA', 32, 131072)
>>> model_cache("DeepSeek-V3").bytes_per_token("bfloat16")   # 61 x (512 + 64) x 2
70272
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from kvdoc.interop.hf_config import attention_sizes, config_fields, positive

from .layer_caches import (  # noqa: F401  (KINDS: this module's name, as before)
    KINDS,
    LayerCache,
    ModelCache,
    attention_layer,
    compressed_layer,
    every_nth_full,
    gated_delta_layer,
    indexed_mla_layer,
    mamba2_layer,
    mla_layer,
)


def config_cache(config: object, windows: bool = True) -> ModelCache:
    """A kvdoc config's cache, the formula the verification counts real caches against;
    ``windows=False``: every layer keeps every position (a windowed model's dynamic cache).

    >>> from kvdoc.core.model import GPTConfig
    >>> from kvdoc.core.model import mistral_config
    >>> config_cache(GPTConfig()).bytes_per_token("float32")   # 2 layers x 2 x 4 heads x 16 x 4
    1024
    >>> config_cache(mistral_config(sliding_window=16)).layers[0].window
    16
    """
    if hasattr(config, "kv_lora_rank"):  # and an indexed layer's indexer key (DeepSeek-V3.2)
        per_token = config.latent_dim + getattr(config, "index_head_dim", 0)
        layers = [LayerCache(per_token)] * config.n_layer
    else:
        per_layer = (getattr(config, "layer_windows", None)
                     or [getattr(config, "sliding_window", None)] * config.n_layer)
        layers = [attention_layer(config.n_kv_head, config.head_dim, w if windows else None)
                  for w in per_layer]
    return ModelCache(type(config).__name__, tuple(layers), config.n_positions,
                      "the kvdoc config")


# --- the published models ---------------------------------------------------------------------

def _preset(name: str, layers: int, heads: int | None, kv_heads: int, head_dim: int,
            context: int, source: str, window: int | None = None, every: int = 0,
            note: str = "", **sizes: int) -> ModelCache:
    """K/V layers all alike (``window``: all windowed), or every ``every``-th one full."""
    full, windowed = attention_layer(kv_heads, head_dim), attention_layer(kv_heads, head_dim,
                                                                          window)
    types = every_nth_full(layers, every) if every else ["sliding_attention"] * layers
    return ModelCache(name, tuple(full if t == "full_attention" else windowed for t in types),
                      context, source, note, heads, **sizes)


_HF = "https://huggingface.co/{}/blob/main/config.json"


def _llama(name: str, repo: str, layers: int, heads: int, hidden: int, intermediate: int,
           vocab: int, context: int) -> ModelCache:
    """A Llama 3 release: 8 K/V heads of 128."""
    return _preset(name, layers, heads, 8, 128, context, _HF.format(repo), hidden=hidden,
                   intermediate=intermediate, vocab=vocab)


def _qwen3(name: str, layers: int, heads: int, kv_heads: int = 8, note: str = "") -> ModelCache:
    """A Qwen3 release: heads of 128, a context of 40,960."""
    return _preset(name, layers, heads, kv_heads, 128, 40960, _HF.format(f"Qwen/{name}") + note)


def _gemma(name: str, repo: str, layers: int, heads: int, kv_heads: int, head_dim: int,
           hidden: int) -> ModelCache:
    """Gemma 2 (every other layer windowed) or Gemma 3 (five windowed layers, then one)."""
    if name.startswith("Gemma-2"):
        return _preset(name, layers, heads, kv_heads, head_dim, 8192, _HF.format(repo), 4096, 2,
                       hidden=hidden)
    small = name == "Gemma-3-1B"
    return _preset(name, layers, heads, kv_heads, head_dim, 32768 if small else 131072,
                   _HF.format(repo) + ("" if small else " (text_config)"),
                   512 if small else 1024, 6, hidden=hidden)


_LLAMA2 = ("meta-llama/Llama-2-{}b-hf config.json (num_hidden_layers {}, num_attention_heads "
           "{}, num_key_value_heads {}, hidden_size {}, intermediate_size {}, vocab_size "
           "32000); Touvron et al. 2023, 'Llama 2'")

_STATE = ("keep a fixed state (the conv state in the cache's dtype, the {} state in FP32, as "
          "transformers 5.24.0 keeps them)")


def _gpt_oss(name: str, layers: int) -> ModelCache:
    """gpt-oss: ``layer_types`` in the published config alternate sliding and full."""
    return _preset(name, layers, None, 8, 64, 131072,
                   f"{_HF.format('openai/' + name)} (num_hidden_layers {layers}, "
                   "num_key_value_heads 8, head_dim 64, sliding_window 128, layer_types "
                   "alternating sliding_attention and full_attention, max_position_embeddings "
                   "131072)", 128, 2,
                   "the attention sinks are one learned scalar a head, not cached per position")


#: Every published model the package knows, by lower-case name, each with the file its sizes
#: come from. Left out, as no release's config.json was read (``--config`` reads one): Qwen3.5,
#: Nemotron-H, Granite 4, DeepSeek-V4 (``DeepseekV4Config``'s defaults are V4-Pro's pattern).
MODELS: dict[str, ModelCache] = {m.name.lower(): m for m in (
    _preset("GPT-2-small", 12, 12, 12, 64, 1024,
            "openai-community/gpt2 config.json (n_layer 12, n_head 12, n_embd 768); "
            "Radford et al. 2019, 'Language Models are Unsupervised Multitask "
            "Learners'"),
    _preset("Llama-2-7B", 32, 32, 32, 128, 4096, _LLAMA2.format(7, 32, 32, 32, 4096, 11008),
            hidden=4096, intermediate=11008, vocab=32000),
    _preset("Llama-2-70B", 80, 64, 8, 128, 4096, _LLAMA2.format(70, 80, 64, 8, 8192, 28672),
            hidden=8192, intermediate=28672, vocab=32000),
    _llama("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", 32, 32, 4096, 14336, 128256, 8192),
    _preset("Mistral-7B-v0.1", 32, 32, 8, 128, 32768,
            "mistralai/Mistral-7B-v0.1 config.json (num_hidden_layers 32, "
            "num_attention_heads 32, num_key_value_heads 8, hidden_size 4096, "
            "intermediate_size 14336, vocab_size 32000, sliding_window 4096); "
            "Jiang et al. 2023, 'Mistral 7B' (rolling buffer cache)",
            window=4096, hidden=4096, intermediate=14336, vocab=32000),
    _preset("Falcon-7B", 32, 71, 1, 64, 2048,
            "tiiuae/falcon-7b config.json (n_layer 32, n_head 71, hidden_size 4544, "
            "multi_query true)"),
    _llama("Llama-3-70B", "meta-llama/Meta-Llama-3-70B", 80, 64, 8192, 28672, 128256, 8192),
    _llama("Llama-3.1-8B", "meta-llama/Llama-3.1-8B", 32, 32, 4096, 14336, 128256, 131072),
    _llama("Llama-3.1-70B", "meta-llama/Llama-3.1-70B", 80, 64, 8192, 28672, 128256, 131072),
    _llama("Llama-3.1-405B", "meta-llama/Llama-3.1-405B", 126, 128, 16384, 53248, 128256,
           131072),
    _qwen3("Qwen3-4B", 36, 32),
    _qwen3("Qwen3-8B", 36, 32),
    _qwen3("Qwen3-14B", 40, 40),
    _qwen3("Qwen3-32B", 64, 64),
    _qwen3("Qwen3-30B-A3B", 48, 32, 4, " (the experts do not change the cache)"),
    _preset("Mistral-7B-v0.3", 32, 32, 8, 128, 32768,
            _HF.format("mistralai/Mistral-7B-v0.3")
            + " (sliding_window null: every layer full)"),
    _preset("Mixtral-8x7B-v0.1", 32, 32, 8, 128, 32768,
            _HF.format("mistralai/Mixtral-8x7B-v0.1")
            + " (sliding_window null; the experts do not change the cache)"),
    _gemma("Gemma-2-2B", "google/gemma-2-2b", 26, 8, 4, 256, 2304),
    _gemma("Gemma-2-9B", "google/gemma-2-9b", 42, 16, 8, 256, 3584),
    _gemma("Gemma-2-27B", "google/gemma-2-27b", 46, 32, 16, 128, 4608),
    _gemma("Gemma-3-1B", "google/gemma-3-1b-pt", 26, 4, 1, 256, 1152),
    _gemma("Gemma-3-4B", "google/gemma-3-4b-pt", 34, 8, 4, 256, 2560),
    _gemma("Gemma-3-12B", "google/gemma-3-12b-pt", 48, 16, 8, 256, 3840),
    _gemma("Gemma-3-27B", "google/gemma-3-27b-pt", 62, 32, 16, 128, 5376),
    ModelCache("DeepSeek-V3", (mla_layer(512, 64),) * 61, 163840,
               _HF.format("deepseek-ai/DeepSeek-V3") + " (num_hidden_layers 61, kv_lora_rank "
               "512, qk_rope_head_dim 64, max_position_embeddings 163840)",
               "the multi-token-prediction layer (num_nextn_predict_layers 1) is left out"),
    _gpt_oss("gpt-oss-20b", 24),
    _gpt_oss("gpt-oss-120b", 36),
    # full_attention_interval 4: three linear-attention layers, then a full one
    ModelCache(
        "Qwen3-Next-80B-A3B",
        ((gated_delta_layer(16, 32, 128, 128, 4),) * 3 + (attention_layer(2, 256),)) * 12, 262144,
        _HF.format("Qwen/Qwen3-Next-80B-A3B-Instruct") + " (num_hidden_layers 48, "
        "full_attention_interval 4, num_key_value_heads 2, head_dim 256, linear_num_key_heads "
        "16, linear_num_value_heads 32, linear_key_head_dim 128, linear_value_head_dim 128, "
        "linear_conv_kernel_dim 4, max_position_embeddings 262144)",
        "36 Gated DeltaNet layers " + _STATE.format("recurrent") + "; 12 attention layers keep "
        "K/V per position"),
    # attn_layer_indices 9, 18, 27: the other 29 layers are Mamba-2
    ModelCache(
        "Bamba-9B",
        tuple(attention_layer(8, 128) if i in (9, 18, 27) else mamba2_layer(128, 64, 1, 128, 4)
              for i in range(32)), 262144,
        _HF.format("ibm-fms/Bamba-9B") + " (num_hidden_layers 32, attn_layer_indices [9, 18, "
        "27], num_attention_heads 32, num_key_value_heads 8, hidden_size 4096, mamba_n_heads "
        "128, mamba_d_head 64, mamba_n_groups 1, mamba_d_state 128, mamba_d_conv 4, mamba_expand "
        "2; no max_position_embeddings: transformers 5.24.0's BambaConfig default, 262144)",
        "29 Mamba-2 layers " + _STATE.format("SSM") + "; 3 attention layers keep K/V"),
    ModelCache(
        "DeepSeek-V3.2-Exp", (indexed_mla_layer(512, 64, 128),) * 61, 163840,
        "transformers 5.24.0 models/deepseek_v32/configuration_deepseek_v32.py, "
        "DeepseekV32Config defaults (its checkpoint: deepseek-ai/DeepSeek-V3.2-Exp; "
        "num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128, "
        "index_topk 2048, max_position_embeddings 163840); the release's config.json not read",
        "every position keeps its latent and an indexer key (the top 2,048 a query reads "
        "change with the query, so none is dropped); the multi-token-prediction layer is left "
        "out"),
)}


def model_cache(name: str) -> ModelCache:
    """The :data:`MODELS` entry called ``name`` (any case); a ValueError names the nearest."""
    try:
        return MODELS[name.lower()]
    except (KeyError, AttributeError):
        near = get_close_matches(str(name).lower(), MODELS, n=3)
        known = ", ".join(MODELS[key].name for key in near or MODELS)
        hint = f"did you mean {known}?" if near else f"known models: {known}"
        raise ValueError(f"unknown model {name!r}; {hint}") from None


# --- a transformers config.json -------------------------------------------------------------

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
    """DeepSeek-V4's layers from ``layer_types`` (or the release's ``compress_ratios``) and
    ``compress_rates``, as transformers 5.24.0's ``DeepseekV4Config`` reads them."""
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
        return every_nth_full(layers, every, "linear_attention")
    windowed = c.get("sliding_window") is not None and c.get("use_sliding_window") is not False
    return ["sliding_attention" if windowed else "full_attention"] * layers


def cache_from_config(config: Mapping[str, Any], name: str = "config.json") -> ModelCache:
    """The :class:`ModelCache` a parsed ``config.json`` describes, its layers placed by
    ``layer_types`` or the family's own rule; a linear-attention layer without its sizes is
    not counted (the note says so); state-space layers and anything malformed: a ValueError.

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
    if c.get("kv_lora_rank") is not None:
        full, window = mla_layer(positive(c, "kv_lora_rank", name),
                                 positive(c, "qk_rope_head_dim", name)), None
        if model_type == "deepseek_v32":  # and an indexer key a position
            full = full._replace(indexer=positive(c, "index_head_dim", name))
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
    """:func:`cache_from_config` of the ``config.json`` at ``path`` or in the folder ``path``;
    a ValueError if it is missing, not JSON, or not a config kvdoc can read."""
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
