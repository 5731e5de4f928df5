"""A simulated request mix, and the K/V memory that three allocation strategies reserve for it.

Every request is a shared system prompt, its own user text and output (random ids, seeded
lengths: :func:`request_mix`). :func:`measure_mix` holds them all at once and measures what each
strategy reserves: a :class:`~kvdoc.core.cache.StaticCache` of ``n_positions`` a request (the
final length is unknown at admission); paged blocks; paged blocks with the system prompt's
shared (its logits compared with each request alone by
:func:`kvdoc.teach.serving_checks.compare_mix_with_alone`).

>>> from kvdoc.core.model import GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> mix = request_mix(n=3, prefix_len=5, user_lens=(2, 4), output_lens=(1, 3))
>>> m = measure_mix(model, mix, block_size=4)
>>> m.requests, len(m.logits), (m.strategies[0].reserved_bytes
...                               == 3 * StaticCache(model.config, 1, 512).nbytes())
(3, 3, True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdoc.core.cache import StaticCache
from kvdoc.core.model import Decoder

from .paged import BlockPool, PagedCache
from .requests import random_ids


@dataclass(frozen=True)
class RequestMix:
    """Requests sharing one system ``prefix``, each with its own text and output tokens."""

    prefix: list[int]
    users: list[list[int]]
    outputs: list[list[int]]
    description: str

    def lengths(self) -> list[int]:
        """Positions each request holds at the end: prefix + user + output."""
        return [len(self.prefix) + len(u) + len(o)
                for u, o in zip(self.users, self.outputs, strict=True)]


def request_mix(n: int = 48, prefix_len: int = 100, user_lens: tuple[int, int] = (16, 160),
                output_lens: tuple[int, int] = (8, 160), vocab_size: int = 97,
                seed: int = 0) -> RequestMix:
    """``n`` requests: a ``prefix_len``-token system prompt, then user and output lengths uniform
    on the inclusive ranges given, token ids uniform, from ``torch.Generator`` seed ``seed``.

    >>> mix = request_mix(n=4, prefix_len=3, user_lens=(1, 2), output_lens=(5, 5))
    >>> all(9 <= n <= 10 for n in mix.lengths()), mix == request_mix(4, 3, (1, 2), (5, 5))
    (True, True)
    """
    if (n < 1 or prefix_len < 0 or not 1 <= user_lens[0] <= user_lens[1]
            or not 1 <= output_lens[0] <= output_lens[1]):
        raise ValueError("need n >= 1, prefix_len >= 0 and ranges (lo, hi) with 1 <= lo <= hi")
    g = torch.Generator().manual_seed(seed)
    prefix, users, outputs = list(random_ids(g, prefix_len, vocab_size)), [], []
    for _ in range(n):
        users.append(list(random_ids(g, user_lens, vocab_size)))
        outputs.append(list(random_ids(g, output_lens, vocab_size)))
    text = (f"{n} requests; a shared system prompt of {prefix_len} tokens; user text uniform on "
            f"{user_lens[0]}..{user_lens[1]} tokens; "
            f"output uniform on {output_lens[0]}..{output_lens[1]} tokens; "
            f"token ids uniform; torch.Generator seed {seed}")
    return RequestMix(prefix, users, outputs, text)


@dataclass(frozen=True)
class StrategyMemory:
    """The K/V bytes a strategy reserves for the mix, and those that hold a position."""

    name: str
    reserved_bytes: int
    filled_bytes: int

    @property
    def unused_bytes(self) -> int:
        """Reserved slots that hold nothing: the waste."""
        return self.reserved_bytes - self.filled_bytes


@dataclass(frozen=True)
class MixMemory:
    """What :func:`measure_mix` returns: the positions all requests hold, a position's K/V bytes,
    the three strategies and each request's logits from the shared-prefix run."""

    requests: int
    positions: int
    position_bytes: int
    block_size: int
    strategies: tuple[StrategyMemory, ...]
    logits: tuple[torch.Tensor, ...]

    @property
    def saved_by_sharing(self) -> int:
        """Bytes the shared prefix saves against paged blocks without sharing."""
        return self.strategies[1].reserved_bytes - self.strategies[2].reserved_bytes


def _filled_slots(caches: list[PagedCache]) -> int:
    """Slots that hold a position, over the distinct blocks of ``caches`` (a shared block once)."""
    filled: dict[int, int] = {}
    for cache in caches:
        for table in cache.tables:
            for n, block in enumerate(table):
                held = min(cache.block_size, cache.seq_len - n * cache.block_size)
                filled[block] = max(filled.get(block, 0), held)
    return sum(filled.values())


@torch.no_grad()
def measure_mix(model: Decoder, mix: RequestMix, block_size: int = 16) -> MixMemory:
    """Run every request of ``mix``, all held at once, under each strategy."""
    cfg, weight = model.config, model.wte.weight
    lengths = mix.lengths()
    if max(lengths) > cfg.n_positions:
        raise ValueError(f"a request of {max(lengths)} positions exceeds the model's "
                         f"{cfg.n_positions}")
    contiguous = sum(StaticCache(cfg, 1, cfg.n_positions, weight.dtype, weight.device).nbytes()
                     for _ in lengths)
    blocks = sum(-(-n // block_size) for n in lengths)  # enough for every request without sharing
    pool = BlockPool(cfg, blocks, block_size, weight.dtype, weight.device)
    position_bytes = pool.block_nbytes // block_size
    prefix = torch.tensor([mix.prefix], device=weight.device)

    def run(start: PagedCache | None, user: list[int],
            output: list[int]) -> tuple[PagedCache, torch.Tensor]:
        cache = PagedCache(pool, 1) if start is None else start.fork()
        chunks = [torch.tensor([t], device=weight.device) for t in (user, output)]
        if start is None:
            chunks.insert(0, prefix)
        logits = [model(chunk, cache).logits for chunk in chunks]  # writes in place
        return cache, torch.cat(logits, dim=1)

    paged = [run(None, u, o)[0] for u, o in zip(mix.users, mix.outputs, strict=True)]
    paged_mem = StrategyMemory("paged blocks", pool.num_used * pool.block_nbytes,
                               _filled_slots(paged) * position_bytes)
    for cache in paged:
        cache.release()

    shared_prefix = PagedCache(pool, 1)
    model(prefix, shared_prefix)
    runs = [run(shared_prefix, u, o) for u, o in zip(mix.users, mix.outputs, strict=True)]
    shared = [shared_prefix, *(cache for cache, _ in runs)]
    shared_mem = StrategyMemory("paged blocks, shared prefix", pool.num_used * pool.block_nbytes,
                                _filled_slots(shared) * position_bytes)
    contiguous_mem = StrategyMemory("contiguous, max length", contiguous,
                                    sum(lengths) * position_bytes)
    return MixMemory(len(lengths), sum(lengths), position_bytes, block_size,
                     (contiguous_mem, paged_mem, shared_mem), tuple(out for _, out in runs))
