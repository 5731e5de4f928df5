"""Bytes, without importing torch: element sizes by dtype name, ``bytes = 2 x B x L x T x H_kv
x D x s`` (:func:`kv_bytes`; :func:`measured_bytes` counts real tensors), the int8 and FP8
caches' closed forms (tests/test_fp8_cache.py compares them with real caches), and byte counts
in binary and decimal units.

>>> int8_kv_bytes(1, 32, 8192, 8, 128, scale_bytes=2)     # Llama-3-8B, BF16 scales
545259520
>>> fp8_kv_bytes(1, 32, 8192, 8, 128, "per-head") - fp8_kv_bytes(1, 32, 8192, 8, 128)
1792
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

# torch-free: the command line imports this module, and loading torch takes seconds
if TYPE_CHECKING:
    import torch

    from kvdoc.core.cache import KVCache
    from kvdoc.core.model import GPTConfig


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value``, if it is an integer (not a bool) of at least ``minimum``; else a ValueError
    (:func:`kvdoc.core.cache.check_int` without torch).

    >>> check_int("layers", 0)
    Traceback (most recent call last):
    ...
    ValueError: layers must be a positive integer, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


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
    """The canonical name of a dtype, e.g. ``"float16"`` for ``"fp16"`` (a ValueError if unknown).

    >>> dtype_name("FP16"), dtype_name("bf16")
    ('float16', 'bfloat16')
    """
    if _is_torch_dtype(dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def element_size(dtype: str | torch.dtype) -> int:
    """``s``: bytes per element of ``dtype``, as torch stores it.

    >>> import torch
    >>> element_size("float16"), element_size(torch.float32)
    (2, 4)
    """
    if _is_torch_dtype(dtype):
        return dtype.itemsize
    return ELEMENT_BYTES[dtype_name(dtype)]


def kv_bytes_per_layer(batch: int, seq_len: int, kv_heads: int, head_dim: int,
                       dtype: str | torch.dtype, windows: Sequence[int | None]) -> list[int]:
    """Bytes of each layer's K and V together: layer ``l`` holds ``min(T, windows[l])``
    positions (``None``: all ``T``). ``seq_len`` may be 0 (an empty cache).

    >>> kv_bytes_per_layer(1, 10, 2, 4, "float32", [None, 8])  # 2 x 1 x T_l x 2 x 4 x 4
    [640, 512]
    """
    for name, value in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        check_int(name, value)
    check_int("seq_len", seq_len, minimum=0)
    if not windows:
        raise ValueError("need at least one layer")
    held = [seq_len if w is None else min(seq_len, check_int("window", w)) for w in windows]
    return [2 * batch * kv_heads * t * head_dim * element_size(dtype) for t in held]


def kv_bytes(batch: int, layers: int, seq_len: int, kv_heads: int, head_dim: int,
             dtype: str | torch.dtype, *, window: int | None = None) -> int:
    """``2 x B x L x T x H_kv x D x s``: bytes of a conventional per-layer K/V cache (``dtype``
    a name from :data:`DTYPES` or a torch dtype); with ``window`` every layer keeps only the
    last ``window`` positions.

    >>> kv_bytes(batch=1, layers=32, seq_len=4096, kv_heads=8, head_dim=128, dtype="float16")
    536870912
    """
    check_int("layers", layers)
    return sum(kv_bytes_per_layer(batch, seq_len, kv_heads, head_dim, dtype, [window] * layers))


def kv_bytes_for_config(config: GPTConfig, batch: int, seq_len: int,
                        dtype: str | torch.dtype = "float32") -> int:
    """:func:`kv_bytes` with ``L``, ``H_kv`` and ``D`` taken from a
    :class:`~kvdoc.core.model.GPTConfig`.

    >>> from kvdoc import GPTConfig
    >>> kv_bytes_for_config(GPTConfig(), batch=1, seq_len=272)  # the toy decoder, float32
    278528
    """
    return kv_bytes(batch, config.n_layer, seq_len, config.n_kv_head, config.head_dim, dtype)


def measured_bytes(cache: KVCache | Iterable[torch.Tensor]) -> int:
    """Bytes of real tensors: ``sum(t.numel() * t.element_size())`` over a cache's tensors.

    >>> from kvdoc import GPTConfig, StaticCache
    >>> cache = StaticCache(GPTConfig(), batch_size=1, capacity=272)
    >>> measured_bytes(cache) == kv_bytes_for_config(GPTConfig(), 1, 272)
    True
    """
    from kvdoc.core.cache import KVCache

    tensors = cache.tensors() if isinstance(cache, KVCache) else list(cache)
    return sum(t.numel() * t.element_size() for t in tensors)


FP8_SCALE_GRANULARITIES = ("per-tensor", "per-head")
"""One FP32 scale for K (and V) of an FP8 layer, or one per K/V head (torch-free here)."""


def fp8_scale_bytes(kv_heads: Sequence[int], granularity: str) -> int:
    """Bytes of an FP8 cache's scales: for each layer (its ``H_kv`` in ``kv_heads``), K and V
    each have one scale (``"per-tensor"``) or ``H_kv`` (``"per-head"``), 4 bytes each, shared
    by the batch whatever ``T``.

    >>> fp8_scale_bytes([8] * 32, "per-head")      # Llama-3-8B: 32 x 2 x 8 x 4
    2048
    >>> fp8_scale_bytes([8] * 32, "per-tensor")    # 32 x 2 x 1 x 4
    256
    """
    if granularity not in FP8_SCALE_GRANULARITIES:
        raise ValueError(f"FP8 scales are {' or '.join(FP8_SCALE_GRANULARITIES)}, "
                         f"got {granularity!r}")
    if not kv_heads:
        raise ValueError("need at least one layer")
    per_layer = [check_int("kv_heads", h) if granularity == "per-head" else 1 for h in kv_heads]
    return 2 * 4 * sum(per_layer)  # FP32 scales, whatever the model's dtype


def int8_kv_bytes(batch: int, layers: int, seq_len: int, kv_heads: int, head_dim: int,
                  scale_bytes: int = 4) -> int:
    """``2 x B x L x T x H_kv x (D + scale_bytes)``: int8 values and one scale a row."""
    check_int("layers", layers)
    rows = kv_bytes_per_layer(batch, seq_len, kv_heads, 1, "int8", [None])[0]  # 2 x B x T x H
    return layers * rows * (head_dim + check_int("scale_bytes", scale_bytes))


def fp8_kv_bytes(batch: int, layers: int, seq_len: int, kv_heads: int, head_dim: int,
                 granularity: str = "per-tensor") -> int:
    """``2 x B x L x T x H_kv x D + 2 x L x S x 4``: FP8 values, FP32 scales (``S``: 1, H_kv)."""
    return (kv_bytes(batch, layers, seq_len, kv_heads, head_dim, "float8_e4m3fn")
            + fp8_scale_bytes([kv_heads] * layers, granularity))


# --- byte counts for people--------------------------------------------------------------------

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
    return _scaled(n, 1024, ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"), digits)


def decimal_size(n: int, digits: int = 3) -> str:
    """``n`` bytes in the largest decimal unit (kB = 1000 bytes, MB = 1000**2, ...).

    >>> decimal_size(536870912), decimal_size(278528)
    ('536.871 MB', '278.528 kB')
    """
    return _scaled(n, 1000, ("bytes", "kB", "MB", "GB", "TB", "PB"), digits)


def format_bytes(n: int) -> str:
    """Exact bytes, then binary and decimal units side by side.

    >>> format_bytes(536870912)
    '536,870,912 bytes = 512 MiB = 536.871 MB'
    """
    return f"{n:,} bytes = {binary_size(n)} = {decimal_size(n)}"
