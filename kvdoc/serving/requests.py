"""The requests a scheduler serves (:class:`Request`, a seeded :func:`arrival_trace`), how
each sequence picks its next token (:func:`choose`), the greedy loop after a prefill
(:func:`greedy`), and what a run records: a :class:`StepRecord` a step, whose block bookkeeping
:attr:`ServeRun.invariants_hold` checks after the fact."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvdoc.core.cache import KVCache


@dataclass(frozen=True)
class Request:
    """A request of a trace: ``rid``, ``prompt``, ``output_len``, the step it may be admitted
    from; it forks into ``samples`` sequences, sample ``j`` seeded ``seed + j`` (None: greedy)."""

    rid: int
    prompt: tuple[int, ...]
    output_len: int
    arrival: int
    samples: int = 1
    seed: int | None = None

    @property
    def final_len(self) -> int:
        """Positions its cache holds when it finishes: the last token is chosen, never fed."""
        return len(self.prompt) + self.output_len - 1

    def blocks_needed(self, block_size: int) -> int:
        """Most blocks it holds at once: the prompt's full blocks once, shared by its samples,
        and every other block of its final length once per sample.

        >>> Request(0, (1,) * 6, 3, 0, samples=4, seed=0).blocks_needed(4)  # 1 + 4 * (2 - 1)
        5
        """
        shared = len(self.prompt) // block_size
        return shared + self.samples * (math.ceil(self.final_len / block_size) - shared)


def sample_generator(request: Request, sample: int = 0) -> torch.Generator | None:
    """The generator sample ``sample`` of ``request`` draws from (None: greedy)."""
    if request.seed is None:
        return None
    return torch.Generator().manual_seed(request.seed + sample)


def choose(logits: torch.Tensor, generator: torch.Generator | None) -> int:
    """The next token from ``[V]`` logits: the argmax without a generator; with one, a draw
    from ``softmax(logits)`` by the Gumbel-max trick, ``argmax(logits - log(-log U))``, ``U``
    uniform from ``generator`` in float64 on the CPU (the same draw on any device).

    >>> logits = torch.tensor([0.0, 3.0, 1.0])
    >>> choose(logits, None), choose(logits, torch.Generator().manual_seed(0))
    (1, 1)
    """
    if generator is None:
        return int(logits.argmax())
    u = torch.rand(logits.shape[-1], generator=generator, dtype=torch.float64)
    return int((logits.detach().double().cpu() - torch.log(-torch.log(u))).argmax())


def random_ids(g: torch.Generator, n: int | tuple[int, int], vocab: int,
               low: int = 0) -> tuple[int, ...]:
    """``n`` token ids (or a count drawn from ``(least, most)``) uniform on ``low .. vocab - 1``."""
    if isinstance(n, tuple):
        n = int(torch.randint(n[0], n[1] + 1, (), generator=g))
    return tuple(torch.randint(low, vocab, (n,), generator=g).tolist())


def arrival_trace(n: int = 8, prompt_lens: tuple[int, int] = (2, 16),
                  output_lens: tuple[int, int] = (1, 12), max_gap: int = 3,
                  vocab_size: int = 97, seed: int = 0) -> list[Request]:
    """``n`` requests: prompt and output lengths uniform on the inclusive ranges, token ids uniform
    on the vocabulary, the first arriving at step 0 and each next one after a gap uniform on
    ``0 .. max_gap`` steps, all from ``torch.Generator`` seed ``seed``.

    >>> trace = arrival_trace(3, prompt_lens=(1, 2), output_lens=(3, 3), max_gap=0)
    >>> [r.arrival for r in trace], trace == arrival_trace(3, (1, 2), (3, 3), 0)
    ([0, 0, 0], True)
    """
    if (n < 1 or max_gap < 0 or not 1 <= prompt_lens[0] <= prompt_lens[1]
            or not 1 <= output_lens[0] <= output_lens[1]):
        raise ValueError("need n >= 1, max_gap >= 0 and ranges (lo, hi) with 1 <= lo <= hi")
    g = torch.Generator().manual_seed(seed)

    def uniform(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    trace, step = [], 0
    for rid in range(n):
        step += uniform(0, max_gap) if rid else 0
        prompt = random_ids(g, prompt_lens, vocab_size)
        trace.append(Request(rid, prompt, uniform(*output_lens), step))
    return trace


def greedy(logits: torch.Tensor, cache: KVCache, prompt: torch.Tensor, max_new_tokens: int,
           step: Callable, choose: Callable = lambda token: token
           ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """Greedy decoding after a prefill's ``logits`` and ``cache``: ``(tokens [B, P + N],
    logits [B, N, V], cache)``, each token ``choose(argmax)`` (rank 0's broadcast, say) and, but
    the last, fed by ``step(token, cache, position)``: serving's and parallel decoding's loop."""
    fed, chosen = [prompt], []
    for i in range(max_new_tokens):
        chosen.append(logits[:, -1])
        fed.append(choose(logits[:, -1].argmax(dim=-1, keepdim=True)))
        if i + 1 < max_new_tokens:
            logits, cache = step(fed[-1], cache, prompt.shape[1] + i)
    return torch.cat(fed, dim=1), torch.stack(chosen, dim=1), cache


@dataclass(frozen=True)
class StepRecord:
    """One step of a run: ``(rid, new tokens, kind)`` per row of the forward; rids ``waiting``
    (arrived, not admitted) and ``holding`` (admitted, not in the forward); after the step, the
    blocks held, named by the live tables and free; ``lengths_ok``: every live table covers
    exactly its written positions; ``refs_ok``: every reference count is the number of live
    tables naming the block; ``(rid, positions discarded)`` per preemption."""

    step: int
    rows: tuple[tuple[int, int, str], ...]
    waiting: tuple[int, ...]
    holding: tuple[int, ...]
    blocks_held: int
    blocks_named: int
    blocks_free: int
    lengths_ok: bool
    refs_ok: bool = True
    preempted: tuple[tuple[int, int], ...] = ()

    @property
    def occupancy(self) -> int:
        """Rows in this step's forward."""
        return len(self.rows)

    @property
    def tokens(self) -> int:
        """New tokens this step's forward processed."""
        return sum(n for _, n, _ in self.rows)


@dataclass(frozen=True)
class ServeRun:
    """What :meth:`Scheduler.run` returns: by rid, its (first sample's) tokens, their logits
    ``[output_len, V]`` and the step each came out; a :class:`StepRecord` per step; by ``(rid,
    sample)``, every sample's tokens and logits."""

    policy: str
    token_budget: int | None
    num_blocks: int
    block_nbytes: int
    tokens: dict[int, list[int]]
    logits: dict[int, torch.Tensor]
    emitted: dict[int, list[int]]
    steps: list[StepRecord]
    samples: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    sample_logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def invariants_hold(self) -> bool:
        """At every step: blocks held == blocks the tables name, free + held == the pool,
        reference counts == holders (:attr:`StepRecord.refs_ok`), every request's cache length
        is its tokens so far (:attr:`StepRecord.lengths_ok`); at the end every block free."""
        return all(s.blocks_held == s.blocks_named and s.blocks_free + s.blocks_held
                   == self.num_blocks and s.lengths_ok and s.refs_ok for s in self.steps
                   ) and self.steps[-1].blocks_free == self.num_blocks

    @property
    def preemptions(self) -> int:
        """Requests preempted over the run (one request may be preempted more than once)."""
        return sum(len(s.preempted) for s in self.steps)

    @property
    def recomputed(self) -> int:
        """Positions whose K/V a preemption discarded and a later prefill computed again."""
        return sum(n for s in self.steps for _, n in s.preempted)

    @property
    def blocks_peak(self) -> int:
        """Most blocks held after any step."""
        return max(s.blocks_held for s in self.steps)

    def decode_gaps(self) -> list[int]:
        """Steps between consecutive tokens of one request, over every request."""
        return [b - a for e in self.emitted.values() for a, b in zip(e, e[1:], strict=False)]

    def memory_bytes(self) -> list[int]:
        """Cache memory held after each step: blocks held * bytes per block."""
        return [s.blocks_held * self.block_nbytes for s in self.steps]

    def composition(self, trace: Sequence[Request]) -> torch.Tensor:
        """``[requests, steps]`` int: 0 not arrived or gone, 1 waiting, 2 holding blocks outside
        the forward, 3 prefill, 4 decode, 5 recompute (the batch's composition over time)."""
        grid = torch.zeros(len(trace), len(self.steps), dtype=torch.long)
        for s in self.steps:
            grid[list(s.waiting), s.step] = 1
            grid[list(s.holding), s.step] = 2
            for rid, _, kind in s.rows:
                grid[rid, s.step] = {"prefill": 3, "decode": 4, "recompute": 5}[kind]
        return grid
