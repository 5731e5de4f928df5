"""Deliberately wrong parts of parallel decoding (:mod:`kvdoc.parallel`), each one method off.

* :class:`WrongShard`: under context parallelism the last rank keeps and attends over rank 0's
  positions instead of its own (rank 0's keys counted twice, the last rank's never).
* :class:`DroppedMax`: the split-K merge adds the ranks' partial sums without rescaling each by
  ``exp(m_r - m)``, as if every rank's max were the global one.
* :class:`ReversedHeads`: under tensor parallelism each rank's head outputs meet the mirror rank's
  columns of ``c_proj``: the heads gathered in reversed rank order.

:data:`BROKEN` maps a name to the parts (:class:`kvdoc.parallel.decode.Parts`) and the layout
``(tp, cp)`` on which the wrong part runs. :func:`kvdoc.parallel.comparison.compare` catches each;
``tests/test_parallel.py`` shows it.

* :func:`swapped_destination`: the block hand-over (:mod:`kvdoc.parallel.blocks`) puts prefill
  rank ``t``'s K/V heads into the slots of rank ``tp - 1 - t``'s: heads in the wrong order on the
  decode rank. :data:`HANDOVER_BROKEN` names it; :func:`kvdoc.parallel.blocks.handover_jobs`
  catches it (``tests/test_blocks.py``).
* :func:`stale_ids`: a pulling decode rank asks for the block before each one it lacks (an id
  from a table one block out of date) and writes the answers where the blocks it lacks go.
  :data:`PULL_BROKEN` names it with the pull it runs on (its blocks all full, so that each
  answer fits the slot it lands in).

* :class:`OtherRequests`: under DP-attention (:mod:`kvdoc.parallel.latent`) the last rank holds
  and attends over rank 0's requests' latents instead of its own (its own are never served).
* :func:`latent_bytes_once`: the bytes rule that counts the TP-replicated latent once for all
  ranks (each rank ``1 / n`` of it, as if the latent split like K/V heads).
  :data:`LATENT_BROKEN` names both; :func:`kvdoc.parallel.latent.latent_jobs` catches each
  (``tests/test_latent.py``).

>>> sorted(BROKEN)
['parallel-dropped-max', 'parallel-reversed-heads', 'parallel-wrong-shard']
>>> sorted(HANDOVER_BROKEN)
['handover-swapped-heads']
>>> stale_ids(range(1, 3))
[0, 1]
>>> sorted(LATENT_BROKEN)
['latent-bytes-once', 'latent-other-requests']
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvdoc.core.config import GPTConfig
from kvdoc.parallel.blocks import destination
from kvdoc.parallel.comm import Comm
from kvdoc.parallel.context import ContextShard
from kvdoc.parallel.decode import Parts
from kvdoc.parallel.latent import RequestSplit, latent_rank_bytes
from kvdoc.parallel.tensor import ShardedAttention
from kvdoc.serving.splitk import Partial


class WrongShard(ContextShard):
    """The last CP rank holds shard 0 (rank 0's positions) instead of its own."""

    def shard_of(self, cp_rank: int) -> int:
        return 0 if cp_rank == self.cp - 1 else cp_rank


class DroppedMax(ContextShard):
    """Merges ``sum_r out_r / sum_r l_r``: each rank's max dropped from the rescaling."""

    def merge(self, parts: list[Partial]) -> torch.Tensor:
        out = torch.stack([p.out for p in parts]).sum(dim=0)
        l = torch.stack([p.l for p in parts]).sum(dim=0)  # noqa: E741
        return out / l[..., None]


class ReversedHeads(ShardedAttention):
    """Multiplies its heads' outputs by the ``c_proj`` columns of TP rank ``tp - 1 - t``."""

    def output_heads(self, comm: Comm) -> range:
        mirror = comm.tp - 1 - comm.tp_rank
        per_rank = len(self.shard.q_heads)
        return range(mirror * per_rank, (mirror + 1) * per_rank)


class BrokenLayout(NamedTuple):
    """A broken part and the layout it needs to run (and be caught) on."""

    parts: Parts
    tp: int
    cp: int
    breaks: str


BROKEN: dict[str, BrokenLayout] = {
    "parallel-wrong-shard": BrokenLayout(Parts(context=WrongShard), 1, 2,
                                         "the last CP rank attends over rank 0's positions"),
    "parallel-dropped-max": BrokenLayout(Parts(context=DroppedMax), 1, 2,
                                         "the split-K merge drops each rank's max"),
    "parallel-reversed-heads": BrokenLayout(Parts(attention=ReversedHeads), 2, 1,
                                            "TP heads gathered in reversed rank order"),
}
"""Name -> the broken parts, their layout and what is wrong."""


def swapped_destination(config: GPTConfig, tp: int, tp_rank: int) -> list[int]:
    """Rank ``tp_rank``'s message written into the heads of rank ``tp - 1 - tp_rank``."""
    return destination(config, tp, tp - 1 - tp_rank)


HANDOVER_BROKEN: dict[str, object] = {"handover-swapped-heads": swapped_destination}
"""Name -> the broken ``place`` of :func:`kvdoc.parallel.blocks.handover_jobs` (run at TP = 2
on a model with at least two K/V heads, so that the two ranks hold different heads)."""


class OtherRequests(RequestSplit):
    """The last DP-attention rank takes rank 0's requests."""

    def requests(self, batch: int, ranks: int, rank: int) -> range:
        return super().requests(batch, ranks, 0 if rank == ranks - 1 else rank)


def latent_bytes_once(config, mode: str, ranks: int, rank: int, batch: int, seq_len: int,
                      dtype: torch.dtype = torch.float32) -> int:
    """The latent counted once for all ranks: every rank ``1 / ranks`` of the whole."""
    return latent_rank_bytes(config, "tp", ranks, rank, batch, seq_len, dtype) // ranks


class BrokenLatent(NamedTuple):
    """A broken part of a latent run, the layout it runs on and what is wrong."""

    mode: str
    split: type
    bytes_rule: object
    breaks: str


LATENT_BROKEN: dict[str, BrokenLatent] = {
    "latent-other-requests": BrokenLatent("dp", OtherRequests, latent_rank_bytes,
                                          "the last DP rank attends over rank 0's requests"),
    "latent-bytes-once": BrokenLatent("tp", RequestSplit, latent_bytes_once,
                                      "the replicated latent counted once for all ranks"),
}
"""Name -> the broken split or bytes rule of a :class:`kvdoc.parallel.latent.LatentJob`."""


def stale_ids(blocks: range) -> list[int]:
    """The ids one block behind those the decode rank lacks."""
    return [i - 1 for i in blocks]


PULL_BROKEN: dict[str, dict[str, object]] = {
    "handover-stale-pull": {"mode": "recompute", "transfer": "pull", "have": 1,
                            "ask": stale_ids},
}
"""Name -> the fields of a :class:`kvdoc.parallel.blocks.Handover` that break it (run with a
prompt whose sent positions are whole blocks: 9 tokens in blocks of 4 in ``"recompute"``)."""
