"""What the checks compare with: tolerances (``atol = rtol``), cache snapshots, a cached run
that records whether a call changed what the cache held before it, the K/V a full forward
projects.

>>> model = default_model()
>>> ids = default_stream(batch=1, length=6)
>>> run = run_cached(model, ids, [4, 2], "static")
>>> tuple(run.logits.shape), run.cache.seq_len, run.lifecycle_error
((1, 6, 97), 6, 0.0)
>>> close(run.logits, model(ids).logits, TOLERANCE[torch.float32])
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.cache import KV, KVCache
from kvdoc.core.feed import chunk_lengths, feed
from kvdoc.core.model import Decoder, GPTConfig, apply_rope
from kvdoc.core.state import StateLayer
from kvdoc.core.v4 import rotate, rotation

TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float64: 1e-10}

DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "FP32", torch.float64: "FP64",
                                       torch.bfloat16: "BF16", torch.float16: "FP16"}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|``; ``inf`` if the shapes differ or a value is NaN.

    >>> max_abs(torch.zeros(2), torch.zeros(3)), max_abs(torch.tensor([1.0]), torch.tensor([0.5]))
    (inf, 0.5)
    """
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    err = (a - b).abs().max().item()
    return math.inf if math.isnan(err) else float(err)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Same shape and ``|a - b| <= tol + tol * |b|`` everywhere."""
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=tol, rtol=tol))


def held_rows(cache: KVCache, i: int) -> tuple[torch.Tensor, ...]:
    """Layer ``i``'s tensors of the positions it holds, ``[B, H, rows, width]``: K and V (or a
    latent), and an indexed layer's indexer keys (:mod:`kvdoc.core.indexed`) after them."""
    layer = cache.layers[i]
    keys = (layer.read_keys(cache.seq_len),) if hasattr(layer, "read_keys") else ()
    return (*cache.layer(i), *keys)


@dataclass(frozen=True)
class Snapshot:
    """A copy of what a cache holds: each layer's positions (``held(i)``) and tensors."""

    held: list[range]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, cache: KVCache) -> Snapshot:
        return cls([cache.held(i) for i in range(cache.n_layer)],
                   [tuple(t.clone() for t in held_rows(cache, i)) for i in range(cache.n_layer)])

    def changed(self, cache: KVCache, rows: int | None = None) -> float:
        """Largest change in ``cache`` of the positions below ``rows`` (default all) held then;
        ``inf`` if it no longer holds one or a layer's shape disagrees with its positions."""
        err = 0.0
        for i, (pair, was) in enumerate(zip(self.layers, self.held, strict=True)):
            if isinstance(cache.layers[i], StateLayer):  # a fold over was.stop positions
                if cache.seq_len != was.stop:
                    return math.inf  # not comparable: another length, another state
                err = max([err, *(max_abs(old, cur)
                                  for old, cur in zip(pair, cache.layer(i), strict=True))])
                continue
            now = cache.held(i)  # a window layer holds only its last positions
            keep = range(was.start, min(was.stop, was.stop if rows is None else rows))
            if len(keep) and (keep.start < now.start or keep.stop > now.stop):
                return math.inf
            for old, cur in zip(pair, held_rows(cache, i), strict=True):
                if cur.shape[2] != len(now):
                    return math.inf
                a = old[:, :, keep.start - was.start: keep.stop - was.start]
                b = cur[:, :, keep.start - now.start: keep.stop - now.start]
                if not torch.equal(a, b):  # the usual case needs no subtraction
                    err = max(err, max_abs(a, b))
        return err


@dataclass(frozen=True)
class CachedRun:
    """:func:`run_cached`'s logits, last cache, and the largest change over all calls of what the
    cache held before the call (``inf`` if a cache not written in place changed its length)."""

    logits: torch.Tensor
    cache: KVCache
    lifecycle_error: float


@torch.no_grad()
def run_cached(model: Callable, ids: torch.Tensor, chunk: int | Sequence[int],
               kind: str = "dynamic", first_chunk_ids: torch.Tensor | None = None, *,
               cache: KVCache | None = None, in_place: bool | None = None) -> CachedRun:
    """Feed ``ids`` ``[B, T]`` through ``model`` (any ``(idx, cache) -> (logits, cache)`` given a
    ``cache``) in chunks of ``chunk`` (or those lengths), continuing ``cache`` or a new one of
    ``kind``. ``first_chunk_ids`` gives the first chunk instead (a stale cache). ``in_place``:
    whether a call may write into the cache passed in (default: ``kind == "static"`` for a new
    cache; for a given one only its held rows are checked)."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, T], got {tuple(ids.shape)}")
    B, T = ids.shape
    if cache is None:
        cache = model.new_cache(B, kind, capacity=T if kind == "static" else None)
        in_place = kind == "static" if in_place is None else in_place
    lifecycle, state = 0.0, (Snapshot.of(cache), cache.seq_len)

    def watch(_: int, n: int, before: KVCache, after: KVCache) -> None:
        nonlocal lifecycle, state
        held, start = state  # what the cache passed in held, and its length, before the call
        lifecycle = max(lifecycle, held.changed(before, start))
        if in_place is False and before.seq_len != start:
            lifecycle = math.inf  # a cache not written in place must keep its length
        state = (Snapshot.of(after), after.seq_len)

    lengths = chunk_lengths(T, chunk)
    parts = []
    if first_chunk_ids is not None:  # the first chunk from other tokens (a stale cache)
        parts.append(feed(model, first_chunk_ids[:, :lengths[0]], cache, lengths[:1], hook=watch))
        cache, ids, lengths = parts[0].cache, ids[:, lengths[0]:], lengths[1:]
    if lengths:
        parts.append(feed(model, ids, cache, lengths, hook=watch))
    return CachedRun(torch.cat([p.logits for p in parts], dim=1), parts[-1].cache, lifecycle)


@torch.no_grad()
def full_forward_kv(model: Decoder, ids: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
    """One full forward: logits and every layer's K and V read off its projections with forward
    hooks (K rotated as a cache stores it; MLA's latent and rotary key), not from any cache code;
    a recurrent layer's state from its own ``final_state(x)`` on the inputs it was given (a token
    at a time, where the cached calls of several tokens take it in chunks).

    >>> model = default_model()
    >>> logits, kv = full_forward_kv(model, torch.tensor([[1, 2, 3]]))
    >>> tuple(logits.shape), len(kv), tuple(kv[0][0].shape)
    ((1, 3, 97), 2, (1, 4, 3, 16))
    """
    cfg = model.config
    captured: list[KV] = []

    def c_attn_hook(attn):  # K and V off c_attn; K normalised (Qwen3) and rotated as cached
        def hook(module, inputs, output):
            B, T, _ = output.shape
            heads = output.view(B, T, -1, cfg.head_dim).transpose(1, 2)
            _, k, v = heads.split((cfg.n_head, cfg.n_kv_head, cfg.n_kv_head), dim=1)
            k = attn.k_norm(k) if getattr(attn, "qk_norm", False) else k
            if cfg.position == "rope":
                k = apply_rope(k, 0, cfg.rope_theta)
            captured.append((k, v))
        return hook

    def latent_hook(attn):
        # an MLA layer's kv_a_proj_with_mqa: the latent (normalised by the layer's own norm),
        # then the rotary key shared by all heads, each as one head [B, 1, T, .] as cached
        def hook(module, inputs, output):
            c_kv, k_rope = output.split((cfg.kv_lora_rank, cfg.qk_rope_head_dim), dim=-1)
            captured.append((attn.kv_a_layernorm(c_kv)[:, None],
                             apply_rope(k_rope[:, None], 0, cfg.rope_theta)))
        return hook

    def k_then_v_hooks(attn):
        # a HeadsAttention's K off its k_norm (Gemma's, Qwen3.5's) or else k_proj, turned by
        # its own rope (a layer's base, gpt-oss's YaRN, a partial rotary); V off v_proj, which
        # runs after it
        found = {}

        def k_hook(module, inputs, output):
            if output.dim() == 3:  # k_proj's [B, T, H_kv D_h]: into heads as cached
                B, T, _ = output.shape
                output = output.view(B, T, cfg.n_kv_head, -1).transpose(1, 2)
            found["k"] = attn.rope(output, 0)

        def v_hook(module, inputs, output):
            B, T, _ = output.shape
            v = output.view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
            captured.append((found.pop("k"), v))
        return [getattr(attn, "k_norm", attn.k_proj).register_forward_hook(k_hook),
                attn.v_proj.register_forward_hook(v_hook)]

    def shared_kv_hook(attn):  # a V4 layer's K = V, off its kv_norm, turned as cached
        def hook(module, inputs, output):
            T = output.shape[1]
            turn = rotation(torch.arange(T, device=output.device), cfg.rope_head_dim,
                            attn.theta, output.dtype)
            kv = rotate(output[:, None], *turn)
            captured.append((kv, kv))
        return hook

    handles = []
    for block in model.h:
        # a recurrent layer (DeltaNet's linear_attn, or any mixer) probes itself: final_state(x)
        attn = (getattr(block, "attn", None) or getattr(block, "self_attn", None)
                or next((m for m in block.children() if hasattr(m, "final_state")), block))
        if hasattr(attn, "kv_norm") and hasattr(attn, "sinks"):
            handles.append(attn.kv_norm.register_forward_hook(shared_kv_hook(attn)))
        elif hasattr(attn, "kv_a_proj_with_mqa"):
            handles.append(attn.kv_a_proj_with_mqa.register_forward_hook(latent_hook(attn)))
        elif hasattr(attn, "c_attn"):
            handles.append(attn.c_attn.register_forward_hook(c_attn_hook(attn)))
        elif hasattr(attn, "rope"):
            handles += k_then_v_hooks(attn)
        elif hasattr(attn, "final_state"):  # a recurrent layer: its state, token by token
            handles.append(attn.register_forward_hook(
                lambda module, inputs, output: captured.append(module.final_state(inputs[0]))))
        else:
            for handle in handles:
                handle.remove()
            raise ValueError(f"no K/V probe for a {type(attn).__name__} (no c_attn, "
                             "kv_a_proj_with_mqa, rope or final_state): "
                             "full_forward_kv must learn it")
    try:
        logits = model(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, captured


def default_model(seed: int = 0, config: GPTConfig | None = None) -> Decoder:
    """The site's model, in eval mode, after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return Decoder(config or GPTConfig()).eval()


def default_stream(seed: int = 1, batch: int = 2, length: int = 24,
                   vocab_size: int = 97) -> torch.Tensor:
    """Token ids ``[batch, length]`` from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=g)

