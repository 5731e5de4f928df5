"""Prove that the cached path equals full recompute: the equivalence grid and its building blocks.

:func:`verify` runs the equivalence grid: batch 1 and 2, chunks of 1, 2, 5 and 13 tokens (the
last chunk may be short), FP32 and FP64 (the same initial weights converted), a dynamic and a
static cache, over a stream of :data:`kvdoc.proofs.grid.STREAM_LENGTH` tokens (past positions 32 and
64). For each combination it compares, at every consumed position and over the whole
vocabulary, the logits of the chunked cached path with those of one full forward; each layer's
cached K and V (content and shape ``[B, H_kv, T, D_h]``) with the K and V that the full forward
projects; causality (changing the last token leaves every earlier position's logits unchanged,
on both paths); and the cache's lifecycle (a dynamic cache passed into a call is unchanged
afterwards; a static cache's rows below the write position are unchanged). Tolerances are
``atol = rtol = 1e-5`` in FP32 and ``1e-10`` in FP64.

This grid is one part of the verification suite (:mod:`kvdoc.proofs.suite`), which adds GQA and MQA
models, ``last_only``, prefill and decode, generation, crop, branches, failures mid-call and
independent references, on axes that other implementations plug into (:mod:`kvdoc.proofs.grid`).
``python -m kvdoc verify`` runs the suite and every broken variant of :mod:`kvdoc.proofs.broken`, and
exits non-zero with a verdict unless the implementation passes and every variant is caught.
:func:`kvdoc.proofs.crosscheck.cross_check_transformers` compares kvdoc with transformers.

>>> report = verify(batches=(1,), chunks=(2,), dtypes=(torch.float32,), kinds=("dynamic",))
>>> report.passed, len(report.rows)
(True, 1)
>>> verify(variant="positions-restart", batches=(1,), chunks=(2,), dtypes=(torch.float32,),
...        kinds=("dynamic",)).passed
False
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvdoc.core import model as _model  # looked up at call time, so a patched Decoder is the one built
from .broken import stale_prefix
from .variants import VARIANTS, BrokenVariant
from kvdoc.core.cache import KVCache
from kvdoc.core.config import GPTConfig
from .grid import STREAM_LENGTH
from kvdoc.measure.tables import markdown_table
from kvdoc.core.model import Decoder  # for annotations only

TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float64: 1e-10}
"""``atol = rtol`` for each dtype."""

DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "FP32", torch.float64: "FP64"}

CHECKS = ("logits", "kv", "kv_shape", "causality", "lifecycle")
"""The checks of every grid row, in the order they are reported."""


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` as a Python float; ``inf`` if the shapes differ or a value is NaN."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    err = (a - b).abs().max().item()
    return math.inf if math.isnan(err) else float(err)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=tol, rtol=tol))


def chunk_lengths(total: int, chunk: int | Sequence[int]) -> list[int]:
    """Split ``total`` tokens into chunks: every ``chunk`` tokens (the last may be short), or the given lengths.

    >>> chunk_lengths(24, 5)
    [5, 5, 5, 5, 4]
    >>> chunk_lengths(6, [4, 2])
    [4, 2]
    """
    if isinstance(chunk, int):
        if chunk < 1:
            raise ValueError(f"chunk size must be positive, got {chunk}")
        return [min(chunk, total - s) for s in range(0, total, chunk)]
    lengths = [int(c) for c in chunk]
    if any(c < 1 for c in lengths) or sum(lengths) != total:
        raise ValueError(f"chunk lengths {lengths} must be positive and sum to {total}")
    return lengths


@dataclass(frozen=True)
class Snapshot:
    """A copy of what a cache holds: its positions (``cache.held()``) and each layer's K and V."""

    held: range
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def _snapshot(cache: KVCache) -> Snapshot:
    return Snapshot(cache.held(), [tuple(t.clone() for t in cache.layer(i)) for i in range(cache.n_layer)])


def _changed(before: Snapshot, cache: KVCache, rows: int) -> float:
    """Largest change, since ``before``, of the positions below ``rows`` that ``cache`` held then.

    ``inf`` if the cache no longer holds one of them (or a layer's shape disagrees with its
    positions). A window cache holds only its last positions; the others hold ``0 .. T - 1``.
    """
    now = cache.held()
    keep = range(before.held.start, min(before.held.stop, rows))
    if len(keep) and (keep.start < now.start or keep.stop > now.stop):
        return math.inf
    err = 0.0
    for i, pair in enumerate(before.layers):
        for old, cur in zip(pair, cache.layer(i)):
            if cur.shape[2] != len(now):
                return math.inf
            a = old[:, :, keep.start - before.held.start: keep.stop - before.held.start]
            b = cur[:, :, keep.start - now.start: keep.stop - now.start]
            err = max(err, _max_abs(a, b))
    return err


@dataclass(frozen=True)
class CachedRun:
    """What :func:`run_cached` returns.

    Attributes:
        logits: ``[B, T, V]``, the logits of every consumed position, chunk after chunk.
        cache: the cache after the last chunk (``T`` positions).
        lifecycle_error: the largest change, over all calls, of what the cache held before the call
            (the whole dynamic cache passed in; a static cache's rows below the write position).
    """

    logits: torch.Tensor
    cache: KVCache
    lifecycle_error: float


@torch.no_grad()
def run_cached(model: Decoder, ids: torch.Tensor, chunk: int | Sequence[int], kind: str = "dynamic",
               first_chunk_ids: torch.Tensor | None = None, *, cache: KVCache | None = None,
               in_place: bool | None = None) -> CachedRun:
    """Feed ``ids`` (``[B, T]``) through ``model`` chunk by chunk, continuing one cache.

    Args:
        model: the decoder under test.
        ids: token ids ``[B, T]``.
        chunk: chunk size (the last chunk may be short) or the list of chunk lengths.
        kind: ``"dynamic"`` or ``"static"`` (capacity ``T``).
        first_chunk_ids: if given (``[B, T]``), the first chunk is taken from it instead of ``ids``
            (the stale-cache scenario of :mod:`kvdoc.proofs.broken`).
        cache: the empty cache to start from (default ``model.new_cache(B, kind)``); then ``model``
            may be any callable ``(idx, cache) -> (logits, cache)``.
        in_place: whether a call may write into the cache passed in (rows at and after its length
            only); default: ``kind == "static"``. Otherwise the cache passed in must be unchanged.

    Returns:
        A :class:`CachedRun`.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig()).eval()
    >>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
    >>> run = run_cached(model, ids, [4, 2], "static")
    >>> tuple(run.logits.shape), run.cache.seq_len, run.lifecycle_error
    ((1, 6, 97), 6, 0.0)
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, T], got {tuple(ids.shape)}")
    B, T = ids.shape
    if cache is None:
        cache = model.new_cache(B, kind, capacity=T) if kind == "static" else model.new_cache(B, kind)
    in_place = kind == "static" if in_place is None else in_place
    out, lifecycle, start = [], 0.0, 0
    for n, length in enumerate(chunk_lengths(T, chunk)):
        source = first_chunk_ids if (n == 0 and first_chunk_ids is not None) else ids
        before = _snapshot(cache)
        logits, new = model(source[:, start:start + length], cache)
        lifecycle = max(lifecycle, _changed(before, cache, start))  # the object passed in
        if not in_place and cache.seq_len != start:
            lifecycle = math.inf  # a cache not written in place must keep its length
        out.append(logits)
        cache, start = new, start + length
    return CachedRun(torch.cat(out, dim=1), cache, lifecycle)


@torch.no_grad()
def full_forward_kv(model: Decoder, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One full forward (no cache): its logits ``[B, T, V]`` and each layer's K and V ``[B, H_kv, T, D_h]``.

    K and V are read off each layer's ``c_attn`` output (K after RoPE, for rotary models) with
    forward hooks, so they come from the full recompute itself and not from any cache code.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig()).eval()
    >>> logits, kv = full_forward_kv(model, torch.tensor([[1, 2, 3]]))
    >>> tuple(logits.shape), len(kv), tuple(kv[0][0].shape)
    ((1, 3, 97), 2, (1, 4, 3, 16))
    """
    cfg = model.config
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, inputs, output):  # output: [B, T, d + 2 * kv_dim]
        B, T, _ = output.shape
        _, k, v = output.split((cfg.n_embd, cfg.kv_dim, cfg.kv_dim), dim=2)
        shape = (B, T, cfg.n_kv_head, cfg.head_dim)
        captured.append([k.reshape(shape).transpose(1, 2), v.reshape(shape).transpose(1, 2)])

    def rotated(module, inputs, output):  # RoPE's (q, k): the K a cache holds is the rotated one
        captured[-1][0] = output[1]

    handles = [block.attn.c_attn.register_forward_hook(hook) for block in model.h]
    handles += [block.attn.rotary.register_forward_hook(rotated)
                for block in model.h if getattr(block.attn, "rotary", None) is not None]
    try:
        logits = model(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, [(k, v) for k, v in captured]


@dataclass(frozen=True)
class GridRow:
    """One combination of the grid and what was measured.

    Errors are maximum absolute differences (``inf`` for a shape mismatch or NaN).

    Attributes:
        kind, batch, chunk, dtype: the combination (``dtype`` is ``"FP32"`` or ``"FP64"``).
        tol: ``atol = rtol`` used.
        logit_error: cached vs full logits, every position, whole vocabulary.
        kv_error: cached K/V vs the full forward's K/V, every layer.
        kv_shape_ok: every layer's cached K and V have shape ``[B, H_kv, T, D_h]``.
        causal_error: change of positions ``0 .. T - 2`` when token ``T - 1`` changes (both paths).
        lifecycle_error: change of what a cache held before a call, after the call.
        per_position: the logit error of each consumed position (max over batch and vocabulary).
        checks: name -> passed, for ``logits``, ``kv``, ``kv_shape``, ``causality``, ``lifecycle``.
    """

    kind: str
    batch: int
    chunk: int
    dtype: str
    tol: float
    logit_error: float
    kv_error: float
    kv_shape_ok: bool
    causal_error: float
    lifecycle_error: float
    per_position: tuple[float, ...]
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """All checks passed."""
        return all(self.checks.values())

    @property
    def failed(self) -> list[str]:
        """Names of the checks that failed."""
        return [name for name, ok in self.checks.items() if not ok]


@dataclass(frozen=True)
class VerifyReport:
    """The grid's rows for one implementation (the real one, or a broken variant).

    Attributes:
        variant: None for the real implementation, else the broken variant's name.
        rows: one :class:`GridRow` per combination.
    """

    variant: str | None
    rows: list[GridRow]

    @property
    def passed(self) -> bool:
        """Every row passed every check."""
        return all(row.passed for row in self.rows)

    def max_error(self, dtype: str | None = None) -> float:
        """Largest logit error over the rows (of one dtype, ``"FP32"`` or ``"FP64"``, if given)."""
        return max((r.logit_error for r in self.rows if dtype in (None, r.dtype)), default=0.0)

    def failed_checks(self) -> list[str]:
        """Names of the checks that failed in at least one row, in check order."""
        failed = {name for row in self.rows for name in row.failed}
        return [name for name in CHECKS if name in failed]

    def row(self, kind: str, batch: int, chunk: int, dtype: str) -> GridRow:
        """The row of one combination."""
        for r in self.rows:
            if (r.kind, r.batch, r.chunk, r.dtype) == (kind, batch, chunk, dtype):
                return r
        raise KeyError((kind, batch, chunk, dtype))

    def logit_table(self) -> str:
        """One Markdown row per (batch, chunk, dtype): the max logit error of each cache strategy."""
        kinds = list(dict.fromkeys(r.kind for r in self.rows))
        combos = list(dict.fromkeys((r.batch, r.chunk, r.dtype) for r in self.rows))
        head = ["batch", "chunk (tokens)", "dtype", *[f"max logit error, {k}" for k in kinds],
                "tolerance", "all checks"]
        body = []
        for b, c, d in combos:
            rows = [self.row(k, b, c, d) for k in kinds]
            body.append([b, c, d, *[f"{r.logit_error:.2e}" for r in rows], f"{rows[0].tol:.0e}",
                         "pass" if all(r.passed for r in rows) else "FAIL"])
        return markdown_table(head, body)

    def checks_table(self) -> str:
        """One Markdown row per check: what it compares, its largest error over the grid, rows passed."""
        what = {"logits": ("cached vs full logits, every position, whole vocabulary", "logit_error"),
                "kv": ("each layer's cached K and V vs the full forward's", "kv_error"),
                "kv_shape": ("each layer's K and V are [B, H_kv, T, D_h]", None),
                "causality": ("earlier positions' logits after the last token changes", "causal_error"),
                "lifecycle": ("what a cache held before a call, after it (bitwise)", "lifecycle_error")}
        body = []
        for name in CHECKS:
            text, attr = what[name]
            worst = "" if attr is None else f"{max(getattr(r, attr) for r in self.rows):.2e}"
            passed = sum(r.checks[name] for r in self.rows)
            body.append([name, text, worst, f"{passed} of {len(self.rows)}"])
        return markdown_table(["check", "compares", "largest difference", "rows passed"], body)

    def to_markdown(self) -> str:
        """The grid as a Markdown table (errors are max absolute differences of logits or K/V)."""
        head = ["cache", "batch", "chunk (tokens)", "dtype", "tolerance", "max logit error",
                "max K/V error", "causality error", "lifecycle change", "result"]
        body = [[r.kind, r.batch, r.chunk, r.dtype, f"{r.tol:.0e}", f"{r.logit_error:.2e}",
                 f"{r.kv_error:.2e}" if r.kv_shape_ok else "shape", f"{r.causal_error:.2e}",
                 f"{r.lifecycle_error:.2e}", "pass" if r.passed else "FAIL: " + ", ".join(r.failed)]
                for r in self.rows]
        return markdown_table(head, body)


def default_model(seed: int = 0, config: GPTConfig | None = None) -> Decoder:
    """The site's model: ``torch.manual_seed(seed)``, then a :class:`Decoder` (default config), in eval mode."""
    torch.manual_seed(seed)
    return _model.Decoder(config or GPTConfig()).eval()


def default_stream(seed: int = 1, batch: int = 2, length: int = 24, vocab_size: int = 97) -> torch.Tensor:
    """The token stream the grid consumes: ``[batch, length]`` ids from a generator seeded with ``seed``."""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def check_combination(model: Decoder, ids: torch.Tensor, chunk: int, kind: str,
                      variant: BrokenVariant | None = None, under_test: Decoder | None = None) -> GridRow:
    """Run every check for one model (already in its dtype), one stream ``[B, T]``, one chunk size and cache kind.

    Args:
        model: the correct decoder; ``variant.build(model)`` is tested if a variant is given.
        ids: token ids ``[B, T]``.
        chunk: tokens per call (the last call may get fewer).
        kind: ``"dynamic"`` or ``"static"``.
        variant: a broken variant of :mod:`kvdoc.proofs.broken`, or None for the real implementation.
        under_test: ``variant.build(model)`` if already built (saves rebuilding it per combination).

    Returns:
        A :class:`GridRow`.
    """
    dtype = model.wte.weight.dtype
    if dtype not in TOLERANCE:
        raise ValueError(f"no tolerance for dtype {dtype}; use float32 or float64")
    tol = TOLERANCE[dtype]
    if under_test is None:
        under_test = model if variant is None else variant.build(model)
    B, T = ids.shape
    first = stale_prefix(ids, model.config.vocab_size) if variant is not None and variant.stale_prefix else None

    full, full_kv = full_forward_kv(getattr(under_test, "model", under_test), ids)  # a wrapper's model
    run = run_cached(under_test, ids, chunk, kind, first_chunk_ids=first)
    per_position = tuple(_max_abs(run.logits[:, t], full[:, t]) if run.logits.shape == full.shape
                         else math.inf for t in range(T))

    expected_shape = (B, model.config.n_kv_head, T, model.config.head_dim)
    kv_shape_ok = all(t.shape == expected_shape for i in range(model.config.n_layer) for t in run.cache.layer(i))
    kv_error, kv_ok = 0.0, kv_shape_ok
    for i, (k_ref, v_ref) in enumerate(full_kv):
        for got, ref in zip(run.cache.layer(i), (k_ref, v_ref)):
            kv_error = max(kv_error, _max_abs(got, ref))
            kv_ok = kv_ok and _close(got, ref, tol)

    edited = ids.clone()
    edited[:, -1] = (ids[:, -1] + 1) % model.config.vocab_size
    full_edited = under_test(edited).logits
    cached_edited = run_cached(under_test, edited, chunk, kind, first_chunk_ids=first).logits
    causal_error = max(_max_abs(full_edited[:, :-1], full[:, :-1]),
                       _max_abs(cached_edited[:, :-1], run.logits[:, :-1]))
    causal_ok = (_close(full_edited[:, :-1], full[:, :-1], tol)
                 and _close(cached_edited[:, :-1], run.logits[:, :-1], tol))

    checks = {
        "logits": _close(run.logits, full, tol),
        "kv": kv_ok,
        "kv_shape": kv_shape_ok,
        "causality": causal_ok,
        "lifecycle": run.lifecycle_error == 0.0,  # bitwise: nothing may write to what a cache held
    }
    return GridRow(kind, B, chunk, DTYPE_NAMES[dtype], tol, _max_abs(run.logits, full), kv_error,
                   kv_shape_ok, causal_error, run.lifecycle_error, per_position, checks)


def verify(variant: str | None = None, *, model: Decoder | None = None, ids: torch.Tensor | None = None,
           batches: Sequence[int] = (1, 2), chunks: Sequence[int] = (1, 2, 5, 13),
           dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
           kinds: Sequence[str] = ("dynamic", "static")) -> VerifyReport:
    """Run the equivalence grid on the real implementation, or on the broken variant ``variant``.

    Args:
        variant: a key of :data:`kvdoc.proofs.variants.VARIANTS`, or None for the real implementation.
        model: the FP32 decoder to start from (default :func:`default_model`); FP64 runs use a
            converted copy of the same weights.
        ids: the stream ``[B_max, T]`` (default :func:`default_stream` of ``STREAM_LENGTH`` tokens, 2 rows); batch
            ``b`` uses its first ``b`` rows.
        batches, chunks, dtypes, kinds: the grid's axes.

    Returns:
        A :class:`VerifyReport` with one row per (kind, batch, chunk, dtype), in that nesting order.

    Raises:
        ValueError: an unknown variant, or a batch larger than ``ids`` has rows.
    """
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    model = default_model() if model is None else model
    ids = default_stream(length=STREAM_LENGTH, vocab_size=model.config.vocab_size) if ids is None else ids
    if max(batches) > ids.shape[0]:
        raise ValueError(f"batch {max(batches)} needs {max(batches)} rows of ids, got {ids.shape[0]}")
    broken = None if variant is None else VARIANTS[variant]
    converted = {dt: copy.deepcopy(model).to(dt).eval() for dt in dtypes}
    built = {dt: m if broken is None else broken.build(m) for dt, m in converted.items()}
    rows = [check_combination(converted[dt], ids[:b], c, kind, broken, built[dt])
            for kind in kinds for b in batches for c in chunks for dt in dtypes]
    return VerifyReport(variant, rows)


@torch.no_grad()
def split_error(model: Decoder, ids: torch.Tensor, cached: int, variant: str | None = None,
                kind: str = "dynamic") -> float:
    """Max logit error of the new positions when ``ids`` (``[B, T]``) is fed as ``cached`` tokens, then the rest.

    This is the source document's experiment (4 cached + 2 new) for one implementation.

    >>> model = default_model()
    >>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
    >>> split_error(model, ids, 4) < 1e-5 < split_error(model, ids, 4, "top-left-mask")
    True
    """
    if not 0 < cached < ids.shape[1]:
        raise ValueError(f"cached must be between 1 and {ids.shape[1] - 1}, got {cached}")
    broken = None if variant is None else VARIANTS[variant]
    under_test = model if broken is None else broken.build(model)
    first = stale_prefix(ids, model.config.vocab_size) if broken is not None and broken.stale_prefix else None
    run = run_cached(under_test, ids, [cached, ids.shape[1] - cached], kind, first_chunk_ids=first)
    return _max_abs(run.logits[:, cached:], model(ids).logits[:, cached:])
