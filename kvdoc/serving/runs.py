"""What a scheduler's run records: one :class:`StepRecord` a step, and the :class:`ServeRun`.

The records carry every step's block bookkeeping, checked after the fact
(:attr:`ServeRun.invariants_hold`), and what each request produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .requests import Request


@dataclass(frozen=True)
class StepRecord:
    """One step of a run: ``rows``, ``(rid, new tokens, kind)`` per row of the forward (kind
    ``"prefill"``, ``"recompute"`` or ``"decode"``); rids ``waiting`` (arrived, not admitted)
    and ``holding`` (admitted, not in the forward); after the step, ``pool.num_used``, the
    distinct blocks the live tables name and the free list; ``lengths_ok``: every live table
    covers exactly its written positions (prompt + tokens - 1 unless preempted); ``refs_ok``:
    every reference count is the number of live tables naming the block; ``(rid, positions
    discarded)`` per preemption."""

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
