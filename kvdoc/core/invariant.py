"""Batch-invariant mode: every reduction in the decoder in an order fixed by positions and sizes.

Floating-point addition is not associative, and libraries choose a reduction's order from the
call's shapes (rows, keys, threads, vector lanes), so a sequence's logits change in the last bits
when it is prefilled in other chunks, batched with other rows or read from another cache. Inside
``with batch_invariant():`` every value is computed from the same operations on the same
operands in the same order, whatever the call (:doc:`/part5/5-precision` shows it and its cost):

* **Row-wise work** (every ``F.linear``, ``F.layer_norm`` and ``F.rms_norm``) runs on each row
  alone (:func:`per_row`): one library call of shape ``[1, d]`` on a fresh copy, whose kernel and
  order are then those of that one shape (a call with the same shapes, strides, alignment and
  thread count gives the same bits, as cuBLAS documents). Element-wise work is left alone.
* **Attention** (:func:`attention`, for ``F.scaled_dot_product_attention``) uses only IEEE
  operations applied element by element, each exactly rounded, so a key a query may not read
  adds an exact zero: a longer chunk, left padding or a window cache's dropped keys leave every
  bit as it was (split-K attention, :mod:`kvdoc.serving.splitk`, under the mode is this same
  computation).

The mode is a :class:`torch.overrides.TorchFunctionMode` that reroutes those calls, so the
decoder's code reads the same in and out of it; code that reduces by hand reads :func:`active`:
MLA's absorbed products are one ``F.linear`` per head (:func:`kvdoc.core.mla.per_head`), Gemma's
RMSNorm takes :func:`inv_rms` and its soft cap runs :func:`per_row` (``tanh`` and ``rsqrt`` are
not exactly rounded, and a CPU kernel's vector body and scalar tail differ), gpt-oss's sinks
enter :func:`attention` first in every denominator and its experts run :func:`per_row`, and
split-K attention and the fast decode step read it too.

>>> import torch
>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).to(torch.bfloat16).eval()
>>> ids = torch.randint(0, 97, (1, 12))
>>> with torch.no_grad(), batch_invariant():
...     full = model(ids).logits
...     _, cache = model(ids[:, :5], model.new_cache(1))
...     rest = model(ids[:, 5:], cache).logits
>>> torch.equal(rest, full[:, 5:]), active()
(True, False)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

_ACTIVE = False
"""Whether the decoder runs batch-invariant (set only through :func:`batch_invariant`)."""


class _Reroute(torch.overrides.TorchFunctionMode):
    """Under the mode, the library calls that reduce take this module's path: a linear layer or
    a norm on each row alone (:func:`per_row`), attention by :func:`attention`. The decoder's
    code stays as it reads; only these calls change."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ROWWISE:
            x, *rest = args
            return per_row(lambda rows: func(rows, *rest, **kwargs), x)
        if func is F.scaled_dot_product_attention:
            return _sdpa(*args, **kwargs)
        return func(*args, **kwargs)


_ROWWISE = {F.linear, F.layer_norm, F.rms_norm}


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention``'s signature on :func:`attention`: a boolean mask ``[C, T]``
    or ``[B, 1, C, T]``, ``scale`` and ``enable_gqa`` as SDPA reads them; dropout, ``is_causal``
    and a float mask are refused (a float mask adds values the fixed order would have to take)."""
    if dropout_p or is_causal or (attn_mask is not None and attn_mask.dtype != torch.bool):
        raise ValueError("batch_invariant() takes scaled_dot_product_attention with a boolean "
                         "attn_mask only (no dropout, is_causal or float mask)")
    H, H_kv = q.shape[1], k.shape[1]
    if H != H_kv and not (enable_gqa and H % H_kv == 0):
        raise ValueError(f"{H} query heads and {H_kv} K/V heads: SDPA takes that only with "
                         "enable_gqa=True and a multiple")
    if attn_mask is not None and attn_mask.dim() == 4:  # [B, 1, C, T]: the same for every head
        if attn_mask.shape[1] != 1:
            raise ValueError("batch_invariant() takes one attn_mask for every head")
        attn_mask = attn_mask[:, 0]
    # enable_gqa repeats each K/V head over its group of query heads; attention() reads each
    # K/V head's group of queries against it, which is that copy without making it (the same
    # operands in the same order: the same bits)
    return attention(q, k, v, attn_mask, scale)


@contextmanager
def batch_invariant() -> Iterator[None]:
    """Run the decoder batch-invariant inside the ``with`` block (nests; restores on exit).

    >>> with batch_invariant():
    ...     active()
    True
    >>> active()
    False
    """
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, True
    try:
        with _Reroute():
            yield
    finally:
        _ACTIVE = before


def active() -> bool:
    """Whether :func:`batch_invariant` is in force."""
    return _ACTIVE


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` on each row ``[1, d]`` of ``x`` (``[..., d]``) alone, a fresh copy each, the rows
    stacked back: the same kernel and order however many rows ``x`` holds.

    >>> lin = torch.nn.Linear(4, 3)
    >>> x = torch.randn(2, 5, 4)
    >>> per_row(lin, x).shape, torch.allclose(per_row(lin, x), lin(x), atol=1e-6)
    (torch.Size([2, 5, 3]), True)
    """
    rows = x.reshape(-1, 1, x.shape[-1])
    out = torch.cat([fn(rows[i].clone()) for i in range(rows.shape[0])])
    return out.reshape(*x.shape[:-1], out.shape[-1])


_LN2_HI = 6.93147180369123816490e-01  # ln 2 in 32 bits: k * _LN2_HI is exact for |k| < 2**21
_LN2_LO = 1.90821492927058770002e-10  # ln 2 - _LN2_HI
_TAYLOR = [1.0 / math.factorial(n) for n in range(14)]  # exp(r) for |r| <= ln(2) / 2


def exp_fixed(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in float64 from additions, multiplications and bit shifts only.

    ``x = k ln 2 + r`` with ``|r| <= ln(2) / 2``; ``exp(r)`` is its Taylor polynomial of degree
    13 (truncation below ``2e-16`` relative), and ``2**k`` is written into the exponent bits.
    Every step is one exactly rounded IEEE operation, so the result is the same bits on every
    device, lane and thread, which a library's ``exp`` (vector code for most elements, scalar
    code for a tensor's tail) does not promise. Below ``-700`` it returns 0 (``-inf`` too).

    >>> x = torch.tensor([-float("inf"), -30.0, -1.0, 0.0, 2.5], dtype=torch.float64)
    >>> exp_fixed(x)[0].item(), torch.allclose(exp_fixed(x), x.exp(), rtol=1e-15, atol=0)
    (0.0, True)
    """
    x = x.to(torch.float64)
    low = x < -700.0
    x = x.clamp(min=-700.0, max=700.0)
    k = torch.round(x * (1.0 / math.log(2.0)))
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, _TAYLOR[-1])
    for c in reversed(_TAYLOR[:-1]):  # Horner: one multiplication and one addition per term
        p = p * r + c
    two_k = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    return torch.where(low, 0.0, p * two_k)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension as a pairwise tree fixed by its length alone.

    >>> tree_sum(torch.tensor([[1., 2., 3., 4., 5.]]))
    tensor([15.])
    """
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:  # an odd element pairs with an exact zero
            x = torch.cat((x, torch.zeros_like(x[..., :1])), dim=-1)
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension (kept, size 1), in ``x``'s dtype: for
    a norm that reduces by hand (Gemma's RMSNorm), which no library call the mode reroutes.

    The squares and their pairwise tree (:func:`tree_sum`) run in float32 (float64 for
    float64), then one ``sqrt`` and one division: every step exactly rounded, as ``rsqrt`` is not.

    >>> x = torch.tensor([[3., -3.], [1., 7.]])
    >>> torch.allclose(inv_rms(x, 1e-6), torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    True
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    xa = x.to(acc)
    mean = tree_sum(xa * xa) / x.shape[-1]
    return (mean + eps).sqrt().reciprocal().unsqueeze(-1).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, scale: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scale q k^T + mask) v`` with every sum in an order fixed per query and key.

    ``q`` is ``[B, H, C, D_h]``, ``k`` ``[B, H_kv, T, D_h]``, ``v`` ``[B, H_kv, T, D_v]`` (query
    head ``h`` reads K/V head ``h // (H / H_kv)``, as SDPA's ``enable_gqa``), ``mask`` ``[C, T]``
    or ``[B, C, T]`` bool (True: may read) or None; ``scale`` defaults to ``1 / sqrt(D_h)``, as
    SDPA's. Products and sums run in float32 (float64 for a float64 model); the result is
    ``[B, H, C, D_v]`` in ``q``'s dtype. A query row that reads no key gives 0. ``sinks``
    (``[H]``, gpt-oss's): a logit per query head in every denominator with no value, as
    :func:`kvdoc.core.gptoss.sink_attention`; it joins the maximum and starts each sum.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g),
    ...            torch.randn(1, 2, 7, 8, generator=g))
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    >>> torch.allclose(attention(q, k, v, None), ref, atol=1e-6)
    True
    """
    B, H, C, D = q.shape
    H_kv, T, D_v = k.shape[1], k.shape[2], v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).reshape(B, H_kv, H // H_kv, C, 1, D)  # a K/V head's query heads together
    kg, vg = k.to(acc)[:, :, None, None], v.to(acc)[:, :, None]  # [B, H_kv, 1, (1,) T, D]
    # the scale multiplies each finished score, as SDPA's definition reads (q k^T, then times
    # scale): one more rounding, fixed by that score alone. Scaling q first would be as
    # invariant (element-wise too) but gives other bits: it rounds each of the D_h products'
    # operands instead, and would change the bits of every model that passes no scale. SDPA's
    # own kernels are not matched bit for bit either way (its math path scales q and k by
    # sqrt(scale) each); what the mode keeps is the function and one order for every call
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = tree_sum(qg * kg) * scale  # [B, H_kv, group, C, T]
    if mask is not None:  # [C, T], or [B, C, T] per row: the same for every head
        rows = mask if mask.dim() == 2 else mask[:, None, None]
        scores = scores.masked_fill(~rows, -math.inf)
    top = scores.amax(dim=-1, keepdim=True)  # exact whatever the order
    total = torch.zeros(B, H_kv, H // H_kv, C, 1, dtype=acc, device=q.device)
    if sinks is not None:  # [H] -> each K/V head's group of query heads
        sink = sinks.to(acc).view(1, H_kv, H // H_kv, 1, 1)
        top = torch.maximum(top, sink)
        total = total + exp_fixed(sink - top).to(acc)  # first in every sum: one fixed order
    p = exp_fixed(scores - torch.where(top.isinf(), 0.0, top)).to(acc)
    out = torch.zeros(B, H_kv, H // H_kv, C, D_v, dtype=acc, device=q.device)
    for j in range(T):  # key by key from the first column: a hidden key adds an exact 0
        w = p[..., j:j + 1]
        out = out + w * vg[:, :, :, j:j + 1]
        total = total + w
    out = torch.where(total > 0, out / total, 0.0)
    return out.reshape(B, H, C, D_v).to(q.dtype)
