"""A model's sizes, in one representation: :class:`ModelCache`, what each layer caches.

A full-attention layer adds ``2 x H_kv x D`` elements a position (K and V); a sliding-window
layer as many, up to its window ``W``; an MLA layer (DeepSeek-V3) one latent of
``kv_lora_rank + qk_rope_head_dim``, shared by K and V (DeepSeek-V3.2 adds an indexer key); a
state layer (Gated DeltaNet, Mamba-2) nothing a position but a fixed-size state; a DeepSeek-V4
layer a K = V window and compressed entries. :class:`~kvdoc.measure.layer_caches.LayerCache`
says which, and one formula covers them all: per sequence,

    bytes(T) = s x sum over layers of (per_token x min(T, W) + state + compressed terms)

(``W`` infinite for a full layer; :mod:`kvdoc.measure.layer_caches` has the terms).
:data:`MODELS` holds the published models the package knows
(:func:`model_cache` looks them up); :func:`config_cache` reads a kvdoc model's config, and
:mod:`kvdoc.measure.config_json` a transformers ``config.json``. Importing this module does not
import torch.

>>> llama = model_cache("Llama-3-8B")
>>> llama.kind, llama.attention, len(llama.layers), llama.bytes_per_token("float16")
('plain', 'GQA', 32, 131072)
>>> model_cache("DeepSeek-V3").bytes_per_token("bfloat16")   # 61 x (512 + 64) x 2
70272
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from difflib import get_close_matches
from typing import TYPE_CHECKING

# torch-free: the command line imports this module, and loading torch takes seconds
from .kv_bytes import check_int, element_size, fp8_scale_bytes
from .layer_caches import (  # noqa: F401  (gated_delta_layer: re-exported, as before)
    LayerCache,
    attention_layer,
    gated_delta_layer,
    mla_layer,
)
from .recent_models import RECENT

if TYPE_CHECKING:
    import torch

KINDS = ("plain", "windowed", "hybrid", "MLA", "linear-hybrid", "compressed")
"""The kinds of :attr:`ModelCache.kind`: every layer full; every layer windowed; window and
full layers mixed; MLA latents (with or without indexer keys); state layers (linear attention,
Mamba-2) beside attention ones; DeepSeek-V4's K = V windows and compressed entries."""


@dataclass(frozen=True)
class ModelCache:
    """A model's sizes: its cache, one :class:`LayerCache` per decoder layer; the context
    ``max_positions``; the ``source`` (a ``config.json`` or paper) and a ``note`` of what the
    count leaves out. ``heads`` (query heads) and ``hidden``, ``intermediate``, ``vocab`` (for
    the models whose weights :mod:`kvdoc.measure.batch_decode` counts) are None where not
    recorded."""

    name: str
    layers: tuple[LayerCache, ...]
    max_positions: int
    source: str
    note: str = ""
    heads: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    vocab: int | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"{self.name}: need at least one layer")
        check_int("max_positions", self.max_positions)
        if self.heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads={self.heads} is not divisible by "
                             f"kv_heads={self.kv_heads}")

    @property
    def kind(self) -> str:
        """One of :data:`KINDS`, read off the layers."""
        whats = {layer.what for layer in self.layers}
        if "K = V" in whats:
            return "compressed"
        if "latent" in whats:
            return "MLA"
        if "" in whats:
            return "linear-hybrid"
        full = {layer.window is None for layer in self.layers}
        return "hybrid" if len(full) == 2 else "plain" if full == {True} else "windowed"

    def _kv_layer(self) -> LayerCache:
        for layer in self.layers:
            if layer.kv_heads:
                return layer
        raise ValueError(f"{self.name} has no K/V attention layer")

    @property
    def kv_heads(self) -> int:
        """``H_kv`` of the (first) K/V layer."""
        return self._kv_layer().kv_heads

    @property
    def head_dim(self) -> int:
        """``D`` of the (first) K/V layer."""
        layer = self._kv_layer()
        return layer.per_token // (2 * layer.kv_heads)

    @property
    def sliding_window(self) -> int | None:
        """``W`` of the windowed layers (None: no layer is windowed)."""
        return next((layer.window for layer in self.layers if layer.window), None)

    @property
    def attention(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"`` (``H_kv == H``, between, ``1``)."""
        if self.kv_heads == self.heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    def elements(self, seq_len: int, windows: bool = True) -> int:
        """Elements one sequence of ``seq_len`` positions keeps, over all layers: a window layer
        its last ``W`` rows at most; ``windows=False`` counts every layer as full (the same model
        with no window)."""
        return sum(layer.elements(seq_len, windows) for layer in self.layers)

    def parts(self, seq_len: int, batch: int = 1, dtype: str | torch.dtype = "float16",
              windows: bool = True) -> dict[str, int]:
        """Bytes of ``batch`` sequences of ``seq_len`` positions by term, apart (K/V, latent,
        indexer keys, compressed entries, block buffer, state; the FP32 state at 4 bytes).

        >>> model_cache("Qwen3-Next-80B-A3B").parts(0, dtype="bfloat16")  # T = 0: the states
        {'state': 2359296, 'state (FP32)': 75497472}
        """
        b, total = check_int("batch", batch), {}
        for layer in self.layers:
            for name, n in layer.parts(seq_len, windows).items():
                total[name] = total.get(name, 0) + n
        s = element_size(dtype)
        return {name: b * n * (4 if name == "state (FP32)" else s)
                for name, n in total.items()}

    def all_attention(self) -> ModelCache:
        """The same count of layers, each a full-attention layer of this model's own attention
        sizes (its first layer that keeps positions, with no window, indexer or compression):
        what the cache would be without windows, states or compression.

        >>> model_cache("Qwen3-Next-80B-A3B").all_attention().kind
        'plain'
        """
        base = next((layer for layer in self.layers if layer.per_token), None)
        if base is None:
            raise ValueError(f"{self.name} has no layer that keeps positions")
        full = LayerCache(base.per_token, kv_heads=base.kv_heads, shared_kv=base.shared_kv)
        return ModelCache(f"{self.name}, all attention", (full,) * len(self.layers),
                          self.max_positions, self.source)

    def kv_bytes(self, seq_len: int, batch: int = 1, dtype: str | torch.dtype = "float16",
                 windows: bool = True) -> int:
        """Bytes of ``batch`` sequences of ``seq_len`` positions, ``s`` bytes an element
        (``windows``: as :meth:`elements`).

        >>> oss = model_cache("gpt-oss-20b")     # past W = 128 only its 12 full layers grow
        >>> oss.kv_bytes(256) - oss.kv_bytes(128) == 12 * (2 * 8 * 64) * 2 * 128
        True
        >>> g = model_cache("Gemma-3-1B")        # 4 global layers of 26 hold all T
        >>> g.kv_bytes(32768, windows=False) // g.kv_bytes(32768)
        5
        """
        return sum(self.parts(seq_len, batch, dtype, windows).values())

    def bytes_per_token(self, dtype: str | torch.dtype = "float16",
                        past_windows: bool = False) -> int:
        """Bytes one position adds while it is inside every window (batch 1); with
        ``past_windows``, once it is past them all, when only the full layers grow. A
        compressed entry, added once a block, is not in it.

        >>> g = model_cache("Gemma-3-27B")     # 62 layers grow, then only the 10 full ones
        >>> g.bytes_per_token("bfloat16"), g.bytes_per_token("bfloat16", past_windows=True)
        (507904, 81920)
        """
        return element_size(dtype) * sum(
            (layer.per_token if not (past_windows and layer.window) else 0)
            + (0 if layer.rate else layer.indexer) for layer in self.layers)

    def fixed_bytes(self, dtype: str | torch.dtype = "float16") -> int:
        """Bytes a sequence holds whatever its length (the states; a recurrent one in FP32)."""
        return sum(self.parts(0, 1, dtype).values())

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
        (:func:`~kvdoc.measure.kv_bytes.fp8_scale_bytes`), whatever ``T`` and the batch; a
        ValueError for an MLA model (engines scale a latent otherwise: not counted here).

        >>> model_cache("Llama-3-8B").fp8_scale_bytes("per-head")   # 32 x 2 x 8 x 4
        2048
        """
        if self.kind in ("MLA", "compressed"):
            raise ValueError(f"{self.name} caches no K/V heads ({self.kind}): its FP8 scales "
                             "are not the per-tensor or per-head K/V scales counted here")
        heads = [layer.kv_heads for layer in self.layers if layer.kv_heads]
        return fp8_scale_bytes(heads, granularity) if heads else 0

    @property
    def parameters(self) -> int | None:
        """Weights of a Llama-family model (untied head, no biases) from its sizes: embedding,
        head, final norm, and per layer Q, K, V, O, the gated MLP and two norms; else None.

        >>> model_cache("Llama-3.1-8B").parameters
        8030261248
        """
        if None in (self.hidden, self.intermediate, self.vocab):
            return None
        attention = 2 * (self.heads + self.kv_heads) * self.head_dim * self.hidden
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.hidden + len(self.layers) * layer

    def groups(self) -> list[tuple[LayerCache, int]]:
        """The distinct layers and how many of each, in order of first appearance."""
        return list(Counter(self.layers).items())


def config_cache(config: object, windows: bool = True) -> ModelCache:
    """A kvdoc model configuration's cache as per-layer costs, the formula the verification
    counts real caches against (:mod:`kvdoc.proofs.figures`). ``windows=False``: a cache that
    keeps every position of every layer (a dynamic cache of a windowed model).

    >>> from kvdoc.core.model import GPTConfig, mistral_config
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


# --- the published models ---------------------------------------------------------------------

def _preset(name: str, layers: int, heads: int | None, kv_heads: int, head_dim: int,
            context: int, source: str, window: int | None = None, every: int = 0,
            note: str = "", **sizes: int) -> ModelCache:
    """K/V layers all alike (``window``: all windowed), or with ``every``, each ``every``-th
    layer full and the rest windowed."""
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
    """Gemma 2 (a window of 4,096 every other layer) or Gemma 3 (five window layers of 512 or
    1,024, then a global one)."""
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

#: Every published model the package knows, keyed by lower-case name. Each ``source`` names the
#: file the sizes come from; DeepSeek-V3's are :data:`kvdoc.interop.hf_deepseek.PUBLISHED`'s
#: (tests/test_model_caches.py compares them; that module imports torch); the releases whose
#: layers keep more than K/V are :data:`~kvdoc.measure.recent_models.RECENT`.
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
    *(ModelCache(*spec) for spec in RECENT),
)}


def model_cache(name: str) -> ModelCache:
    """The :data:`MODELS` entry called ``name`` (case-insensitive), of any kind.

    Raises:
        ValueError: no such model; the message names the nearest (difflib), else all.
    """
    try:
        return MODELS[name.lower()]
    except (KeyError, AttributeError):
        near = get_close_matches(str(name).lower(), MODELS, n=3)
        known = ", ".join(MODELS[key].name for key in near or MODELS)
        hint = f"did you mean {known}?" if near else f"known models: {known}"
        raise ValueError(f"unknown model {name!r}; {hint}") from None

