"""The collectives one rank calls, on a ``cp x tp`` mesh of ranks, each call counted.

Rank ``r`` sits at ``(cp_rank, tp_rank) = divmod(r, tp)``: its tensor-parallel group is the
``tp`` ranks of its row, its context-parallel group the ``cp`` ranks of its column. A group of
one rank returns its input and counts nothing, so with ``tp = cp = 1`` a :class:`Comm` needs no
process group. ``counts`` tallies the calls by kind, so a run can check each decode step's
collectives against what the layout needs.

>>> comm = Comm(rank=0, tp=1, cp=1)
>>> comm.tp_rank, comm.cp_rank, comm.all_reduce(torch.ones(2)).tolist(), dict(comm.counts)
(0, 0, [1.0, 1.0], {})
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from kvdoc.core.cache import check_int


class Comm:
    """One rank's place on the mesh and its counted collectives; every rank must build its own
    with the same ``tp`` and ``cp`` (creating the groups is itself collective). A ``tp_group``
    made by the caller serves a mesh inside a larger world (a hand-over's prefill ranks)."""

    def __init__(self, rank: int, tp: int, cp: int, tp_group: object = None) -> None:
        self.tp, self.cp = check_int("tp", tp), check_int("cp", cp)
        self.world_size = tp * cp
        self.rank = check_int("rank", rank, minimum=0)
        if rank >= self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {tp} x {cp} ranks")
        self.cp_rank, self.tp_rank = divmod(rank, tp)
        self.counts: Counter[str] = Counter()
        self.tp_group, self.cp_group = tp_group, None
        if self.world_size > 1 and tp_group is None:
            # every rank creates every group, in one order, as new_group requires
            for row in range(cp):
                group = dist.new_group([row * tp + t for t in range(tp)])
                if row == self.cp_rank:
                    self.tp_group = group
            for column in range(tp):
                group = dist.new_group([c * tp + column for c in range(cp)])
                if column == self.tp_rank:
                    self.cp_group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over this rank's tensor-parallel group (in place)."""
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
            self.counts["all_reduce"] += 1
        return x

    def all_gather(self, x: torch.Tensor, tp: bool = False) -> list[torch.Tensor]:
        """``x`` of every rank of this rank's context-parallel group (tensor-parallel with
        ``tp``), in rank order."""
        n, group = (self.tp, self.tp_group) if tp else (self.cp, self.cp_group)
        if n == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        self.counts["all_gather"] += 1
        return parts

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place): the one token every rank feeds next."""
        if self.world_size > 1:
            dist.broadcast(x, src=0)
            self.counts["broadcast"] += 1
        return x

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call, then zero."""
        counts, self.counts = dict(self.counts), Counter()
        return counts
