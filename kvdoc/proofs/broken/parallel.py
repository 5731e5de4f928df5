"""Deliberately wrong parts of parallel decoding (:mod:`kvdoc.parallel`), each one method off:
:data:`BROKEN` (parts of :class:`kvdoc.parallel.decode.Parts` and the layout they run on),
:data:`HANDOVER_BROKEN` and :data:`PULL_BROKEN` (a hand-over of blocks), :data:`LATENT_BROKEN`
(MLA's latent under TP and DP-attention).

>>> sorted(BROKEN)  # doctest: +NORMALIZE_WHITESPACE
['parallel-bias-first-rows', 'parallel-cp-no-window', 'parallel-dropped-max',
 'parallel-replica-tiled', 'parallel-reversed-heads', 'parallel-wrong-shard']
>>> sorted(HANDOVER_BROKEN)
['handover-swapped-heads']
>>> stale_ids(range(1, 3))
[0, 1]
>>> sorted(LATENT_BROKEN)
['latent-bytes-once', 'latent-other-requests', 'latent-query-at-lora-rank']
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvdoc.core.model import GPTConfig
from kvdoc.parallel.blocks import destination
from kvdoc.parallel.comm import Comm
from kvdoc.parallel.context import ContextShard
from kvdoc.parallel.decode import Parts
from kvdoc.parallel.latent import RequestSplit, latent_rank_bytes, take_heads
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


class NoWindowShard(ContextShard):
    """A CP rank that attends over every earlier key of its positions, the window dropped."""

    def attend(self, q, k, v, cache, layer_idx, start, window):
        return super().attend(q, k, v, cache, layer_idx, start, None)  # BUG: no window


class FirstRowsBiasAttention(ShardedAttention):
    """A TP rank whose ``c_attn`` bias is the full bias's first rows, not its heads' rows."""

    def __init__(self, full, shard, comm, context=None) -> None:
        super().__init__(full, shard, comm, context)
        if full.c_attn.bias is not None:
            rows = self.c_attn.weight.shape[0]
            self.c_attn.bias = torch.nn.Parameter(full.c_attn.bias[:rows].detach().clone(),
                                                  requires_grad=False)  # BUG: not its rows


class TiledReplicaAttention(ShardedAttention):
    """Past ``H_kv`` ranks, rank ``t`` computes K/V head ``t % H_kv``, not its group's."""

    def __init__(self, full, shard, comm, context=None) -> None:
        if shard.replicas > 1:
            head = comm.tp_rank % full.n_kv_head  # BUG: tiled, not by group
            shard = shard._replace(kv_heads=range(head, head + 1))
        super().__init__(full, shard, comm, context)


class BrokenLayout(NamedTuple):
    parts: Parts
    tp: int
    cp: int
    breaks: str
    model: str = "llama"
    """The model of :data:`kvdoc.parallel.comparison.MODELS` it runs on: one whose
    configuration reaches the broken branch."""


BROKEN: dict[str, BrokenLayout] = {
    "parallel-wrong-shard": BrokenLayout(Parts(context=WrongShard), 1, 2,
                                         "the last CP rank attends over rank 0's positions"),
    "parallel-dropped-max": BrokenLayout(Parts(context=DroppedMax), 1, 2,
                                         "the split-K merge drops each rank's max"),
    "parallel-reversed-heads": BrokenLayout(Parts(attention=ReversedHeads), 2, 1,
                                            "TP heads gathered in reversed rank order"),
    "parallel-cp-no-window": BrokenLayout(Parts(context=NoWindowShard), 1, 2,
                                          "CP ranks attend past the model's window", "mistral"),
    "parallel-bias-first-rows": BrokenLayout(Parts(attention=FirstRowsBiasAttention), 2, 1,
                                             "each TP rank takes the first rows of the Q/K/V "
                                             "bias, not its heads'", "qwen2"),
    # 4 ranks over 2 K/V heads: each head on 2 ranks (``--thorough``)
    "parallel-replica-tiled": BrokenLayout(Parts(attention=TiledReplicaAttention), 4, 1,
                                           "replicated K/V heads assigned by tiling, not by "
                                           "group", "llama"),
}


def swapped_destination(config: GPTConfig, tp: int, tp_rank: int) -> list[int]:
    """Rank ``tp_rank``'s message written into the heads of rank ``tp - 1 - tp_rank``."""
    return destination(config, tp, tp - 1 - tp_rank)


HANDOVER_BROKEN: dict[str, object] = {"handover-swapped-heads": swapped_destination}
"""Name -> the broken ``place`` of a hand-over (at TP = 2, two K/V heads or more)."""


class OtherRequests(RequestSplit):
    """The last DP-attention rank takes rank 0's requests."""

    def requests(self, batch: int, ranks: int, rank: int) -> range:
        return super().requests(batch, ranks, 0 if rank == ranks - 1 else rank)


def latent_bytes_once(config, mode: str, ranks: int, rank: int, batch: int, seq_len: int,
                      dtype: torch.dtype = torch.float32) -> int:
    """The latent counted once for all ranks: every rank ``1 / ranks`` of the whole."""
    return latent_rank_bytes(config, "tp", ranks, rank, batch, seq_len, dtype) // ranks


def query_at_lora_rank(full, comm: Comm):
    """A TP rank's heads whose query rows, under a query LoRA, start at
    ``t x H/n x (q_lora_rank + d_R)``, not ``t x H/n x (d_nope + d_R)``."""
    mine, c = take_heads(full, comm), full.config
    if c.q_lora_rank is not None:
        per_rank = c.n_head // comm.tp
        first = comm.tp_rank * per_rank * (c.q_lora_rank + c.qk_rope_head_dim)  # BUG
        rows = full.q_b_proj.weight[first:first + per_rank * c.qk_head_dim]
        mine.q_b_proj.weight.data.copy_(rows)
    return mine


class BrokenLatent(NamedTuple):
    mode: str
    split: type
    bytes_rule: object
    breaks: str
    heads: object = take_heads
    widths_differ: bool = False
    """Run on :data:`kvdoc.parallel.latent.WIDE`, whose widths all differ, not on the
    site's latent model."""


LATENT_BROKEN: dict[str, BrokenLatent] = {
    "latent-other-requests": BrokenLatent("dp", OtherRequests, latent_rank_bytes,
                                          "the last DP rank attends over rank 0's requests"),
    "latent-bytes-once": BrokenLatent("tp", RequestSplit, latent_bytes_once,
                                      "the replicated latent counted once for all ranks"),
    "latent-query-at-lora-rank": BrokenLatent(
        "tp", RequestSplit, latent_rank_bytes, "TP ranks find their query rows at the "
        "query LoRA's rank, not the key's non-rotary width", query_at_lora_rank,
        widths_differ=True),
}


def stale_ids(blocks: range) -> list[int]:
    """The ids one block behind those the decode rank lacks."""
    return [i - 1 for i in blocks]


PULL_BROKEN: dict[str, dict[str, object]] = {
    "handover-stale-pull": {"mode": "recompute", "transfer": "pull", "have": 1,
                            "ask": stale_ids},
}
"""Name -> the :class:`kvdoc.parallel.blocks.Handover` fields that break it (sent positions
whole blocks: 9 tokens in blocks of 4, ``"recompute"``)."""
