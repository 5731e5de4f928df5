"""Bytes of the quantised caches from a model's sizes alone: the int8 cache's and the FP8 cache's
closed forms, beside :func:`kvdoc.measure.kv_bytes.kv_bytes` for the exact ones.

* int8 (:mod:`kvdoc.serving.quant`): one byte a value and one scale a row (of ``D`` values),
  in the model's dtype: ``2 x B x L x T x H_kv x (D + s)``.
* FP8 (:mod:`kvdoc.serving.fp8`): one byte a value, and FP32 scales for K and V of each layer,
  one each (per tensor) or ``H_kv`` each (per head), shared by the batch:
  ``2 x B x L x T x H_kv x D + 2 x L x S x 4`` with ``S = 1`` or ``H_kv``.

The verification holds every cache layer to its own formula (:mod:`kvdoc.measure.layer_bytes`);
these are the same counts summed over a model, for pages and tables (tests/test_fp8_cache.py
compares them with real caches). Like :mod:`kvdoc.measure.memory` this module does not import
torch.

>>> int8_kv_bytes(1, 32, 8192, 8, 128, scale_bytes=2)     # Llama-3-8B, BF16 scales
545259520
>>> fp8_kv_bytes(1, 32, 8192, 8, 128, "per-head") - fp8_kv_bytes(1, 32, 8192, 8, 128)
1792
"""

from __future__ import annotations

from kvdoc.core.config import check_int

SCALE_BYTES = 4
"""Bytes of one FP8 scale (FP32)."""


def _sizes(batch: int, layers: int, seq_len: int, kv_heads: int, head_dim: int) -> None:
    for name, value in (("batch", batch), ("layers", layers), ("kv_heads", kv_heads),
                        ("head_dim", head_dim)):
        check_int(name, value)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative integer, got {seq_len!r}")


def int8_kv_bytes(batch: int, layers: int, seq_len: int, kv_heads: int, head_dim: int,
                  scale_bytes: int = 4) -> int:
    """``2 x B x L x T x H_kv x (D + scale_bytes)``: int8 values and one scale a row.

    Raises:
        ValueError: a size that is not a positive integer (``seq_len`` may be 0).
    """
    _sizes(batch, layers, seq_len, kv_heads, head_dim)
    return 2 * batch * layers * seq_len * kv_heads * (head_dim + scale_bytes)


def fp8_kv_bytes(batch: int, layers: int, seq_len: int, kv_heads: int, head_dim: int,
                 granularity: str = "per-tensor") -> int:
    """``2 x B x L x T x H_kv x D + 2 x L x S x 4``: FP8 values, and K's and V's FP32 scales
    (``S = 1`` per tensor, ``H_kv`` per head).

    Raises:
        ValueError: a size that is not a positive integer (``seq_len`` may be 0), or a
            granularity other than ``"per-tensor"`` and ``"per-head"``.
    """
    _sizes(batch, layers, seq_len, kv_heads, head_dim)
    if granularity not in ("per-tensor", "per-head"):
        raise ValueError(f"granularity must be 'per-tensor' or 'per-head', got {granularity!r}")
    scales = kv_heads if granularity == "per-head" else 1
    return 2 * batch * layers * seq_len * kv_heads * head_dim + 2 * layers * scales * SCALE_BYTES
