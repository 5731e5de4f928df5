"""Every published model's cache as per-layer costs, behind one lookup: :func:`model_cache`.

A model's layers do not all cache the same way. A full-attention layer adds ``2 x H_kv x D``
elements a position (K and V); a sliding-window layer adds as many but stops at its window
``W``; an MLA layer (DeepSeek-V3) adds one latent of ``kv_lora_rank + qk_rope_head_dim``
elements a position, shared by K and V; a linear-attention layer (Qwen3-Next's Gated DeltaNet)
adds nothing a position and keeps a fixed-size state instead. :class:`LayerCache` says which,
and one formula covers them all: per sequence,

    bytes(T) = s x sum over layers of (per_token x min(T, W) + state)

(``W`` infinite for a full layer). :data:`MODELS` holds every preset the package knows, of
each kind: ``plain`` and ``windowed`` from :data:`~kvdoc.measure.presets.PRESETS`, ``hybrid``
from :data:`~kvdoc.measure.presets.HYBRID_PRESETS`, and the ``MLA``, gpt-oss and
``linear-hybrid`` entries below, each with the ``config.json`` it comes from.
:mod:`kvdoc.measure.config_json` builds the same description from a transformers config file.

Importing this module does not import torch.

>>> llama = model_cache("Llama-3-8B")
>>> llama.kind, llama.bytes_per_token("float16")            # 2 x 32 x 8 x 128 x 2
('plain', 131072)
>>> model_cache("DeepSeek-V3").bytes_per_token("bfloat16")   # 61 x (512 + 64) x 2
70272
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

# torch-free: the command line imports this module, and loading torch takes seconds
from kvdoc.core.cache import check_int

from .dtypes import element_size
from .kv_bytes import fp8_scale_bytes
from .presets import HYBRID_PRESETS, PRESETS, HybridPreset, ModelPreset, _lookup

if TYPE_CHECKING:
    import torch

KINDS = ("plain", "windowed", "hybrid", "MLA", "linear-hybrid")
"""The kinds of :attr:`ModelCache.kind`: every layer full; every layer windowed; window and
full layers mixed; MLA latents; linear-attention layers beside attention ones."""


class LayerCache(NamedTuple):
    """What one layer keeps per sequence, in elements."""

    per_token: int
    """Elements one more position adds (``2 x H_kv x D``; MLA: ``r + d_R``; linear: 0)."""
    window: int | None = None
    """``W``: the layer keeps at most the last ``W`` positions (None: all of them)."""
    state: int = 0
    """Elements held whatever the length (a linear-attention layer's recurrent and conv
    state)."""
    kv_heads: int = 0
    """``H_kv`` of a K/V layer (what per-head FP8 scales count); 0 for a layer without K/V
    heads (MLA, linear attention)."""


def attention_layer(kv_heads: int, head_dim: int, window: int | None = None) -> LayerCache:
    """A K/V layer: ``2 x H_kv x D`` elements a position, capped at ``window`` if given."""
    return LayerCache(2 * check_int("kv_heads", kv_heads) * check_int("head_dim", head_dim),
                      None if window is None else check_int("window", window),
                      kv_heads=kv_heads)


def mla_layer(kv_lora_rank: int, qk_rope_head_dim: int) -> LayerCache:
    """An MLA layer: one latent of ``kv_lora_rank`` plus the rotary key of
    ``qk_rope_head_dim``, a position (no separate K and V)."""
    return LayerCache(check_int("kv_lora_rank", kv_lora_rank)
                      + check_int("qk_rope_head_dim", qk_rope_head_dim))


def gated_delta_layer(num_key_heads: int, num_value_heads: int, key_head_dim: int,
                      value_head_dim: int, conv_kernel: int) -> LayerCache:
    """A Gated DeltaNet layer (Qwen3-Next), as transformers 5.24.0's cache holds it: a
    recurrent state ``[H_v, D_k, D_v]`` and a conv state ``[conv_dim, kernel]`` with
    ``conv_dim = 2 x H_k x D_k + H_v x D_v``; nothing per position."""
    for name, value in (("num_key_heads", num_key_heads), ("num_value_heads", num_value_heads),
                        ("key_head_dim", key_head_dim), ("value_head_dim", value_head_dim),
                        ("conv_kernel", conv_kernel)):
        check_int(name, value)
    conv_dim = 2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim
    recurrent = num_value_heads * key_head_dim * value_head_dim
    return LayerCache(0, None, recurrent + conv_dim * conv_kernel)


@dataclass(frozen=True)
class ModelCache:
    """A model's cache, layer by layer.

    Attributes:
        name: as the model card names it (case-insensitive in :func:`model_cache`).
        kind: one of :data:`KINDS`.
        layers: one :class:`LayerCache` per decoder layer.
        max_positions: the context the release was configured for.
        source: the ``config.json`` the sizes come from.
        note: what the count leaves out or assumes.
    """

    name: str
    kind: str
    layers: tuple[LayerCache, ...]
    max_positions: int
    source: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if not self.layers:
            raise ValueError(f"{self.name}: need at least one layer")
        check_int("max_positions", self.max_positions)

    def elements(self, seq_len: int, preallocated: bool = False) -> int:
        """Elements one sequence of ``seq_len`` positions keeps, over all layers; with
        ``preallocated`` a window layer holds its ``W`` rows from the start (a ring allocated
        at its full size, as :func:`~kvdoc.core.window.window_cache`'s)."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
            raise ValueError(f"seq_len must be a non-negative integer, got {seq_len!r}")
        return sum(layer.per_token * (seq_len if layer.window is None else layer.window
                                      if preallocated else min(seq_len, layer.window))
                   + layer.state for layer in self.layers)

    def kv_bytes(self, seq_len: int, batch: int = 1, dtype: str | torch.dtype = "float16",
                 preallocated: bool = False) -> int:
        """Bytes of ``batch`` sequences of ``seq_len`` positions, ``s`` bytes an element
        (``preallocated``: as :meth:`elements`).

        >>> oss = model_cache("gpt-oss-20b")     # past W = 128 only its 12 full layers grow
        >>> oss.kv_bytes(256) - oss.kv_bytes(128) == 12 * (2 * 8 * 64) * 2 * 128
        True
        >>> oss.kv_bytes(1, preallocated=True) == oss.kv_bytes(128) - 12 * 2 * 8 * 64 * 2 * 127
        True
        """
        return (check_int("batch", batch) * element_size(dtype)
                * self.elements(seq_len, preallocated))

    def bytes_per_token(self, dtype: str | torch.dtype = "float16") -> int:
        """Bytes one position adds while it is inside every window (batch 1)."""
        return element_size(dtype) * sum(layer.per_token for layer in self.layers)

    def fixed_bytes(self, dtype: str | torch.dtype = "float16") -> int:
        """Bytes a sequence holds whatever its length (linear-attention states)."""
        return element_size(dtype) * sum(layer.state for layer in self.layers)

    def sequences_that_fit(self, memory: int, seq_len: int,
                           dtype: str | torch.dtype = "float16") -> int:
        """How many sequences of ``seq_len`` fit in ``memory`` bytes of cache.

        >>> model_cache("Llama-3-8B").sequences_that_fit(2**30, 8192)  # 1 GiB, 1 GiB each
        1
        """
        per_sequence = self.kv_bytes(seq_len, 1, dtype)
        if per_sequence == 0:
            raise ValueError("an empty cache: every count of sequences fits")
        return check_int("memory", memory) // per_sequence

    def fp8_scale_bytes(self, granularity: str) -> int:
        """Bytes of the FP32 scales an FP8 cache of this model keeps beside its elements
        (:func:`~kvdoc.measure.kv_bytes.fp8_scale_bytes`), per K/V layer; whatever ``T`` and
        the batch.

        Raises:
            ValueError: the model has MLA layers (engines scale a latent otherwise: not
                counted here), or ``granularity`` is unknown.

        >>> model_cache("Llama-3-8B").fp8_scale_bytes("per-head")   # 32 x 2 x 8 x 4
        2048
        """
        if self.kind == "MLA":
            raise ValueError(f"{self.name} caches an MLA latent: its FP8 scales are not the "
                             "per-tensor or per-head K/V scales counted here")
        heads = [layer.kv_heads for layer in self.layers if layer.kv_heads]
        return fp8_scale_bytes(heads, granularity) if heads else 0

    def groups(self) -> list[tuple[LayerCache, int]]:
        """The distinct layers and how many of each, in order of first appearance."""
        return list(Counter(self.layers).items())


def config_cache(config: object, windows: bool = True) -> ModelCache:
    """A kvdoc model configuration's cache as per-layer costs, the formula the verification
    counts real caches against (:mod:`kvdoc.proofs.figures`).

    An MLA config (``kv_lora_rank``) caches its latent and its rotary key a layer; a config
    with ``layer_windows`` (Gemma 3) its window and global layers; any other (a GPTConfig)
    K and V a layer, windowed if it has a ``sliding_window``. ``windows=False`` describes a
    cache that keeps every position of every layer (a dynamic cache of a windowed model).

    >>> from kvdoc.core.model import GPTConfig, mistral_config
    >>> config_cache(GPTConfig()).bytes_per_token("float32")   # 2 layers x 2 x 4 heads x 16 x 4
    1024
    >>> config_cache(mistral_config(sliding_window=16)).layers[0].window
    16
    """
    if hasattr(config, "kv_lora_rank"):
        layers = [mla_layer(config.kv_lora_rank, config.qk_rope_head_dim)] * config.n_layer
        kind = "MLA"
    else:
        per_layer = getattr(config, "layer_windows", None)
        if per_layer is None:
            per_layer = [getattr(config, "sliding_window", None)] * config.n_layer
        per_layer = [w if windows else None for w in per_layer]
        layers = [attention_layer(config.n_kv_head, config.head_dim, w) for w in per_layer]
        found = {w is None for w in per_layer}
        kind = "hybrid" if len(found) == 2 else "plain" if found == {True} else "windowed"
    return ModelCache(type(config).__name__, kind, tuple(layers), config.n_positions,
                      "the kvdoc config")


def every_nth_full(layers: int, pattern: int) -> list[str]:
    """Layer types where every ``pattern``-th layer is full and the rest windowed, as
    :func:`kvdoc.core.gemma.gemma_layer_types` gives them (that module imports torch).

    >>> every_nth_full(4, 2)
    ['sliding_attention', 'full_attention', 'sliding_attention', 'full_attention']
    """
    check_int("layers", layers)
    check_int("pattern", pattern)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)]


def from_preset(p: ModelPreset | HybridPreset) -> ModelCache:
    """The :class:`ModelCache` of a :data:`PRESETS` or :data:`HYBRID_PRESETS` entry."""
    if isinstance(p, HybridPreset):
        types = every_nth_full(p.layers, p.sliding_window_pattern)
        layers = tuple(attention_layer(p.kv_heads, p.head_dim,
                                       p.sliding_window if t == "sliding_attention" else None)
                       for t in types)
        return ModelCache(p.name, "hybrid", layers, p.max_positions, p.source)
    kind = "plain" if p.sliding_window is None else "windowed"
    layers = (attention_layer(p.kv_heads, p.head_dim, p.sliding_window),) * p.layers
    return ModelCache(p.name, kind, layers, p.max_positions, p.source)


def _gpt_oss(name: str, layers: int) -> ModelCache:
    # layer_types in the published config: sliding, full, sliding, full, ...
    types = tuple(attention_layer(8, 64, 128 if t == "sliding_attention" else None)
                  for t in every_nth_full(layers, 2))
    return ModelCache(
        name, "hybrid", types, 131072,
        f"https://huggingface.co/openai/{name}/blob/main/config.json (num_hidden_layers "
        f"{layers}, num_key_value_heads 8, head_dim 64, sliding_window 128, layer_types "
        "alternating sliding_attention and full_attention, max_position_embeddings 131072)",
        "the attention sinks are one learned scalar a head, not cached per position")


def _qwen3_next() -> ModelCache:
    # full_attention_interval 4: three linear-attention layers, then a full one, 12 times
    linear = gated_delta_layer(16, 32, 128, 128, 4)
    full = attention_layer(2, 256)
    return ModelCache(
        "Qwen3-Next-80B-A3B", "linear-hybrid", (linear, linear, linear, full) * 12, 262144,
        "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json "
        "(num_hidden_layers 48, full_attention_interval 4, num_key_value_heads 2, head_dim 256, "
        "linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128, "
        "linear_value_head_dim 128, linear_conv_kernel_dim 4, "
        "max_position_embeddings 262144)",
        "36 Gated DeltaNet layers keep a fixed state (counted in the same dtype, as "
        "transformers keeps it); 12 attention layers keep K/V per position")


#: MLA, gpt-oss and linear-attention presets, keyed by lower-case name. DeepSeek-V3's sizes are
#: :data:`kvdoc.interop.hf_deepseek.PUBLISHED`'s (tests/test_model_caches.py compares them; that
#: module imports torch).
OTHER_MODELS: dict[str, ModelCache] = {m.name.lower(): m for m in (
    ModelCache("DeepSeek-V3", "MLA", (mla_layer(512, 64),) * 61, 163840,
               "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json "
               "(num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64, "
               "max_position_embeddings 163840)",
               "the multi-token-prediction layer (num_nextn_predict_layers 1) is left out"),
    _gpt_oss("gpt-oss-20b", 24),
    _gpt_oss("gpt-oss-120b", 36),
    _qwen3_next(),
)}

#: Every preset the package knows, of every kind, keyed by lower-case name.
MODELS: dict[str, ModelCache] = {
    **{k: from_preset(p) for k, p in PRESETS.items()},
    **{k: from_preset(p) for k, p in HYBRID_PRESETS.items()},
    **OTHER_MODELS,
}


def model_cache(name: str) -> ModelCache:
    """The :data:`MODELS` entry called ``name`` (case-insensitive), of any kind.

    Raises:
        ValueError: no such model; the message lists the known names.
    """
    return _lookup(MODELS, name, "model")


def calculator_presets() -> list[dict[str, object]]:
    """:data:`MODELS` as the calculator page's JSON: per model its name, kind, context, source,
    note and layer groups ``[per_token, window, state, count]``."""
    return [{"name": m.name, "kind": m.kind, "context": m.max_positions, "source": m.source,
             "note": m.note,
             "groups": [[g.per_token, g.window, g.state, n] for g, n in m.groups()]}
            for m in MODELS.values()]
