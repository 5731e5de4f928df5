"""An int8 K/V cache: a quarter of FP32's bytes, and **not** the same function (its error is
measured by :func:`kvdoc.teach.serving_checks.measure_int8`).

Each new row of K and V (one position of one head) is stored once, as ``D_h`` int8 values
``q = round(x / scale)`` (``[B, H_kv, T, D_h]``) and ``scale = max|x| / 127`` in the model's
dtype (``[B, H_kv, T, 1]``), read back as ``q * scale``.

>>> from kvdoc.core.model import Decoder
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> _, cache = model(torch.tensor([[5, 6, 7, 8]]), int8_cache(model.config, 1))
>>> k, v = cache.layer(0)
>>> k.dtype, tuple(k.shape)
(torch.float32, (1, 4, 4, 16))
>>> # K, V x layers x H_kv x T x (D_h int8 + FP32 scale)
>>> cache.nbytes() == 2 * 2 * 4 * 4 * (16 * 1 + 4)
True
"""

from __future__ import annotations

import torch

from kvdoc.core.cache import KV, CacheLayer, DynamicCache, KVCache, check_int
from kvdoc.core.model import Decoder, GPTConfig


def _wide(dtype: torch.dtype) -> torch.dtype:
    """FP32 for BF16 and FP16, whose rounding of ``x / scale`` could pass a step; else the dtype."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension: ``(q, scale)`` with ``x ~ q * scale``, ``q`` the
    nearest step of the scale as stored in ``x``'s dtype; a row of zeros gets scale 1.

    >>> q, s = quantize(torch.tensor([[0.5, -1.0, 0.25]]))
    >>> q.tolist(), round(s.item() * 127, 6)
    ([[64, -127, 32]], 1.0)
    """
    w = x.to(_wide(x.dtype))
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(x.dtype)
    return torch.round(w / scale.to(w.dtype)).clamp(-127, 127).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` (in FP32 at least), returned in the scale's dtype."""
    w = _wide(scale.dtype)
    return (q.to(w) * scale.to(w)).to(scale.dtype)


def read_error_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     half_step: float = 0.5) -> torch.Tensor:
    """How far one attention read over int8 K and V can be from the read over exact ``k``, ``v``.

    The argument of :func:`kvdoc.serving.fp8.read_error_bound`, with every element within
    ``half_step`` (0.5: rounding to the nearest) of its row's step ``s = max|row| / 127``, so a
    score moves by at most ``e_j = |q|_1 half_step s_j / sqrt(D_h)``. Shapes: ``q`` ``[B, H, C,
    D_h]``, ``k``, ``v`` exact ``[B, H_kv, T, D_h]``; returns ``[B, H, C, D_h]``.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(3))
    >>> exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> approx = torch.nn.functional.scaled_dot_product_attention(
    ...     q, dequantize(*quantize(k)), dequantize(*quantize(v)))
    >>> bool(((approx - exact).abs() <= read_error_bound(q, k, v)).all())
    True
    """
    group = q.shape[1] // k.shape[1]
    k_step = (k.abs().amax(dim=-1) / 127).repeat_interleave(group, dim=1)  # [B, H, T]
    v = v.repeat_interleave(group, dim=1)  # [B, H, T, D_h]
    v_step = v.abs().amax(dim=-1) / 127
    e = q.abs().sum(dim=-1) * half_step * k_step.amax(dim=-1, keepdim=True) / q.shape[-1] ** 0.5
    weights = torch.expm1(2 * e).clamp(max=2)  # [B, H, C]: the L1 change of the softmax
    half_range = (v.amax(dim=2) - v.amin(dim=2)) / 2  # [B, H, D_h]
    value_error = half_step * v_step.amax(dim=-1)  # [B, H]
    return weights[..., None] * half_range[:, :, None] + value_error[:, :, None, None]


class Int8Layer(CacheLayer):
    """K and V as int8, ``rows`` ``(qk, k_scale, qv, v_scale)``, grown by concatenation."""

    def __init__(self, rows: tuple[torch.Tensor, ...]) -> None:
        qk, sk, qv, _ = rows
        super().__init__(qk.shape[0], qk.shape[1], (qk.shape[3], qv.shape[3]), sk.dtype,
                         qk.device)
        self.rows = tuple(rows)

    @classmethod
    def empty(cls, batch_size: int, heads: int, head_dim: int,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Int8Layer:
        shape = (batch_size, heads, 0, head_dim)
        q = torch.empty(shape, dtype=torch.int8, device=device)
        s = torch.empty((*shape[:3], 1), dtype=dtype, device=device)
        return cls((q, s, q, s))

    def read(self, seq_len: int) -> KV:
        qk, sk, qv, sv = self.rows
        return dequantize(qk, sk), dequantize(qv, sv)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        new = (*quantize(k), *quantize(v))
        self.rows = tuple(torch.cat((a, b), dim=2) for a, b in zip(self.rows, new, strict=True))
        return self.read(start + k.shape[2])

    def crop(self, length: int, seq_len: int) -> Int8Layer:
        return Int8Layer(tuple(t[:, :, :length] for t in self.rows))

    def tensors(self) -> list[torch.Tensor]:
        return list(self.rows)

    def expected_nbytes(self, seq_len: int) -> int:
        # int8 values, and one scale in the model's dtype per row of K and of V
        scale = torch.empty((), dtype=self.dtype).element_size()
        return self.batch_size * self.heads * seq_len * (sum(self.widths) + 2 * scale)


def int8_cache(config: GPTConfig, batch_size: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> KVCache:
    """An empty cache of :class:`Int8Layer` s for a model computing in ``dtype``."""
    check_int("batch_size", batch_size)
    return KVCache([Int8Layer.empty(batch_size, config.n_kv_head, config.head_dim, dtype, device)
                    for _ in range(config.n_layer)])


def new_int8_cache(model: Decoder, batch: int, capacity: int | None = None) -> KVCache:
    """An empty int8 cache for ``model`` (``capacity`` is unused: the cache grows)."""
    weight = model.wte.weight
    return int8_cache(model.config, batch, weight.dtype, weight.device)


def cache_bytes(config: GPTConfig, batch: int, length: int, seed: int = 0) -> dict[str, int]:
    """Measured bytes of a cache holding ``length`` positions of random K/V: int8, FP16 and FP32.

    >>> b = cache_bytes(GPTConfig(), batch=1, length=8)
    >>> b["FP32"] == 2 * b["FP16"], b["int8 + FP32 scales"] < b["FP16"]
    (True, True)
    """
    g = torch.Generator().manual_seed(seed)
    shape = (batch, config.n_kv_head, length, config.head_dim)
    exact = DynamicCache([(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
                          for _ in range(config.n_layer)])
    int8 = int8_cache(config, batch).begin()
    for i in range(config.n_layer):
        int8.update(i, *exact.layer(i), start=0)
    half = DynamicCache([tuple(t.half() for t in exact.layer(i)) for i in range(config.n_layer)])
    return {"int8 + FP32 scales": int8.nbytes(), "FP16": half.nbytes(), "FP32": exact.nbytes()}
