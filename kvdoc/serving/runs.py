"""What a scheduler's run records: one :class:`StepRecord` a step, and the :class:`ServeRun`.

The records carry the block bookkeeping of every step (blocks held, named by the tables, free,
reference counts), so a run can be checked against its invariants after the fact
(:attr:`ServeRun.invariants_hold`), and what each request produced, to compare with its solo run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .requests import Request


@dataclass(frozen=True)
class StepRecord:
    """One step of a run.

    Attributes:
        step: its index. rows: ``(rid, new tokens, kind)`` per row of the forward, kind
            ``"prefill"``, ``"recompute"`` (a preempted request prefilling again) or
            ``"decode"``.
        waiting: rids arrived but not admitted. holding: rids admitted, not in this forward.
        blocks_held: ``pool.num_used`` after the step (finished requests retired).
        blocks_named: distinct blocks the live requests' tables name. blocks_free: the free list.
        lengths_ok: every live request's table covers exactly its written positions, and one
            that has tokens and was never preempted has written prompt + tokens - 1 of them.
        refs_ok: every block's reference count is the number of live tables naming it.
        preempted: ``(rid, positions discarded)`` per request preempted in this step.
    """

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
    """What :meth:`Scheduler.run` returns.

    Attributes:
        policy, token_budget: how it was scheduled. num_blocks, block_nbytes: the pool.
        tokens: rid -> its tokens (its first sample's). logits: rid -> ``[output_len, V]``,
            behind each token. emitted: rid -> the step each token came out.
        steps: one :class:`StepRecord` per step.
        samples, sample_logits: ``(rid, sample)`` -> tokens and logits, every sample of every
            request.
    """

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
