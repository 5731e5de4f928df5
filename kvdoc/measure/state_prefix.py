"""The prefix-cache hit rate of a hybrid model, whose recurrent layers resume only from a saved
state: where the snapshots are taken decides what a request can find.

A request that shares ``s`` tokens with a cached prompt can reuse ``s`` K/V rows, but a
recurrent layer's state (Gated DeltaNet, Mamba-2) only where an earlier request saved it, a
*snapshot*: a hybrid model's hit is the deepest snapshot inside the shared prefix (short of the
last token). Each prompt is matched against all before it, as
:func:`~kvdoc.measure.prefix_report.prefix_report` does, and saves snapshots while its prefill
runs (past its own hit), at positions given by ``where``:

* ``"every"``: every multiple of ``block`` up to its end (a prefill cut into chunks of one
  block, each chunk's final state kept);
* ``"last"``: the last multiple of ``block`` before its last token, only (vLLM 0.33's
  ``mamba_cache_mode="align"`` for a prefill in one chunk: the chunk is split there and the
  state at the split is cached);
* ``"end"``: its last position (SGLang 0.5.23's ``no_buffer`` strategy: only the state at the
  end of the cached sequence exists).

``branch=True`` adds one more: where the request's K/V match ends, rounded down to ``block``,
if that is past its state hit (SGLang's ``mamba_branching_seqlen``; vLLM's opt-in
``enable_mamba_shared_prefix_checkpoint``), so the next request that parts there finds it.

>>> system, a, b = list(range(40)), [50] * 30, [60] * 30
>>> prompts = [system + a, system + b, system + [70] * 30]
>>> [state_prefix_report(prompts, where, 16).hits for where in ("every", "last", "end")]
[[0, 32, 32], [0, 0, 0], [0, 0, 0]]
>>> state_prefix_report(prompts, "last", 16, branch=True).hits   # #1 saves 32 for #2
[0, 0, 32]
>>> state_prefix_report(prompts, "last", 16).kv_hits             # K/V alone, token by token
[0, 40, 40]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvdoc.serving.snapshots import WHERE, save_points

from .kv_bytes import check_int
from .layer_caches import LayerCache
from .prefix_report import Prefixes

KERNEL_ALIGNMENT = 16
"""Tokens an attention block is a multiple of in :func:`vllm_hybrid_block` (FlashAttention's
``MultipleOf(16)`` and vLLM's default block size)."""


@dataclass(frozen=True)
class StateReport:
    """Per request: prompt length, hit with K/V alone and hit of the hybrid model; after the
    last request, the ``snapshots`` saved."""

    tokens: list[int]
    kv_hits: list[int]
    hits: list[int]
    snapshots: int

    def hit_rate(self) -> float:
        """Hybrid hit tokens over prompt tokens."""
        return sum(self.hits) / sum(self.tokens)

    def kv_hit_rate(self) -> float:
        """Hit tokens over prompt tokens if every layer kept K/V rows."""
        return sum(self.kv_hits) / sum(self.tokens)


def state_prefix_report(prompts: Sequence[Sequence[int]], where: str = "last",
                        block: int = 16, branch: bool = False) -> StateReport:
    """Match each prompt against those before it; snapshots where
    :func:`~kvdoc.serving.snapshots.save_points` puts them by ``where`` and ``block`` (the rules
    the server runs), plus each request's branching point with ``branch``."""
    if where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, got {where!r}")
    check_int("block", block)
    if not prompts or not all(prompts):
        raise ValueError("need at least one prompt, and no empty prompt")
    trie, saved = Prefixes(), set()  # saved: trie nodes (positions) holding a snapshot
    tokens, kv_hits, hits = [], [], []
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        path = trie.path(prompt)[: n - 1]  # the last token is always computed
        hit = max((d + 1 for d, node in enumerate(path) if node in saved), default=0)
        tokens.append(n)
        kv_hits.append(len(path))
        hits.append(hit)
        trie.add(prompt, i)
        here = trie.path(prompt)
        points = save_points(n, hit, where, block)
        if branch and len(path) // block * block > hit:
            points.append(len(path) // block * block)
        saved.update(here[p - 1] for p in points if p > 0)
    return StateReport(tokens, kv_hits, hits, len(saved))


def vllm_state_bytes(layer: LayerCache, conv_kernel: int, element_bytes: int = 2) -> int:
    """One recurrent layer's state as vLLM 0.33 allocates it, from the memory command's
    :class:`~kvdoc.measure.layer_caches.LayerCache` (which counts transformers' layout: a conv
    window of ``conv_kernel`` taps, the state in FP32): a window of ``conv_kernel - 1`` taps and
    the state, both of ``element_bytes`` (the model's dtype: its ``mamba_cache_dtype`` and
    ``mamba_ssm_cache_dtype`` default to ``"auto"``).

    >>> from kvdoc.measure.layer_caches import gated_delta_layer
    >>> vllm_state_bytes(gated_delta_layer(16, 32, 128, 128, 4), 4)   # Qwen3-Next, BF16
    1097728
    """
    check_int("conv_kernel", conv_kernel, minimum=2)
    if layer.per_token or not layer.state32 or layer.state % conv_kernel:
        raise ValueError(f"need a recurrent layer whose conv state has {conv_kernel} taps, "
                         f"got {layer}")
    return element_bytes * (layer.state // conv_kernel * (conv_kernel - 1) + layer.state32)


def vllm_hybrid_block(state_bytes: int, kv_bytes_per_token: int,
                      alignment: int = KERNEL_ALIGNMENT) -> int:
    """The block size vLLM 0.33 gives a hybrid model: the smallest multiple of ``alignment``
    whose K/V page (``block x kv_bytes_per_token``, one attention layer) holds one recurrent
    layer's state (``state_bytes``), so that both kinds of page have one size. In
    ``mamba_cache_mode="align"`` the snapshots are taken at multiples of it.

    >>> # Qwen3-Next-80B-A3B in BF16: its state beside 2 x 2 x 256 K/V elements a token
    >>> vllm_hybrid_block(1097728, 2 * 2 * 256 * 2)
    544
    """
    check_int("state_bytes", state_bytes)
    check_int("kv_bytes_per_token", kv_bytes_per_token)
    check_int("alignment", alignment)
    return alignment * -(-state_bytes // (alignment * kv_bytes_per_token))
