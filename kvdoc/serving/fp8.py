"""An FP8 K/V cache: e4m3 values under per-tensor or per-head scales, as serving engines store it.

``x`` is stored as ``q = e4m3(clamp(x / s, -448, 448))`` (``[B, H_kv, T, D_h]``) and read back
as ``q * s``, under FP32 scales ``s`` shared by the batch, one a tensor (``"per-tensor"``) or a
K/V head (``"per-head"``): calibrated (:func:`calibrate`) or taken from the first prefill, then
fixed, so a later value beyond ``448 s`` saturates, as engines clamp. The cache is **not** the
exact function: :func:`element_error_bound` and :func:`read_error_bound` argue its error, and
:mod:`kvdoc.proofs.contracts` checks both.

>>> from kvdoc.core.model import Decoder
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> _, cache = model(torch.tensor([[5, 6, 7, 8]]), new_fp8_cache(model, 1))
>>> k, v = cache.layer(0)
>>> k.dtype, tuple(k.shape), tuple(cache.layers[0].scales[0].shape)
(torch.float32, (1, 4, 4, 16), (1, 4, 1, 1))
>>> # layers x (K, V x H_kv x T x D_h x 1 byte + K, V x H_kv scales x 4 bytes)
>>> cache.nbytes() == 2 * (2 * 4 * 4 * 16 * 1 + 2 * 4 * 4)
True
"""

from __future__ import annotations

import torch

from kvdoc.core.cache import KV, CacheLayer, DynamicCache, KVCache, check_int
from kvdoc.core.model import GPTConfig

GRANULARITIES = ("per-tensor", "per-head")
"""How many scales K (and V) of one layer has: one, or one per K/V head."""
FP8_DTYPES = {name: getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2")
              if hasattr(torch, name)}
"""The FP8 storage dtypes the installed torch can store, by name."""
SCALE_DTYPE = torch.float32
"""Scales are FP32 whatever the model's dtype, as engines keep them."""


def fp8_dtype(storage: str | torch.dtype) -> torch.dtype:
    """The torch FP8 dtype for ``storage`` (a name or a dtype), one of :data:`FP8_DTYPES`.

    >>> fp8_dtype("float8_e4m3fn")
    torch.float8_e4m3fn
    >>> fp8_dtype("float4_e2m1")
    Traceback (most recent call last):
    ...
    ValueError: cannot store an FP8 cache as 'float4_e2m1': use one of float8_e4m3fn, float8_e5m2
    """
    found = FP8_DTYPES.get(storage) if isinstance(storage, str) else storage
    if found not in FP8_DTYPES.values():
        raise ValueError(f"cannot store an FP8 cache as {storage!r}: use one of "
                         f"{', '.join(FP8_DTYPES)}")
    return found


def scale_shape(granularity: str, heads: int) -> tuple[int, int, int, int]:
    """The shape of one tensor's scales: ``[1, 1, 1, 1]`` or ``[1, H_kv, 1, 1]``."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, "
                         f"got {granularity!r}")
    return (1, heads if granularity == "per-head" else 1, 1, 1)


def check_scale(scale: torch.Tensor, shape: tuple[int, ...], what: str = "scale") -> None:
    """A ValueError unless ``scale`` is a floating tensor of ``shape``, positive and finite."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise ValueError(f"{what} must be a floating-point tensor, got {scale!r}")
    if tuple(scale.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)}, got {tuple(scale.shape)}")
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{what} must be positive and finite, got {scale.flatten().tolist()}")


def amax_scale(x: torch.Tensor, granularity: str,
               fp8: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``max|x| / fmax`` over all of ``x`` ``[B, H, T, D]`` or per head (a part of zeros: 1; a
    value that is not finite is refused).

    >>> x = torch.tensor([[[[1.0, -896.0]], [[0.0, 0.0]]]])      # [1, 2, 1, 2]
    >>> amax_scale(x, "per-head").flatten().tolist(), amax_scale(x, "per-tensor").item()
    ([2.0, 1.0], 2.0)
    """
    shape = scale_shape(granularity, x.shape[1])
    if not bool(torch.isfinite(x).all()):
        raise ValueError("the rows a scale is taken from hold a value that is not finite")
    dims = (0, 2, 3) if shape[1] > 1 else (0, 1, 2, 3)
    amax = x.detach().abs().to(SCALE_DTYPE).amax(dim=dims, keepdim=True).reshape(shape)
    return torch.where(amax > 0, amax / torch.finfo(fp8).max, torch.ones_like(amax))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, SCALE_DTYPE)  # FP32, or FP64 for an FP64 model


def quantize(x: torch.Tensor, scale: torch.Tensor,
             fp8: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``e4m3(clamp(x / scale, -fmax, fmax))``: beyond the scale's range a value saturates.

    >>> quantize(torch.tensor([1.0, 3.3, 1000.0]), torch.tensor(1.0)).float().tolist()
    [1.0, 3.25, 448.0]
    """
    fmax = torch.finfo(fp8).max
    return (x.detach().to(_wide(x.dtype)) / scale).clamp(-fmax, fmax).to(fp8)  # data, no graph


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale``, computed in FP32 (or wider) and returned in ``dtype``."""
    wide = _wide(dtype)
    return (q.to(wide) * scale.to(wide)).to(dtype)


def element_error_bound(x: torch.Tensor, scale: torch.Tensor,
                        fp8: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """How far ``dequantize(quantize(x, scale))`` can be from ``x``, element-wise (in FP64).

    With ``y = |x| / s``: rounding to e4m3's 3 mantissa bits moves ``y`` by at most ``2^-4 y``
    (``eps / 2``; ``2^-3`` for e5m2); below the smallest normal value by at most ``2^-10`` (half
    the subnormal spacing); beyond ``fmax`` (448) it saturates, off by ``y - fmax``. Times
    ``s``, plus ``eps`` of the model's dtype relative to ``|x|`` for its own rounding, and the
    model dtype's subnormal spacing (FP16's ``2^-24``), where ``q s`` falls below its normals.

    >>> x = torch.tensor([3.3, 1000.0, 0.0])
    >>> bound = element_error_bound(x, torch.tensor(1.0))   # stored: 3.25, 448 and 0
    >>> round(bound[0].item() / 3.3, 4), round(bound[1].item()), bound[2].item() == 2 ** -10
    (0.0625, 552, True)
    """
    info = torch.finfo(fp8)
    y = x.abs().to(torch.float64) / scale.to(torch.float64)
    rel = info.eps / 2 + torch.finfo(x.dtype).eps
    inside = torch.maximum(rel * y, torch.full_like(y, info.smallest_normal * info.eps / 2))
    beyond = y - info.max + torch.finfo(x.dtype).eps * y
    model = torch.finfo(x.dtype)
    return (torch.where(y > info.max, beyond, inside) * scale.to(torch.float64)
            + model.smallest_normal * model.eps)


def read_error_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_scale: torch.Tensor, v_scale: torch.Tensor,
                     fp8: torch.dtype = torch.float8_e4m3fn,
                     softmax_scale: float | None = None) -> torch.Tensor:
    """How far one attention read over FP8 K and V can be from the read over exact ``k``, ``v``.

    Each key element is off by at most its :func:`element_error_bound` ``d_jc``, so the score of
    key ``j`` moves by at most ``e_j = softmax_scale sum_c |q_c| d_jc``. With ``e`` the largest
    ``e_j`` every softmax weight moves by a factor within ``exp(+-2e)``, so the weights move by
    at most ``min(exp(2e) - 1, 2)`` in total (L1), and the output per channel by at most that
    times half the channel's range over the keys (the change sums to zero), plus the channel's
    largest value error. Taken over every key and every K/V head, it holds for any mask and any
    grouping of heads. ``q`` ``[B, H, C, D_h]``, exact ``k``, ``v`` ``[B, H_kv, T, D_h]`` under
    ``k_scale``, ``v_scale``; returns ``[B, H, C, D_h]`` in FP64.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(3))
    >>> sk, sv = amax_scale(k, "per-head"), amax_scale(v, "per-head")
    >>> exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> approx = torch.nn.functional.scaled_dot_product_attention(
    ...     q, dequantize(quantize(k, sk), sk, k.dtype), dequantize(quantize(v, sv), sv, v.dtype))
    >>> bool(((approx - exact).abs() <= read_error_bound(q, k, v, sk, sv)).all())
    True
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    # the worst K/V head for every key and channel: [B, 1, T, D_h]
    dk = element_error_bound(k, k_scale, fp8).amax(dim=1, keepdim=True)
    dv = element_error_bound(v, v_scale, fp8).amax(dim=(1, 2))[:, None, None]  # [B, 1, 1, D_h]
    v = v.to(torch.float64)
    e = (q.abs().to(torch.float64) @ dk.transpose(-1, -2)).amax(dim=-1) * scale  # [B, H, C]
    weights = torch.expm1(2 * e).clamp(max=2)  # the L1 change of the softmax
    half_range = (v.amax(dim=(1, 2)) - v.amin(dim=(1, 2)))[:, None, None] / 2  # [B, 1, 1, D_h]
    return weights[..., None] * half_range + dv


class Fp8Layer(CacheLayer):
    """FP8 K and V ``rows`` under FP32 ``scales`` (unless ``fixed``: the first write's)."""

    def __init__(self, rows: KV, scales: KV, fixed: bool, granularity: str,
                 dtype: torch.dtype) -> None:
        k, v = rows
        super().__init__(k.shape[0], k.shape[1], (k.shape[3], v.shape[3]), dtype, k.device)
        self.rows, self.scales, self.fixed = tuple(rows), tuple(scales), fixed
        self.granularity, self.fp8 = granularity, k.dtype

    @classmethod
    def empty(cls, batch_size: int, heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", granularity: str = "per-head",
              scales: KV | None = None, fp8: torch.dtype = torch.float8_e4m3fn) -> Fp8Layer:
        """A layer of no positions, under ``scales`` or (None) those of its first write."""
        shape = scale_shape(granularity, heads)
        if scales is not None:
            for name, s in zip(("K", "V"), scales, strict=True):
                check_scale(s, shape, f"{name} scale")
            scales = tuple(s.to(SCALE_DTYPE, copy=True).to(device) for s in scales)
        rows = torch.empty((batch_size, heads, 0, head_dim), dtype=fp8, device=device)
        unset = torch.ones(shape, dtype=SCALE_DTYPE, device=device)  # held, and counted, anyway
        return cls((rows, rows), scales or (unset, unset), scales is not None, granularity, dtype)

    def read(self, seq_len: int) -> KV:
        return tuple(dequantize(q, s, self.dtype)
                     for q, s in zip(self.rows, self.scales, strict=True))

    def new_scales(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        """The scales rows ``k``, ``v`` are stored under: the fixed ones, or theirs."""
        if self.fixed:
            return self.scales
        return amax_scale(k, self.granularity, self.fp8), amax_scale(v, self.granularity, self.fp8)

    def quantize_rows(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """New rows ``x`` stored in FP8 under ``scale``."""
        return quantize(x, scale, self.fp8)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        scales = self.new_scales(k, v)  # may refuse: nothing is assigned before
        new = [self.quantize_rows(x, s) for x, s in zip((k, v), scales, strict=True)]
        self.rows = tuple(torch.cat((a, b), dim=2) for a, b in zip(self.rows, new, strict=True))
        self.scales, self.fixed = scales, True
        return self.read(start + k.shape[2])

    def crop(self, length: int, seq_len: int) -> Fp8Layer:
        return Fp8Layer(tuple(t[:, :, :length] for t in self.rows), self.scales, self.fixed,
                        self.granularity, self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.rows, *self.scales]

    def expected_nbytes(self, seq_len: int) -> int:
        # FP8 values (1 byte), and K's and V's FP32 scales: 1 each per tensor, or H_kv per head
        scales = self.heads if self.granularity == "per-head" else 1
        return (self.batch_size * self.heads * seq_len * sum(self.widths)
                + 2 * scales * SCALE_DTYPE.itemsize)


def fp8_cache(config: GPTConfig, batch_size: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", *, granularity: str = "per-head",
              scales: torch.Tensor | None = None,
              fp8: str | torch.dtype = torch.float8_e4m3fn) -> KVCache:
    """An empty cache of :class:`Fp8Layer` s for a model computing in ``dtype`` (16 bits or
    more); ``scales``: calibrated, ``[L, 2]`` or ``[L, 2, H_kv]`` (None: each layer's first rows').

    >>> fp8_cache(GPTConfig(), 1, scales=torch.ones(2, 2))
    Traceback (most recent call last):
    ...
    ValueError: scales must have shape (2, 2, 4), got (2, 2)
    """
    check_int("batch_size", batch_size)
    fp8 = fp8_dtype(fp8)
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(f"an FP8 cache serves a model computing in a float of 16 bits or "
                         f"more, got {dtype}")
    L, H = config.n_layer, config.n_kv_head
    shape = scale_shape(granularity, H)  # refuses an unknown granularity
    if scales is not None:
        check_scale(scales, (L, 2, H) if granularity == "per-head" else (L, 2), "scales")
    return KVCache([Fp8Layer.empty(batch_size, H, config.head_dim, dtype, device, granularity,
                                   None if scales is None else
                                   (scales[i, 0].reshape(shape), scales[i, 1].reshape(shape)),
                                   fp8) for i in range(L)])


def scale_table(cache: KVCache) -> torch.Tensor:
    """Every layer's scales, ``[L, 2]`` or ``[L, 2, H_kv]``: what ``scales=`` takes."""
    table = torch.stack([torch.stack([s.flatten() for s in layer.scales])
                         for layer in cache.layers])
    return table[..., 0] if cache.layers[0].granularity == "per-tensor" else table


def new_fp8_cache(model: torch.nn.Module, batch: int, capacity: int | None = None, *,
                  granularity: str = "per-head", scales: torch.Tensor | None = None,
                  fp8: str | torch.dtype = torch.float8_e4m3fn) -> KVCache:
    """An empty FP8 cache for ``model`` (``capacity`` unused: the cache grows)."""
    weight = model.wte.weight
    return fp8_cache(model.config, batch, weight.dtype, weight.device,
                     granularity=granularity, scales=scales, fp8=fp8)


@torch.no_grad()
def calibrate(model: torch.nn.Module, ids: torch.Tensor, granularity: str = "per-head",
              fp8: str | torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Scales from the exact K/V of ``ids`` (calibration text), what :func:`fp8_cache` takes.

    >>> from kvdoc.proofs.compare import default_model, default_stream
    >>> tuple(calibrate(default_model(), default_stream()).shape)
    (2, 2, 4)
    """
    fp8 = fp8_dtype(fp8)
    cache = model(ids, DynamicCache.empty(model.config, ids.shape[0], model.wte.weight.dtype,
                                          model.wte.weight.device))[1]
    table = torch.stack([torch.stack([amax_scale(t, granularity, fp8).flatten()
                                      for t in cache.layer(i)]) for i in range(cache.n_layer)])
    return table[..., 0] if granularity == "per-tensor" else table
