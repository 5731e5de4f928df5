"""Context parallelism: one sequence's K/V split along the positions over ``cp`` ranks.

Position ``p`` lives on rank ``p mod cp`` (round robin, so decode steps fill the ranks evenly).
Every rank computes the new tokens' Q, K and V (the weights are not split by CP), keeps the K/V
rows of its own positions, and attends over only those: the unnormalised output, max and sum of
its chunk of keys, :func:`kvdoc.serving.splitk.partial_attention`. One all-gather per layer
brings every rank's ``(out, m, l)`` to every rank, and :func:`kvdoc.serving.splitk.merge`
combines them by the split-K rule, ``softmax = sum_r exp(m_r - m) out_r / sum_r exp(m_r - m) l_r``
with ``m = max_r m_r``: exactly the softmax over all keys, up to rounding.

>>> shard = ContextShard(Comm(rank=0, tp=1, cp=1))
>>> shard.held(5).tolist()              # one rank holds every position
[0, 1, 2, 3, 4]
"""

from __future__ import annotations

import math

import torch

from kvdoc.core.cache import KVCache
from kvdoc.serving.splitk import Partial, merge, partial_attention

from .comm import Comm


class ContextShard:
    """One rank's positions, and the attention over them merged across its CP group."""

    def __init__(self, comm: Comm) -> None:
        self.comm, self.cp, self.cp_rank = comm, comm.cp, comm.cp_rank

    def shard_of(self, cp_rank: int) -> int:
        """The shard (the residue ``p mod cp``) that rank ``cp_rank`` keeps: its own."""
        return cp_rank

    def held(self, end: int) -> torch.Tensor:
        """The positions ``< end`` this rank keeps, ascending (``[T_local]`` int64)."""
        return torch.arange(self.shard_of(self.cp_rank), end, self.cp)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
               layer_idx: int, start: int, window: int | None) -> torch.Tensor:
        """Softmax attention of ``q`` (``[B, H, C, D_h]``, positions ``start ..``) over every
        rank's keys, storing the rows of this rank's new positions (of ``k``, ``v``) in
        ``cache`` (which holds this rank's positions only)."""
        B, H, C, D = q.shape
        held = self.held(start + C)
        new = held[held >= start] - start  # which of the C new rows are this rank's
        k, v = k[:, :, new], v[:, :, new]
        if cache is not None:
            k, v = cache.update(layer_idx, k, v, cache.seq_len)  # local rows, in order
        else:
            held = held[held >= start]
        queries = torch.arange(start, start + C)[:, None]
        visible = held[None, :] <= queries  # [C, T_local]: causal in absolute positions
        if window is not None:
            visible &= held[None, :] > queries - window
        if k.shape[2] == 0:  # no key here yet: a chunk that hides everything
            part = Partial(q.new_zeros(B, H, C, D), q.new_full((B, H, C), -math.inf),
                           q.new_zeros(B, H, C))
        else:
            part = partial_attention(q, k, v, visible)
        packed = torch.cat((part.out, part.m[..., None], part.l[..., None]), dim=-1)
        parts = [Partial(p[..., :D], p[..., D], p[..., D + 1])
                 for p in self.comm.all_gather(packed)]  # every rank's, in CP-rank order
        return self.merge(parts)

    def merge(self, parts: list[Partial]) -> torch.Tensor:
        """The split-K merge of every rank's partial: ``[B, H, C, D_h]``."""
        return merge(parts)[0]
