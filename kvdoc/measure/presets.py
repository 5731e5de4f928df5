"""Published model configurations: the sizes that decide a released model's K/V cache.

:data:`PRESETS` holds models whose layers all attend the same way (GPT-2, Llama, Mistral,
Falcon); :data:`HYBRID_PRESETS` holds Gemma 2 and 3, whose sliding-window and global layers
alternate, and :func:`hybrid_vs_global` counts what their window layers save. Each entry names
the ``config.json`` (or paper) its numbers come from.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

# torch-free: the command line imports this module, and loading torch takes seconds
from kvdoc.core.cache import check_int

from .kv_bytes import kv_bytes, kv_bytes_per_layer

if TYPE_CHECKING:
    import torch

    from kvdoc.core.gemma import Gemma3Config


def _lookup(table: Mapping[str, Any], name: str, what: str) -> Any:
    """``table``'s entry called ``name`` (case-insensitive); a ValueError lists the known names."""
    try:
        return table[name.lower()]
    except (KeyError, AttributeError):
        known = ", ".join(p.name for p in table.values())
        raise ValueError(f"unknown {what} {name!r}; known models: {known}") from None


@dataclass(frozen=True)
class ModelPreset:
    """The sizes of a published model that decide its K/V cache.

    Attributes:
        name: short name used by ``--model`` (case-insensitive).
        layers: ``L``, decoder layers.
        heads: query heads ``H``.
        kv_heads: ``H_kv``; ``== heads`` is MHA, ``1`` is MQA, in between is GQA.
        head_dim: ``D``.
        max_positions: the context length the release was configured for.
        source: where the numbers come from (the official config.json or paper).
        sliding_window: ``W`` if the attention layers see only the last ``W`` positions.
        hidden, intermediate, vocab: ``d_model``, the MLP's width and the vocabulary, for the
            Llama-family presets whose weights :mod:`kvdoc.measure.batch_decode` counts
            (None where the architecture is another).
    """

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_positions: int
    source: str
    sliding_window: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    vocab: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "kv_heads", "head_dim", "max_positions"):
            check_int(name, getattr(self, name))
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads={self.heads} is not divisible by "
                             f"kv_heads={self.kv_heads}")

    @property
    def attention(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"``."""
        if self.kv_heads == self.heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    @property
    def group_size(self) -> int:
        """Query heads that share one K/V head, ``H / H_kv``."""
        return self.heads // self.kv_heads

    def kv_bytes(self, seq_len: int, batch: int = 1, dtype: str | torch.dtype = "float16",
                 windowed: bool = False) -> int:
        """K/V bytes at ``seq_len``; with ``windowed`` each layer holds at most
        ``sliding_window``."""
        window = self.sliding_window if windowed else None
        return kv_bytes(batch, self.layers, seq_len, self.kv_heads, self.head_dim, dtype,
                        window=window)

    def bytes_per_token(self, dtype: str | torch.dtype = "float16") -> int:
        """Bytes one more cached position adds, ``2 x L x H_kv x D x s`` (batch 1, no window)."""
        return self.kv_bytes(1, 1, dtype)


#: Published configurations, keyed by lower-case name. Each ``source`` names the file the sizes
#: come from.
PRESETS: dict[str, ModelPreset] = {p.name.lower(): p for p in (
    ModelPreset("GPT-2-small", layers=12, heads=12, kv_heads=12, head_dim=64, max_positions=1024,
                source="openai-community/gpt2 config.json (n_layer 12, n_head 12, n_embd 768); "
                       "Radford et al. 2019, 'Language Models are Unsupervised Multitask "
                       "Learners'"),
    ModelPreset("Llama-2-7B", layers=32, heads=32, kv_heads=32, head_dim=128, max_positions=4096,
                hidden=4096, intermediate=11008, vocab=32000,
                source="meta-llama/Llama-2-7b-hf config.json (num_hidden_layers 32, "
                       "num_attention_heads 32, num_key_value_heads 32, "
                       "hidden_size 4096, intermediate_size 11008, "
                       "vocab_size 32000); Touvron et al. 2023, 'Llama 2'"),
    ModelPreset("Llama-2-70B", layers=80, heads=64, kv_heads=8, head_dim=128, max_positions=4096,
                hidden=8192, intermediate=28672, vocab=32000,
                source="meta-llama/Llama-2-70b-hf config.json (num_hidden_layers 80, "
                       "num_attention_heads 64, num_key_value_heads 8, "
                       "hidden_size 8192, intermediate_size 28672, "
                       "vocab_size 32000); Touvron et al. 2023, 'Llama 2'"),
    ModelPreset("Llama-3-8B", layers=32, heads=32, kv_heads=8, head_dim=128, max_positions=8192,
                hidden=4096, intermediate=14336, vocab=128256,
                source="meta-llama/Meta-Llama-3-8B config.json (num_hidden_layers 32, "
                       "num_attention_heads 32, num_key_value_heads 8, "
                       "hidden_size 4096, intermediate_size 14336, "
                       "vocab_size 128256)"),
    ModelPreset("Mistral-7B-v0.1", layers=32, heads=32, kv_heads=8, head_dim=128,
                max_positions=32768, sliding_window=4096, hidden=4096, intermediate=14336,
                vocab=32000,
                source="mistralai/Mistral-7B-v0.1 config.json (num_hidden_layers 32, "
                       "num_attention_heads 32, num_key_value_heads 8, "
                       "hidden_size 4096, intermediate_size 14336, "
                       "vocab_size 32000, sliding_window 4096); "
                       "Jiang et al. 2023, 'Mistral 7B' (rolling buffer cache)"),
    ModelPreset("Falcon-7B", layers=32, heads=71, kv_heads=1, head_dim=64, max_positions=2048,
                source="tiiuae/falcon-7b config.json (n_layer 32, n_head 71, hidden_size 4544, "
                       "multi_query true)"),
    ModelPreset("Llama-3-70B", layers=80, heads=64, kv_heads=8, head_dim=128,
                max_positions=8192, hidden=8192, intermediate=28672, vocab=128256,
                source="https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json"),
    ModelPreset("Llama-3.1-8B", layers=32, heads=32, kv_heads=8, head_dim=128,
                max_positions=131072, hidden=4096, intermediate=14336, vocab=128256,
                source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    ModelPreset("Llama-3.1-70B", layers=80, heads=64, kv_heads=8, head_dim=128,
                max_positions=131072, hidden=8192, intermediate=28672, vocab=128256,
                source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json"),
    ModelPreset("Llama-3.1-405B", layers=126, heads=128, kv_heads=8, head_dim=128,
                max_positions=131072, hidden=16384, intermediate=53248, vocab=128256,
                source="https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json"),
    ModelPreset("Qwen3-4B", layers=36, heads=32, kv_heads=8, head_dim=128,
                max_positions=40960,
                source="https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json"),
    ModelPreset("Qwen3-8B", layers=36, heads=32, kv_heads=8, head_dim=128,
                max_positions=40960,
                source="https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json"),
    ModelPreset("Qwen3-14B", layers=40, heads=40, kv_heads=8, head_dim=128,
                max_positions=40960,
                source="https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json"),
    ModelPreset("Qwen3-32B", layers=64, heads=64, kv_heads=8, head_dim=128,
                max_positions=40960,
                source="https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json"),
    ModelPreset("Qwen3-30B-A3B", layers=48, heads=32, kv_heads=4, head_dim=128,
                max_positions=40960,
                source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json "
                       "(the experts do not change the cache)"),
    ModelPreset("Mistral-7B-v0.3", layers=32, heads=32, kv_heads=8, head_dim=128,
                max_positions=32768,
                source="https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json "
                       "(sliding_window null: every layer full)"),
    ModelPreset("Mixtral-8x7B-v0.1", layers=32, heads=32, kv_heads=8, head_dim=128,
                max_positions=32768,
                source="https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json "
                       "(sliding_window null; the experts do not change the cache)"),
)}


def preset(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive).

    Raises:
        ValueError: no such preset; the message lists the known names.

    >>> preset("llama-3-8b").attention
    'GQA'
    """
    return _lookup(PRESETS, name, "model")


# --- published hybrid configurations: window and global layers ------------------------------

@dataclass(frozen=True)
class HybridPreset:
    """The cache-deciding sizes of a published model whose layers alternate sliding-window and
    global attention: every ``sliding_window_pattern``-th layer is global, the rest keep the last
    ``sliding_window`` positions (:func:`kvdoc.core.gemma.gemma_layer_types`).

    Attributes:
        name: short name (case-insensitive in :func:`hybrid_preset`).
        layers, heads, kv_heads, head_dim, hidden: ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``.
        sliding_window: ``W``.
        sliding_window_pattern: Gemma 3: 6 (five window layers, then a global one); Gemma 2: 2.
        max_positions: ``max_position_embeddings``.
        source: the ``config.json`` the numbers come from.
    """

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    sliding_window: int
    sliding_window_pattern: int
    max_positions: int
    source: str

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer ``W`` (a window layer) or None (a global one)."""
        from kvdoc.core.gemma import gemma_layer_types

        types = gemma_layer_types(self.layers, self.sliding_window_pattern)
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    def config(self) -> Gemma3Config:
        """A :class:`~kvdoc.core.gemma.Gemma3Config` of these sizes (the rest at its defaults:
        they do not change the cache)."""
        from kvdoc.core.gemma import Gemma3Config

        return Gemma3Config(n_head=self.heads, n_kv_head=self.kv_heads, n_embd=self.hidden,
                            head_dim=self.head_dim, n_layer=self.layers,
                            n_positions=self.max_positions, sliding_window=self.sliding_window,
                            sliding_window_pattern=self.sliding_window_pattern)


#: Published Gemma 2 and Gemma 3 text configurations, keyed by lower-case name. Gemma 2's
#: config.json has no pattern field: transformers' Gemma2 alternates window and global layers.
HYBRID_PRESETS: dict[str, HybridPreset] = {p.name.lower(): p for p in (
    HybridPreset("Gemma-2-2B", layers=26, heads=8, kv_heads=4, head_dim=256, hidden=2304,
                 sliding_window=4096, sliding_window_pattern=2, max_positions=8192,
                 source="https://huggingface.co/google/gemma-2-2b/blob/main/config.json"),
    HybridPreset("Gemma-2-9B", layers=42, heads=16, kv_heads=8, head_dim=256, hidden=3584,
                 sliding_window=4096, sliding_window_pattern=2, max_positions=8192,
                 source="https://huggingface.co/google/gemma-2-9b/blob/main/config.json"),
    HybridPreset("Gemma-2-27B", layers=46, heads=32, kv_heads=16, head_dim=128, hidden=4608,
                 sliding_window=4096, sliding_window_pattern=2, max_positions=8192,
                 source="https://huggingface.co/google/gemma-2-27b/blob/main/config.json"),
    HybridPreset("Gemma-3-1B", layers=26, heads=4, kv_heads=1, head_dim=256, hidden=1152,
                 sliding_window=512, sliding_window_pattern=6, max_positions=32768,
                 source="https://huggingface.co/google/gemma-3-1b-pt/blob/main/config.json"),
    HybridPreset("Gemma-3-4B", layers=34, heads=8, kv_heads=4, head_dim=256, hidden=2560,
                 sliding_window=1024, sliding_window_pattern=6, max_positions=131072,
                 source="https://huggingface.co/google/gemma-3-4b-pt/blob/main/config.json "
                        "(text_config)"),
    HybridPreset("Gemma-3-12B", layers=48, heads=16, kv_heads=8, head_dim=256, hidden=3840,
                 sliding_window=1024, sliding_window_pattern=6, max_positions=131072,
                 source="https://huggingface.co/google/gemma-3-12b-pt/blob/main/config.json "
                        "(text_config)"),
    HybridPreset("Gemma-3-27B", layers=62, heads=32, kv_heads=16, head_dim=128, hidden=5376,
                 sliding_window=1024, sliding_window_pattern=6, max_positions=131072,
                 source="https://huggingface.co/google/gemma-3-27b-pt/blob/main/config.json "
                        "(text_config)"),
)}


def hybrid_preset(name: str) -> HybridPreset:
    """The :data:`HYBRID_PRESETS` entry called ``name`` (case-insensitive).

    Raises:
        ValueError: no such preset; the message lists the known names.
    """
    return _lookup(HYBRID_PRESETS, name, "hybrid model")


class HybridBytes(NamedTuple):
    """What :func:`hybrid_vs_global` returns."""

    hybrid: int
    """K/V bytes with the window layers holding ``min(T, W)`` positions."""
    all_global: int
    """K/V bytes were every layer global (holding all ``T``)."""


def hybrid_vs_global(model: str | HybridPreset, seq_len: int, batch: int = 1,
                     dtype: str | torch.dtype = "bfloat16") -> HybridBytes:
    """K/V bytes of a published hybrid model at ``seq_len``, and of the same model with every
    layer global (:func:`~kvdoc.measure.kv_bytes.kv_bytes_per_layer` over its per-layer windows,
    or none).

    >>> small = hybrid_vs_global("Gemma-3-1B", seq_len=512)   # within the window: no saving
    >>> small.hybrid == small.all_global
    True
    >>> big = hybrid_vs_global("Gemma-3-1B", seq_len=32768)
    >>> big.all_global // big.hybrid                           # 4 global layers of 26 hold T
    5
    """
    p = hybrid_preset(model) if isinstance(model, str) else model
    per_layer = kv_bytes_per_layer(batch, seq_len, p.kv_heads, p.head_dim, dtype,
                                   p.layer_windows)
    everything = kv_bytes(batch, p.layers, seq_len, p.kv_heads, p.head_dim, dtype)
    return HybridBytes(sum(per_layer), everything)
