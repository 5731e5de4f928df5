"""A prefill group at TP = ``tp`` hands one request's K/V, block by block, to a decode rank.

Ranks ``0 .. tp - 1`` run the prompt once, tensor parallel (:mod:`kvdoc.parallel.tensor`): each
caches only its K/V heads. Rank ``tp`` decodes alone (TP = 1) and needs every head. So each
prefill rank sends its heads of one block (``block_size`` positions of every layer, K and V) per
point-to-point message; the decode rank receives each into the slots of the heads that rank
holds (:func:`destination`: the remap between the two layouts). Under replication
(``tp > H_kv``) only the first rank of each replica set sends, so every head crosses once.

To start decoding (:data:`MODES`), ``"logits"`` sends all ``P`` positions and rank 0 the last
logits; ``"recompute"`` sends ``P - 1`` positions and the decode rank feeds the last prompt token
itself (one forward more, less on the wire). To move the blocks (:data:`TRANSFERS`), ``"push"``
sends every block; with ``"pull"`` the decode rank, which may hold the first ``have`` blocks
already (its own prefix cache), asks each prefill rank for those it lacks (a count, then the
ids), and gets them in that order. What moves is exactly :func:`moved_bytes`, plus
:func:`request_bytes` of block ids when pulling, in :func:`messages` messages
(:func:`handover_jobs` counts the real tensors against them).

>>> from kvdoc.core.model import llama_config
>>> config = llama_config()                           # 2 layers, GQA 4 / 2, D = 16
>>> moved_bytes(config, batch=1, prompt_len=7, mode="logits")  # 2*2*7*2*16*4 + 97*4
3972
>>> messages(config, tp=2, prompt_len=7, block_size=4, mode="recompute")
4
>>> messages(config, 2, 9, 4, "recompute", transfer="pull", have=1)  # 2 x (count, ids, block)
6
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from kvdoc.core.cache import DynamicCache, check_int
from kvdoc.core.model import Decoder, GPTConfig, decode_step, generate, prefill
from kvdoc.measure.kv_bytes import kv_bytes

from .comm import Comm
from .comparison import MARK, TOLERANCE, rows_close
from .decode import RankDecoder, check_run, greedy, nonstandard
from .launch import launch
from .tensor import head_shard

MODES = ("logits", "recompute")
"""How the decode rank gets its first token's logits (see the module docstring)."""

TRANSFERS = ("push", "pull")
"""Who starts each block's transfer (see the module docstring)."""


def destination(config: GPTConfig, tp: int, tp_rank: int) -> list[int]:
    """The decode rank's K/V heads that prefill rank ``tp_rank``'s message fills, in the order
    the message holds them: that rank's own heads (:func:`~kvdoc.parallel.tensor.head_shard`).

    >>> from kvdoc.core.model import GPTConfig
    >>> [destination(GPTConfig(), 2, t) for t in (0, 1)]      # 4 K/V heads over 2 ranks
    [[0, 1], [2, 3]]
    """
    return list(head_shard(config, tp, tp_rank).kv_heads)


def senders(config: GPTConfig, tp: int) -> list[int]:
    """The prefill ranks that send: the first of each replica set, so no head is sent twice.

    >>> from kvdoc.core.model import llama_config
    >>> senders(llama_config(n_kv_head=1), 2)                 # MQA: both hold head 0
    [0]
    """
    replicas = head_shard(config, tp, 0).replicas
    return [t for t in range(tp) if t % replicas == 0]


def sent_positions(prompt_len: int, mode: str) -> int:
    """Positions whose K/V cross: all ``P`` with logits, ``P - 1`` when the decode side
    recomputes the last."""
    if mode not in MODES:
        raise ValueError(f"unknown hand-over mode {mode!r}; known: {', '.join(MODES)}")
    return prompt_len - (mode == "recompute")


def pulled_blocks(prompt_len: int, block_size: int, mode: str, have: int = 0) -> range:
    """The ids of the blocks that cross: all of them, or those after the ``have`` the decode
    rank holds.

    >>> pulled_blocks(9, 4, "logits", have=1)                  # blocks of 4, 4, 1 positions
    range(1, 3)
    """
    blocks = -(-sent_positions(prompt_len, mode) // check_int("block_size", block_size))
    if not 0 <= have < blocks:
        raise ValueError(f"the decode rank can hold 0 to {blocks - 1} of the {blocks} blocks "
                         f"before pulling, not have={have}")
    return range(have, blocks)


def moved_bytes(config: GPTConfig, batch: int, prompt_len: int, mode: str,
                dtype: torch.dtype = torch.float32, *, held: int = 0) -> int:
    """``2 x B x L x T x H_kv x D x s`` for the ``T`` positions sent (:func:`sent_positions`
    less the ``held`` the decode rank has), plus ``B x V x s`` of logits in ``"logits"`` mode:
    the same at every prefill TP."""
    total = kv_bytes(batch, config.n_layer, sent_positions(prompt_len, mode) - held,
                     config.n_kv_head, config.head_dim, dtype)
    if mode == "logits":
        total += batch * config.vocab_size * torch.empty((), dtype=dtype).element_size()
    return total


def request_bytes(config: GPTConfig, tp: int, prompt_len: int, block_size: int, mode: str,
                  have: int = 0) -> int:
    """What a pull's requests weigh: to each sending rank, a count and the ids, 8 bytes each."""
    return len(senders(config, tp)) * (1 + len(pulled_blocks(prompt_len, block_size, mode,
                                                             have))) * 8


def messages(config: GPTConfig, tp: int, prompt_len: int, block_size: int, mode: str,
             transfer: str = "push", have: int = 0) -> int:
    """Point-to-point messages: one per block crossing per sending rank, two requests per
    sending rank when pulling, plus one of logits."""
    blocks = len(pulled_blocks(prompt_len, block_size, mode, have))
    return (blocks + 2 * (transfer == "pull")) * len(senders(config, tp)) + (mode == "logits")


def lacking(blocks: range) -> list[int]:
    """The block ids a pulling decode rank asks for: exactly the ones it lacks (the hook a
    broken variant overrides)."""
    return list(blocks)


@dataclass
class Handed:
    """What one rank of a hand-over did."""

    rank: int
    sent_bytes: int = 0
    received_bytes: int = 0
    messages: int = 0
    """Messages it sent or received."""
    tokens: torch.Tensor | None = None
    """The decode rank's ``[B, P + N]``; ``logits``, ``[B, N, V]``."""
    logits: torch.Tensor | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """The decode rank's assembled prompt K/V, per layer ``[B, H_kv, T_sent, D]``."""
    forwards: int = 0
    """Forward calls the decode rank made before its first token (0 or 1)."""


class Handover(NamedTuple):
    """One hand-over job of :func:`handover_jobs`."""

    name: str
    model: Decoder
    prompt: torch.Tensor
    max_new_tokens: int
    block_size: int
    mode: str
    place: Callable[[GPTConfig, int, int], list[int]] = destination
    transfer: str = "push"
    have: int = 0
    """Leading blocks the decode rank holds before pulling (``"pull"`` only)."""
    ask: Callable[[range], list[int]] = lacking


def _send(t: torch.Tensor, dst: int, out: Handed) -> None:
    t = t.contiguous()
    dist.send(t, dst=dst)
    out.sent_bytes += t.numel() * t.element_size()
    out.messages += 1


def _recv(shape: tuple, dtype: torch.dtype, src: int, out: Handed) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    dist.recv(t, src=src)
    out.received_bytes += t.numel() * t.element_size()
    out.messages += 1
    return t


def _block(layers: list, start: int, end: int) -> torch.Tensor:
    """Positions ``start .. end - 1`` of every layer's K and V: ``[L, 2, B, H_kv,r, n, D]``."""
    return torch.stack([torch.stack((k[:, :, start:end], v[:, :, start:end])) for k, v in layers])


@torch.no_grad()
def _prefill_rank(rank: int, tp: int, group: object, job: Handover) -> Handed:
    comm = Comm(rank, tp, 1, group)  # the TP group of the prefill ranks alone
    decoder = RankDecoder(job.model, comm).eval()
    prompt, size = job.prompt, job.block_size
    logits, cache = decoder(prompt, decoder.new_cache(prompt.shape[0]), 0)
    out, T = Handed(rank), sent_positions(prompt.shape[1], job.mode)
    if rank in senders(job.model.config, tp):
        layers = [layer.tensors() for layer in cache.layers]
        if job.transfer == "push":
            ids = list(range(-(-T // size)))
        else:  # answer the decode rank's request, in its order
            count = _recv((1,), torch.int64, tp, out)
            ids = _recv((int(count),), torch.int64, tp, out).tolist()
        for i in ids:
            _send(_block(layers, i * size, min((i + 1) * size, T)), tp, out)
    if job.mode == "logits" and rank == 0:
        _send(logits, tp, out)
    return out


@torch.no_grad()
def _decode_rank(tp: int, job: Handover) -> Handed:
    model, prompt, size, mode = job.model, job.prompt, job.block_size, job.mode
    config, out = model.config, Handed(tp)
    B, L, D, T = prompt.shape[0], config.n_layer, config.head_dim, sent_positions(
        prompt.shape[1], mode)
    dtype = model.wte.weight.dtype
    kv = torch.empty((L, 2, B, config.n_kv_head, T, D), dtype=dtype)
    blocks = pulled_blocks(prompt.shape[1], size, mode, job.have)
    if job.have:  # its own prefix cache: the first blocks, computed here
        _, own = prefill(model, prompt[:, :job.have * size], model.new_cache(B, "dynamic"))
        for i, layer in enumerate(own.layers):
            kv[i, :, :, :, :job.have * size] = torch.stack(layer.read(own.seq_len))
    asked = list(blocks) if job.transfer == "push" else job.ask(blocks)
    if job.transfer == "pull":
        for t in senders(config, tp):
            _send(torch.tensor([len(asked)]), t, out)
            _send(torch.tensor(asked, dtype=torch.int64), t, out)
    for slot, i in zip(blocks, asked, strict=True):
        n = min(size, T - i * size)  # the asked block's positions
        for t in senders(config, tp):
            heads = job.place(config, tp, t)  # the remap: rank t's heads into the decode layout
            block = _recv((L, 2, B, len(heads), n, D), dtype, t, out)
            kv[:, :, :, heads, slot * size:slot * size + n] = block
    out.kv = [(kv[i, 0], kv[i, 1]) for i in range(L)]
    cache = DynamicCache([(k.clone(), v.clone()) for k, v in out.kv])
    if mode == "logits":
        logits = _recv((B, 1, config.vocab_size), dtype, 0, out)
    else:  # feed the last prompt token over the P - 1 positions received
        logits, cache = decode_step(model, prompt[:, -1:], cache)
        out.forwards = 1
    out.tokens, out.logits, _ = greedy(logits, cache, prompt, job.max_new_tokens,
                                       lambda token, cache, _: decode_step(model, token, cache))
    return out


def _rank(rank: int, world_size: int, jobs: list[Handover]) -> list[Handed]:
    tp = world_size - 1
    # every rank of the world creates the prefill group, as new_group requires
    group = dist.new_group(list(range(tp))) if tp > 1 else None
    return [_prefill_rank(rank, tp, group, j) if rank < tp else _decode_rank(tp, j)
            for j in jobs]


def check_handover(model: Decoder, prompt: torch.Tensor, max_new_tokens: int, tp: int,
                   block_size: int, mode: str, transfer: str = "push", have: int = 0) -> None:
    """Raise ``ValueError`` for a hand-over that cannot run, before any rank starts: a
    model whose layers are not standard attention blocks (named by
    :func:`~.decode.nonstandard`: MLA's latent, Gemma's, a recurrent layer, q/k norms),
    a layout or an input."""
    why = nonstandard(model)
    if why is not None:
        raise ValueError("the block hand-over sends the K/V heads of standard "
                         "attention blocks (GPT-2 or Llama style) that a TP prefill "
                         f"splits, got {why}")
    check_run(model, prompt, max_new_tokens, tp, 1)
    check_int("block_size", block_size)
    if sent_positions(prompt.shape[1], mode) < 1:
        raise ValueError("recompute mode needs a prompt of at least 2 tokens: "
                         "one to send, one to recompute")
    if transfer not in TRANSFERS:
        raise ValueError(f"unknown transfer {transfer!r}; known: {', '.join(TRANSFERS)}")
    if have and transfer == "push":
        raise ValueError("a pushing prefill sends every block: have > 0 needs transfer='pull'")
    pulled_blocks(prompt.shape[1], block_size, mode, have)


@dataclass
class HandoverCheck:
    """One hand-over against one process."""

    name: str
    mode: str
    tokens_equal: bool
    kv_close: bool
    logits_close: bool
    sent_bytes: int
    received_bytes: int
    formula_bytes: int
    messages: int
    formula_messages: int
    forwards: int
    transfer: str = "push"
    requests: tuple[int, int, int] = (0, 0, 0)
    """Bytes of block ids the decode rank sent, the prefill ranks received, and the formula's."""

    @property
    def ok(self) -> bool:
        """Every check passed."""
        return (self.tokens_equal and self.kv_close and self.logits_close
                and self.sent_bytes == self.received_bytes == self.formula_bytes
                and len(set(self.requests)) == 1 and self.messages == self.formula_messages)

    def lines(self) -> list[str]:
        """What was compared, for a reader."""
        asked = f"; block ids asked {self.requests[0]:,} bytes (formula {self.requests[2]:,})" \
            if self.transfer == "pull" else ""
        return [f"{self.name} ({self.transfer}, {self.mode}): tokens equal to generate: "
                f"{MARK[self.tokens_equal]}; K/V equal to one process: {MARK[self.kv_close]}",
                f"  bytes sent {self.sent_bytes:,}, received {self.received_bytes:,}, formula "
                f"{self.formula_bytes:,}{asked}; messages {self.messages} (formula "
                f"{self.formula_messages}); decode-side forwards before token 1: "
                f"{self.forwards}"]


def handover_jobs(jobs: list[tuple], tp: int = 2) -> list[HandoverCheck]:
    """Run each :class:`Handover` (or a tuple of its fields) on one launch of ``tp + 1`` ranks
    and check it against one process: tokens against :func:`~kvdoc.core.model.generate`, the
    assembled K/V against a one-process prefill (within
    :data:`~kvdoc.parallel.comparison.TOLERANCE`: TP reorders sums), bytes and messages against
    the formulas. A job :func:`check_handover` refuses raises before any rank starts.
    """
    full = [Handover(*j) for j in jobs]
    for j in full:
        check_handover(j.model, j.prompt, j.max_new_tokens, tp, j.block_size, j.mode,
                       j.transfer, j.have)
    per_rank = launch(_rank, tp + 1, full, backend="gloo")  # CPU tensors
    checks = []
    for i, j in enumerate(full):
        model, prompt, new, mode = j.model, j.prompt, j.max_new_tokens, j.mode
        ranks = [r[i] for r in per_rank]
        decode = ranks[tp]
        T = sent_positions(prompt.shape[1], mode)
        with torch.no_grad():
            _, cache = prefill(model, prompt[:, :T], model.new_cache(prompt.shape[0], "dynamic"))
            want_logits = prefill(model, prompt).logits
        dtype = model.wte.weight.dtype
        tol = TOLERANCE.get(dtype, 1e-5)
        logits_close = torch.allclose(decode.logits[:, 0], want_logits[:, -1], atol=tol, rtol=tol)
        asked = request_bytes(model.config, tp, prompt.shape[1], j.block_size, mode,
                              j.have) if j.transfer == "pull" else 0
        checks.append(HandoverCheck(
            j.name, mode, torch.equal(decode.tokens, generate(model, prompt, new)),
            rows_close(decode.kv, cache, tol), bool(logits_close),
            sum(r.sent_bytes for r in ranks[:tp]), decode.received_bytes,
            moved_bytes(model.config, prompt.shape[0], prompt.shape[1], mode, dtype,
                        held=j.have * j.block_size),
            decode.messages, messages(model.config, tp, prompt.shape[1], j.block_size, mode,
                                      j.transfer, j.have),
            decode.forwards, j.transfer,
            (decode.sent_bytes, sum(r.received_bytes for r in ranks[:tp]), asked)))
    return checks


def handover_runs(jobs: Sequence[tuple[int, tuple]]) -> list[HandoverCheck]:
    """:func:`handover_jobs` of ``(tp, job)`` pairs, one launch per prefill ``tp``, the
    checks in the order of ``jobs``."""
    done = {tp: iter(handover_jobs([j for t, j in jobs if t == tp], tp))
            for tp in sorted({t for t, _ in jobs})}
    return [next(done[tp]) for tp, _ in jobs]
