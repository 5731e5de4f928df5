"""Tensor parallelism: a decoder's heads and MLP columns split over ``tp`` ranks.

Rank ``t`` of ``tp`` computes its ``H / tp`` query heads and caches only the K/V heads they read:
``H_kv / tp`` of them, or past ``H_kv`` one head that ``tp / H_kv`` ranks hold alike
(:func:`kvdoc.measure.costs.kv_heads_per_device`). The projections split the Megatron
way: ``c_attn`` and ``c_fc`` are column parallel (each rank computes its own outputs), the two
``c_proj`` row parallel (partial sums added by one all-reduce, the bias once after it), so a
layer costs two all-reduces per forward call.

>>> from kvdoc.core.model import llama_config
>>> head_shard(llama_config(), 2, 1)                 # GQA 4/2 over 2 ranks: rank 1
HeadShard(q_heads=range(2, 4), kv_heads=range(1, 2), replicas=1)
>>> head_shard(llama_config(n_kv_head=1), 2, 1)     # MQA: both ranks hold head 0
HeadShard(q_heads=range(2, 4), kv_heads=range(0, 1), replicas=2)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvdoc.core.cache import check_int
from kvdoc.core.model import MLP, CausalSelfAttention, GPTConfig, apply_rope
from kvdoc.measure.costs import kv_heads_per_device

from .comm import Comm


class HeadShard(NamedTuple):
    """The query heads one tensor-parallel rank computes, the K/V heads they read (which it
    caches) and how many ranks hold each of those (1: no replication)."""

    q_heads: range
    kv_heads: range
    replicas: int


def check_tp(config: GPTConfig, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` ranks can split ``config``'s heads and MLP evenly."""
    check_int("tp", tp)
    if config.n_head % tp:
        raise ValueError(f"tp={tp} does not divide n_head={config.n_head}: "
                         "each rank needs a whole number of query heads")
    if config.n_inner % tp:
        raise ValueError(f"tp={tp} does not divide the MLP width n_inner={config.n_inner}")
    kv_heads_per_device(config.n_kv_head, tp)  # H_kv and tp must divide one another


def head_shard(config: GPTConfig, tp: int, tp_rank: int) -> HeadShard:
    """Which query and K/V heads rank ``tp_rank`` of ``tp`` holds (see the module docstring)."""
    check_tp(config, tp)
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp - 1}")
    per_rank, replicas = kv_heads_per_device(config.n_kv_head, tp)
    q = config.n_head // tp
    first_kv = tp_rank * per_rank if replicas == 1 else tp_rank // replicas
    return HeadShard(range(tp_rank * q, (tp_rank + 1) * q),
                     range(first_kv, first_kv + per_rank), replicas)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    # built on the meta device, so no random initialisation is drawn (nor global RNG used)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer


def head_rows(heads: range, head_dim: int, offset: int = 0) -> list[int]:
    """The rows of ``heads``, each ``head_dim`` wide, in a projection's output (from ``offset``)."""
    return [offset + h * head_dim + i for h in heads for i in range(head_dim)]


class ShardedAttention(CausalSelfAttention):
    """One rank's share of a :class:`~kvdoc.core.model.CausalSelfAttention`: its heads only,
    ``[B, C, d]`` in and out (the row-parallel all-reduce inside). With a ``context``
    (:class:`~kvdoc.parallel.context.ContextShard`) it attends over this rank's positions,
    merged across the context-parallel group."""

    def __init__(self, full: CausalSelfAttention, shard: HeadShard, comm: Comm,
                 context: object | None = None) -> None:
        nn.Module.__init__(self)
        if full.qk_norm or full.n_head * full.head_dim != full.c_attn.in_features:
            raise ValueError("a sharded attention has no q/k norms and needs H * D_h = n_embd; "
                             "this one is Qwen3-style")
        self.head_dim, self.window, self.rope_theta = full.head_dim, full.window, full.rope_theta
        self.n_head, self.n_kv_head = len(shard.q_heads), len(shard.kv_heads)
        self.shard, self.comm, self.context = shard, comm, context
        D, d = full.head_dim, full.c_attn.in_features
        kv_dim = full.n_kv_head * D
        rows = (head_rows(shard.q_heads, D) + head_rows(shard.kv_heads, D, d)
                + head_rows(shard.kv_heads, D, d + kv_dim))
        bias = full.c_attn.bias
        self.c_attn = _linear(full.c_attn.weight[rows], None if bias is None else bias[rows])
        columns = head_rows(self.output_heads(comm), D)
        self.c_proj = _linear(full.c_proj.weight[:, columns], None)
        self.out_bias = None if full.c_proj.bias is None else full.c_proj.bias.detach().clone()

    def output_heads(self, comm: Comm) -> range:
        """The heads whose columns of ``c_proj`` this rank multiplies: its own query heads."""
        return self.shard.q_heads

    def forward(self, x: torch.Tensor, cache, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if attn_mask is not None or positions is not None:
            raise ValueError("a sharded attention takes one start per call, "
                             "no attn_mask or per-row positions")
        B, C, _ = x.shape
        H, H_kv = self.n_head, self.n_kv_head
        heads = self.c_attn(x).view(B, C, H + 2 * H_kv, self.head_dim).transpose(1, 2)
        q, k, v = heads.split((H, H_kv, H_kv), dim=1)  # this rank's heads only
        if self.rope_theta is not None:
            q = apply_rope(q, start, self.rope_theta)
            k = apply_rope(k, start, self.rope_theta)
        if self.context is None:
            if cache is not None:
                k, v = cache.update(layer_idx, k, v, start)
            y = self.attend(q, k, v, start)
        else:
            y = self.context.attend(q, k, v, cache, layer_idx, start, self.window)
        y = self.c_proj(y.transpose(1, 2).reshape(B, C, H * self.head_dim))
        y = self.comm.all_reduce(y)  # the partial sums of every rank's heads
        return y if self.out_bias is None else y + self.out_bias


class ShardedMLP(nn.Module):
    """One rank's ``1 / tp`` of an :class:`~kvdoc.core.model.MLP`'s hidden columns (SwiGLU's gate
    and up split alike, so hidden unit ``j`` still multiplies ``silu(gate_j)`` by ``up_j``)."""

    def __init__(self, full: MLP, tp: int, tp_rank: int, comm: Comm) -> None:
        super().__init__()
        self.swiglu, self.comm = full.swiglu, comm
        width = full.c_proj.in_features
        part = width // tp
        mine = list(range(tp_rank * part, (tp_rank + 1) * part))
        rows = mine + [width + j for j in mine] if self.swiglu else mine
        bias = full.c_fc.bias
        self.c_fc = _linear(full.c_fc.weight[rows], None if bias is None else bias[rows])
        self.c_proj = _linear(full.c_proj.weight[:, mine], None)
        self.out_bias = None if full.c_proj.bias is None else full.c_proj.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(self.c_fc(x), approximate="tanh")
        y = self.comm.all_reduce(self.c_proj(hidden))
        return y if self.out_bias is None else y + self.out_bias
