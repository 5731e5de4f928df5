"""Prefill/decode hand-over (disaggregation): prefill in one process, decode in another.

The prefill worker sends every layer's two cached tensors and the first new token's logits as
one self-describing payload (:func:`pack`: ``torch.save`` of a dict); the decode worker rebuilds
a :class:`~kvdoc.core.cache.DynamicCache` from them (:func:`unpack`) and carries on.

>>> from kvdoc.core.model import Decoder, GPTConfig, generate
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> prompt = torch.tensor([[5, 6, 7, 8]])
>>> run = disaggregated_generate(model, prompt, 5, in_process=True)
>>> torch.equal(run.tokens, generate(model, prompt, 5))
True
>>> run.kv_bytes == 2 * 2 * 1 * 4 * 4 * 16 * 4  # K and V x layers x B x H_kv x T x D_h x 4
True
"""

from __future__ import annotations

import io
import multiprocessing
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvdoc.core.cache import DynamicCache, KVCache
from kvdoc.core.model import Decoder, decode_step, prefill
from kvdoc.serving.requests import greedy

FORMAT = "kvdoc-handover/2"
"""The payload's ``format`` field: what :func:`unpack` accepts."""

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


def _own(t: torch.Tensor) -> torch.Tensor:
    # torch.save writes a view's whole storage: a clone holds only the rows shipped
    return t.detach().clone(memory_format=torch.contiguous_format)


def pack(cache: KVCache, logits: torch.Tensor | None = None) -> bytes:
    """One payload holding every layer's two tensors (K and V, or c_KV and k_rope), their heads
    and widths and, if given, the next-token ``logits``; a cache that does not hold every
    position it has seen (a window) is refused.

    >>> from kvdoc.core.model import GPTConfig
    >>> cache = DynamicCache.empty(GPTConfig(), batch_size=1)
    >>> unpack(pack(cache), GPTConfig())[0].seq_len
    0
    """
    if cache.held() != range(cache.seq_len) or str(cache.dtype) not in _DTYPES:
        raise ValueError("pack ships caches that hold every position in a floating dtype, got "
                         f"{type(cache).__name__} holding {cache.held()} in {cache.dtype}")
    layers = [cache.layer(i) for i in range(cache.n_layer)]
    first = cache.layers[0]
    body = {"format": FORMAT, "n_layer": cache.n_layer, "batch_size": cache.batch_size,
            "heads": first.heads, "widths": list(first.widths), "seq_len": cache.seq_len,
            "dtype": str(cache.dtype), "k": [_own(k) for k, _ in layers],
            "v": [_own(v) for _, v in layers],
            "logits": None if logits is None else _own(logits)}
    buffer = io.BytesIO()
    torch.save(body, buffer)
    return buffer.getvalue()


def _load(payload: bytes) -> dict:
    try:  # weights_only: a payload from elsewhere can hold tensors and plain data, no code
        body = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as err:  # truncated or not a torch.save file at all
        raise ValueError(f"not a hand-over payload ({len(payload)} bytes): {err}") from err
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} payload")
    return body


def unpack(payload: bytes, config: object,
           dtype: torch.dtype | None = None) -> tuple[KVCache, torch.Tensor | None]:
    """The :class:`~kvdoc.core.cache.DynamicCache` and the next-token logits that :func:`pack`
    shipped, for a model with ``config`` (and ``dtype``, when given), all checked first.

    >>> from kvdoc.core.model import GPTConfig
    >>> payload = pack(DynamicCache.empty(GPTConfig(), batch_size=1))
    >>> unpack(payload, GPTConfig(n_kv_head=2))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: payload is for another model: ... = (2, 4, (16, 16)), model has (2, 2, (16, 16))
    """
    body = _load(payload)
    layout = config.cache_layout
    found = (body["n_layer"], body["heads"], tuple(body["widths"]))
    expected = (len(layout), layout[0].heads, layout[0].widths)
    if found != expected:
        raise ValueError("payload is for another model: (layers, heads, widths) = "
                         f"{found}, model has {expected}")
    stated = _DTYPES.get(body["dtype"])
    if stated is None or (dtype is not None and stated != dtype):
        raise ValueError(f"payload dtype is {body['dtype']}, model dtype is {dtype}")
    if not 0 <= body["seq_len"] <= config.n_positions:
        raise ValueError(f"payload holds {body['seq_len']} positions, "
                         f"model has {config.n_positions}")
    B, L = body["batch_size"], len(layout)
    shapes = [(B, layout[0].heads, body["seq_len"], width) for width in layout[0].widths]
    if len(body["k"]) != L or len(body["v"]) != L or any(
            tuple(t.shape) != shape or t.dtype != stated
            for ts, shape in zip((body["k"], body["v"]), shapes, strict=True) for t in ts):
        raise ValueError(f"payload must hold {L} K and {L} V tensors of shapes "
                         f"{[list(s) for s in shapes]} in {stated}, got K {_shapes(body['k'])} "
                         f"and V {_shapes(body['v'])}")
    logits = body["logits"]
    if logits is not None and tuple(logits.shape) != (B, 1, config.vocab_size):
        raise ValueError(f"payload logits must be [{B}, 1, {config.vocab_size}], "
                         f"got {list(logits.shape)}")
    layers = list(zip(body["k"], body["v"], strict=True))
    return DynamicCache(layers), logits


def _shapes(tensors: list) -> list:
    return [(list(t.shape), str(t.dtype)) for t in tensors]


class HandoverRun(NamedTuple):
    """What :func:`disaggregated_generate` returns: ``tokens`` ``[B, P + N]``, the ``logits``
    behind them, the payload's length and of it the K/V's and the logits' bytes."""

    tokens: torch.Tensor
    logits: torch.Tensor
    payload_bytes: int
    kv_bytes: int
    logits_bytes: int

    @property
    def overhead_bytes(self) -> int:
        """The rest of the payload: sizes, names and ``torch.save``'s framing."""
        return self.payload_bytes - self.kv_bytes - self.logits_bytes


def _prefill_payload(model: Decoder, prompt: torch.Tensor,
                     packer: Callable[..., bytes]) -> bytes:
    # pack ships every position 0 .. T - 1 (the decode side rebuilds them so); a window model's
    # default cache, a ring, keeps only its last W, so the prefill keeps them all instead
    logits, cache = prefill(model, prompt, model.new_cache(prompt.shape[0], "dynamic"))
    return packer(cache, logits)


def _prefill_worker(conn, *args) -> None:
    torch.set_num_threads(1)  # a worker per core, not every worker on every core
    try:
        conn.send_bytes(_prefill_payload(*args))
    finally:
        conn.close()


def disaggregated_generate(model: Decoder, prompt: torch.Tensor, max_new_tokens: int, *,
                           in_process: bool = False,
                           packer: Callable[..., bytes] = pack) -> HandoverRun:
    """Greedy generation whose prefill runs in another process (``in_process``: here) and sends
    ``packer(cache, logits)`` through a pipe; this process unpacks it and decodes (``packer``:
    the seam :mod:`kvdoc.teach.handover_checks` uses to ship a broken payload)."""
    model.check_input(prompt, None)
    total = prompt.shape[1] + max_new_tokens
    if max_new_tokens < 1 or total > model.config.n_positions:
        raise ValueError(f"need 1 <= max_new_tokens and prompt + new tokens <= "
                         f"{model.config.n_positions}, got {prompt.shape[1]} + {max_new_tokens}")
    dtype = next(model.parameters()).dtype
    args = (model, prompt, packer)
    if in_process:
        payload = _prefill_payload(*args)
    else:
        ctx = multiprocessing.get_context("spawn")
        here, there = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=_prefill_worker, args=(there, *args))
        worker.start()
        there.close()
        try:
            payload = here.recv_bytes()
        except EOFError as err:
            worker.join()
            raise RuntimeError("prefill process ended without a payload "
                               f"(exit code {worker.exitcode})") from err
        worker.join()
    cache, logits = unpack(payload, model.config, dtype)
    if logits is None:
        raise ValueError("payload carries no next-token logits to start decoding from")
    kv_bytes = sum(t.numel() * t.element_size() for t in cache.tensors())
    logits_bytes = logits.numel() * logits.element_size()
    with torch.no_grad():
        tokens, chosen, _ = greedy(logits, cache, prompt, max_new_tokens,
                                   lambda token, cache, _: decode_step(model, token, cache))
    return HandoverRun(tokens, chosen, len(payload), kv_bytes, logits_bytes)
