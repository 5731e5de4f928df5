"""K/V cache memory: the byte formula, published model presets, and measured bytes.

A conventional cache keeps, for every decoder layer, one K and one V tensor of shape
``[B, H_kv, T, D]`` (batch, K/V heads, cached positions, head size). Its payload is therefore

    bytes = 2 x B x L x T x H_kv x D x s

with ``L`` layers and ``s`` bytes per element. This module computes that count
(:func:`kv_bytes`, :func:`kv_bytes_for_config`), measures real caches the same way
(:func:`measured_bytes`), formats byte counts in binary and decimal units side by side
(:func:`format_bytes`) and holds published model configurations (:data:`PRESETS`, and
:data:`HYBRID_PRESETS` for Gemma 2 and 3, whose window and global layers alternate:
:func:`hybrid_vs_global`). What a cache writes per update is measured by
:class:`kvdoc.measure.copymeter.CopyMeter`.

It is also the ``python -m kvdoc memory`` command (:func:`add_arguments`, :func:`main`)::

    python -m kvdoc memory --batch 1 --layers 32 --seq-len 4096 --kv-heads 8 --head-dim 128 \\
        --dtype float16
    python -m kvdoc memory --model Llama-3-8B --seq-len 8192
    python -m kvdoc memory --model Llama-3-8B        # T: the model's context, 8,192

Importing this module does not import torch (the command starts in a fraction of a second);
the functions that take or return a torch dtype or tensor import it when called.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

# torch-free: the command line imports this module, and loading torch takes seconds
from kvdoc.core.config import GPTConfig, check_int

if TYPE_CHECKING:
    import torch

    from kvdoc.core.cache import KVCache
    from kvdoc.core.gemma import Gemma3Config

# --- dtypes ------------------------------------------------------------------------------

#: Names accepted for ``dtype`` arguments and ``--dtype`` (case-insensitive), and the name of
#: the torch dtype each stands for (``torch.<name>``).
DTYPES: dict[str, str] = {
    "float64": "float64", "fp64": "float64", "double": "float64",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "fp8": "float8_e4m3fn",
    "int8": "int8",
}

#: ``s`` of each dtype in :data:`DTYPES`, as torch stores it (tests/test_memory.py compares
#: every entry with torch's own ``element_size``): known without importing torch.
ELEMENT_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
                                 "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


def _is_torch_dtype(dtype: object) -> bool:
    return type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name of a dtype, e.g. ``"float16"`` for ``"fp16"``.

    Raises:
        ValueError: an unknown name.

    >>> dtype_name("FP16"), dtype_name("bf16")
    ('float16', 'bfloat16')
    """
    if _is_torch_dtype(dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name in :data:`DTYPES` (or a torch dtype, returned as is).

    Raises:
        ValueError: an unknown name.

    >>> resolve_dtype("bf16")
    torch.bfloat16
    """
    if _is_torch_dtype(dtype):
        return dtype
    name = dtype_name(dtype)
    import torch

    return getattr(torch, name)


def element_size(dtype: str | torch.dtype) -> int:
    """``s``: bytes per element of ``dtype``, as torch stores it.

    >>> import torch
    >>> element_size("float16"), element_size(torch.float32)
    (2, 4)
    """
    if _is_torch_dtype(dtype):
        return dtype.itemsize
    return ELEMENT_BYTES[dtype_name(dtype)]


# --- the formula ---------------------------------------------------------------------------

def _held(seq_len: int, window: int | None) -> int:
    """Positions a layer holds after ``seq_len`` tokens: all of them, or the last ``window``."""
    return seq_len if window is None else min(seq_len, check_int("window", window))


def kv_bytes_per_layer(batch: int, seq_len: int, kv_heads: int, head_dim: int,
                       dtype: str | torch.dtype, windows: Sequence[int | None]) -> list[int]:
    """Bytes of each layer's K and V together, one entry per layer.

    Layer ``l`` holds ``min(T, windows[l])`` positions (``None``: all ``T``), so a
    sliding-window layer stops growing at its window.

    Args:
        batch: ``B``, sequences of equal length.
        seq_len: ``T``, tokens seen per sequence (0 for an empty cache).
        kv_heads: ``H_kv``, K/V heads per layer (not the query heads).
        head_dim: ``D``, size of one head.
        dtype: element type; ``s = element_size(dtype)``.
        windows: one entry per layer: ``None`` (full attention) or a window ``W``.

    Raises:
        ValueError: a size that is not a positive integer (``seq_len`` may be 0), or no layers.

    >>> kv_bytes_per_layer(1, 10, 2, 4, "float32", [None, 8])  # 2 x 1 x T_l x 2 x 4 x 4
    [640, 512]
    """
    for name, value in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        check_int(name, value)
    # 0 is allowed: an empty cache
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative integer, got {seq_len!r}")
    if not windows:
        raise ValueError("need at least one layer")
    s = element_size(dtype)
    return [2 * batch * _held(seq_len, w) * kv_heads * head_dim * s for w in windows]


def kv_bytes(batch: int, layers: int, seq_len: int, kv_heads: int, head_dim: int,
             dtype: str | torch.dtype, *, window: int | None = None) -> int:
    """``2 x B x L x T x H_kv x D x s``: bytes of a conventional per-layer K/V cache.

    Args:
        batch: ``B``. layers: ``L``. seq_len: ``T`` (positions cached per sequence).
        kv_heads: ``H_kv`` (K/V heads, not query heads). head_dim: ``D``.
        dtype: element type, a name from :data:`DTYPES` or a torch dtype (``s`` bytes).
        window: if given, every layer keeps only the last ``window`` positions
            (``T`` becomes ``min(T, window)``).

    Raises:
        ValueError: a size that is not a positive integer, or an unknown dtype.

    >>> kv_bytes(batch=1, layers=32, seq_len=4096, kv_heads=8, head_dim=128, dtype="float16")
    536870912
    """
    check_int("layers", layers)
    return sum(kv_bytes_per_layer(batch, seq_len, kv_heads, head_dim, dtype, [window] * layers))


def kv_bytes_for_config(config: GPTConfig, batch: int, seq_len: int,
                        dtype: str | torch.dtype = "float32") -> int:
    """:func:`kv_bytes` with ``L``, ``H_kv`` and ``D`` taken from a
    :class:`~kvdoc.core.config.GPTConfig`.

    >>> kv_bytes_for_config(GPTConfig(), batch=1, seq_len=272)  # the toy decoder, float32
    278528
    """
    return kv_bytes(batch, config.n_layer, seq_len, config.n_kv_head, config.head_dim, dtype)


def measured_bytes(cache: KVCache | Iterable[torch.Tensor]) -> int:
    """Bytes of real tensors: ``sum(t.numel() * t.element_size())`` over a cache's tensors.

    >>> from kvdoc.core.cache import StaticCache
    >>> cache = StaticCache(GPTConfig(), batch_size=1, capacity=272)
    >>> measured_bytes(cache) == kv_bytes_for_config(GPTConfig(), 1, 272)
    True
    """
    from kvdoc.core.cache import KVCache

    tensors = cache.tensors() if isinstance(cache, KVCache) else list(cache)
    return sum(t.numel() * t.element_size() for t in tensors)


# --- units -----------------------------------------------------------------------------------

BINARY_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")  # powers of 1024
DECIMAL_UNITS = ("bytes", "kB", "MB", "GB", "TB", "PB")  # powers of 1000


def _scaled(n: int, base: int, units: tuple[str, ...], digits: int) -> str:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a byte count must be a non-negative integer, got {n!r}")
    power = 0
    while power + 1 < len(units) and n >= base ** (power + 1):
        power += 1
    if power == 0:
        return f"{n:,} bytes"
    text = f"{n / base ** power:,.{digits}f}".rstrip("0").rstrip(".")
    return f"{text} {units[power]}"


def binary_size(n: int, digits: int = 3) -> str:
    """``n`` bytes in the largest binary unit (KiB = 1024 bytes, MiB = 1024**2, ...).

    >>> binary_size(536870912), binary_size(278528), binary_size(1536)
    ('512 MiB', '272 KiB', '1.5 KiB')
    """
    return _scaled(n, 1024, BINARY_UNITS, digits)


def decimal_size(n: int, digits: int = 3) -> str:
    """``n`` bytes in the largest decimal unit (kB = 1000 bytes, MB = 1000**2, ...).

    >>> decimal_size(536870912), decimal_size(278528)
    ('536.871 MB', '278.528 kB')
    """
    return _scaled(n, 1000, DECIMAL_UNITS, digits)


def format_bytes(n: int) -> str:
    """Exact bytes, then binary and decimal units side by side.

    >>> format_bytes(536870912)
    '536,870,912 bytes = 512 MiB = 536.871 MB'
    """
    return f"{n:,} bytes = {binary_size(n)} = {decimal_size(n)}"


# --- published model configurations ----------------------------------------------------------

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
)}


def preset(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive).

    Raises:
        ValueError: no such preset; the message lists the known names.

    >>> preset("llama-3-8b").attention
    'GQA'
    """
    try:
        return PRESETS[name.lower()]
    except (KeyError, AttributeError):
        known = ", ".join(p.name for p in PRESETS.values())
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None


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
    try:
        return HYBRID_PRESETS[name.lower()]
    except (KeyError, AttributeError):
        known = ", ".join(p.name for p in HYBRID_PRESETS.values())
        raise ValueError(f"unknown hybrid model {name!r}; known models: {known}") from None


class HybridBytes(NamedTuple):
    """What :func:`hybrid_vs_global` returns."""

    hybrid: int
    """K/V bytes with the window layers holding ``min(T, W)`` positions."""
    all_global: int
    """K/V bytes were every layer global (holding all ``T``)."""


def hybrid_vs_global(model: str | HybridPreset, seq_len: int, batch: int = 1,
                     dtype: str | torch.dtype = "bfloat16") -> HybridBytes:
    """K/V bytes of a published hybrid model at ``seq_len``, and of the same model with every
    layer global (:func:`kv_bytes_per_layer` over its per-layer windows, or none).

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


# --- the command line -------------------------------------------------------------------------

#: The longest ``--seq-len`` (and ``--window``) the command takes: 2**31 - 1 positions. Attention
#: kernels index a sequence's tokens with 32-bit integers (FlashAttention's ``cu_seqlens`` are
#: int32), so no served sequence is longer; the longest published contexts are millions of
#: tokens, hundreds of times shorter. A length past it is a typo, not a what-if.
MAX_SEQ_LEN = 2**31 - 1


def _positive_arg(text: str) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _length_arg(text: str) -> int:
    value = _positive_arg(text)
    if value > MAX_SEQ_LEN:
        raise argparse.ArgumentTypeError(
            f"{value:,} positions is past any sequence an attention kernel indexes "
            f"(at most 2**31 - 1 = {MAX_SEQ_LEN:,}, 32-bit token indices)")
    return value


def _dtype_arg(text: str) -> str:
    try:
        return dtype_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _model_arg(text: str) -> ModelPreset:
    try:
        return preset(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m kvdoc memory``."""
    parser.description = ("K/V cache bytes = 2 x B x L x T x H_kv x D x s, from explicit sizes "
                          "or a published model's config.")
    parser.add_argument("--model", type=_model_arg, metavar="NAME",
                        help="a published config: " + ", ".join(p.name for p in PRESETS.values()))
    parser.add_argument("--batch", type=_positive_arg, default=1, metavar="B",
                        help="sequences (default 1)")
    parser.add_argument("--layers", type=_positive_arg, metavar="L", help="decoder layers")
    parser.add_argument("--seq-len", type=_length_arg, metavar="T",
                        help="cached positions per sequence (default with --model: the model's "
                             "context; a longer one is computed, with a warning)")
    parser.add_argument("--kv-heads", type=_positive_arg, metavar="H",
                        help="K/V heads per layer (not query heads)")
    parser.add_argument("--head-dim", type=_positive_arg, metavar="D", help="size of one head")
    parser.add_argument("--dtype", type=_dtype_arg, default="float16", metavar="NAME",
                        help="element type: float32, float16, bfloat16, float8_e4m3fn, ... "
                             "(default float16)")
    parser.add_argument("--window", type=_length_arg, metavar="W",
                        help="sliding window: each layer keeps only the last W positions "
                             "(default: the model's own window, if it has one)")
    parser.add_argument("--list-models", action="store_true",
                        help="list the published configs and exit")


def _error(message: str) -> int:
    print(f"python -m kvdoc memory: error: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Print the K/V bytes for the sizes in ``args``; 2 (nothing on stdout) on inconsistent
    options."""
    if getattr(args, "list_models", False):
        for p in PRESETS.values():
            window = f", window {p.sliding_window:,}" if p.sliding_window else ""
            print(f"{p.name:16} {p.attention}  L={p.layers} H={p.heads} H_kv={p.kv_heads} "
                  f"D={p.head_dim} context {p.max_positions:,}{window}  [{p.source}]")
        return 0
    sizes = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    model: ModelPreset | None = args.model
    T = args.seq_len
    if model is not None:
        given = [name for name, value in sizes.items() if value is not None]
        if given:
            return _error(f"--model sets the sizes itself; drop {', '.join(given)}")
        layers, kv_heads, head_dim = model.layers, model.kv_heads, model.head_dim
        window = args.window if args.window is not None else model.sliding_window
        if T is None:
            T = model.max_positions
        elif T > model.max_positions:
            # A warning, not a refusal: the cache's sizes do not change when a context is
            # stretched (RoPE scaling, a long-context fine-tune), so the bytes are still the
            # answer to that what-if; but past the release's context it is one.
            print(f"python -m kvdoc memory: warning: --seq-len {T:,} is past {model.name}'s "
                  f"context of {model.max_positions:,} tokens (the bytes below are for a "
                  "model stretched that far)", file=sys.stderr)
    else:
        if T is None:
            return _error("--seq-len is required without --model")
        missing = [name for name, value in sizes.items() if value is None]
        if missing:
            return _error("give --model NAME or all of --layers, --kv-heads, --head-dim "
                          f"(missing {', '.join(missing)})")
        layers, kv_heads, head_dim = args.layers, args.kv_heads, args.head_dim
        window = args.window
    B, s = args.batch, element_size(args.dtype)
    total = kv_bytes(B, layers, T, kv_heads, head_dim, args.dtype)
    lines = []
    if model is not None:
        lines.append(f"model      {model.name} ({model.attention}, {model.heads} query heads; "
                     f"source: {model.source})")
        if args.seq_len is None:
            lines.append(f"length     T = {T:,}, the model's context (give --seq-len for another)")
    lines += [
        f"formula    2 x B x L x T x H_kv x D x s = 2 x {B:,} x {layers:,} x {T:,} "
        f"x {kv_heads:,} x {head_dim:,} x {s} ({dtype_name(args.dtype)})",
        f"bytes      {total:,} bytes",
        f"binary     {binary_size(total)}",
        f"decimal    {decimal_size(total)}",
        f"per token  {format_bytes(total // (B * T))} (per sequence)",
    ]
    if window is not None:
        held = min(T, window)
        windowed = kv_bytes(B, layers, T, kv_heads, head_dim, args.dtype, window=window)
        lines += [f"window     each layer keeps the last {window:,} positions: "
                  f"holds min(T, W) = {held:,}",
                  f"windowed   {format_bytes(windowed)}"]
    print("\n".join(lines))
    return 0
