"""Greedy decoding of one kvdoc :class:`~kvdoc.core.model.Decoder` over ``tp x cp`` ranks.

:func:`parallel_generate` is :func:`kvdoc.core.model.generate` with the model split over
``tp * cp`` processes: heads and MLP columns over ``tp`` (:mod:`kvdoc.parallel.tensor`),
positions over ``cp`` (:mod:`kvdoc.parallel.context`). Every rank keeps the embeddings, norms
and LM head whole, so every rank holds the same logits; rank 0's greedy token is broadcast so
that every rank feeds the same one. :func:`rank_kv_bytes` and :func:`collectives_per_call` are
what a rank's cache and communication must come to, from the layout alone;
:func:`who_holds` and :func:`holders_figure` say which rank caches which K/V row.

>>> import torch
>>> from kvdoc.core.model import Decoder, generate, llama_config
>>> _ = torch.manual_seed(0)
>>> model = Decoder(llama_config()).eval()
>>> prompt = torch.tensor([[5, 6, 7, 8]])
>>> run = parallel_generate(model, prompt, 4)          # tp = cp = 1: one rank, no processes
>>> torch.equal(run.tokens, generate(model, prompt, 4)), tuple(run.logits.shape)
(True, (1, 4, 97))
>>> collectives_per_call(llama_config(), tp=2, cp=2, decode=True)
{'all_reduce': 4, 'all_gather': 2, 'broadcast': 1}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from kvdoc.core.cache import DynamicLayer, KVCache, check_int
from kvdoc.core.mla import MLADecoder
from kvdoc.core.model import MLP, Block, CausalSelfAttention, Decoder, GPTConfig, embed_tokens
from kvdoc.measure.kv_bytes import kv_bytes, measured_bytes
from kvdoc.serving.requests import greedy

from .comm import Comm
from .context import ContextShard
from .launch import launch
from .tensor import ShardedAttention, ShardedMLP, check_tp, head_shard


class Parts(NamedTuple):
    """The classes a rank is built from: the checks swap in broken ones."""

    attention: type = ShardedAttention
    context: type = ContextShard


STANDARD = Parts()


def rank_kv_bytes(config: GPTConfig, tp: int, cp: int, rank: int, batch: int, seq_len: int,
                  dtype: torch.dtype = torch.float32) -> int:
    """K/V bytes rank ``rank`` holds after ``seq_len`` positions: ``2 x B x L x T_r x H_kv,r x D
    x s`` with its heads ``H_kv,r`` and positions ``T_r = ceil((T - c) / cp)`` (CP rank ``c``).

    >>> from kvdoc.core.model import GPTConfig
    >>> rank_kv_bytes(GPTConfig(), tp=2, cp=1, rank=0, batch=1, seq_len=10)  # 2 of 4 heads
    5120
    """
    cp_rank, tp_rank = divmod(rank, tp)
    heads = len(head_shard(config, tp, tp_rank).kv_heads)
    positions = max(0, -(-(seq_len - cp_rank) // cp))
    return kv_bytes(batch, config.n_layer, positions, heads, config.head_dim, dtype)


def collectives_per_call(config: GPTConfig, tp: int, cp: int, decode: bool) -> dict[str, int]:
    """One forward call's collectives on each rank: per layer two all-reduces under TP
    (attention, MLP), one all-gather under CP (partial softmaxes); a decode step's broadcast."""
    counts = {"all_reduce": 2 * config.n_layer if tp > 1 else 0,
              "all_gather": config.n_layer if cp > 1 else 0,
              "broadcast": 1 if decode and tp * cp > 1 else 0}
    return {kind: n for kind, n in counts.items() if n}


class Holding(NamedTuple):
    """What one rank of a ``tp x cp`` layout computes and caches."""

    rank: int
    q_heads: range
    kv_heads: range
    positions: range


def who_holds(config: GPTConfig, tp: int, cp: int, seq_len: int) -> list[Holding]:
    """Every rank's query heads, cached K/V heads and cached positions after ``seq_len``
    positions: the layout :class:`RankDecoder` builds, without starting a rank.

    >>> from kvdoc.core.model import llama_config
    >>> [(h.kv_heads, h.positions) for h in who_holds(llama_config(), 2, 2, 5)][-1]
    (range(1, 2), range(1, 5, 2))
    """
    check_tp(config, tp)
    check_int("cp", cp)
    return [Holding(r, shard.q_heads, shard.kv_heads, range(r // tp, seq_len, cp))
            for r in range(tp * cp)
            for shard in [head_shard(config, tp, r % tp)]]


def holders(config: GPTConfig, tp: int, cp: int, seq_len: int) -> list[list[list[int]]]:
    """``holders[k][p]``: the ranks whose cache holds K/V head ``k`` at position ``p``.

    >>> from kvdoc.core.model import llama_config
    >>> holders(llama_config(), tp=4, cp=1, seq_len=2)   # 2 K/V heads over 4 ranks
    [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]
    """
    grid: list[list[list[int]]] = [[[] for _ in range(seq_len)] for _ in range(config.n_kv_head)]
    for h in who_holds(config, tp, cp, seq_len):
        for k in h.kv_heads:
            for p in h.positions:
                grid[k][p].append(h.rank)
    return grid


def holders_figure(config: GPTConfig, layouts: Sequence[tuple[int, int]], seq_len: int):
    """One panel per ``(tp, cp)`` layout: K/V heads (rows) by positions (columns), each cell
    labelled with the ranks that cache it (:func:`holders`) and coloured by the first; a cell of
    two ranks is a replicated K/V head."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    # rows of 0.38 in: room for a 12 pt cell label (docs/_ext/matplotlibrc) above and below
    fig, axes = plt.subplots(len(layouts), 1, squeeze=False,
                             figsize=(6.6, 0.5 + (0.75 + 0.38 * config.n_kv_head) * len(layouts)))
    colours = ListedColormap(plt.get_cmap("tab10").colors[:8])
    for ax, (tp, cp) in zip(axes[:, 0], layouts, strict=True):
        grid = holders(config, tp, cp, seq_len)
        ax.imshow([[cell[0] for cell in row] for row in grid], cmap=colours, vmin=0, vmax=7,
                  aspect="auto")
        for k, row in enumerate(grid):
            for p, cell in enumerate(row):
                ax.text(p, k, ",".join(map(str, cell)), ha="center", va="center", color="white")
        ax.set_yticks(range(config.n_kv_head), [f"K/V head {k}" for k in range(config.n_kv_head)])
        ax.set_xticks(range(seq_len))
        ax.set_title(f"TP {tp} x CP {cp}: ranks holding each row")
    axes[-1, 0].set_xlabel("position")
    fig.tight_layout()
    return fig


class ShardedBlock(Block):
    """A :class:`~kvdoc.core.model.Block` (forward, norms) with one rank's attention and MLP."""

    def __init__(self, full: Block, attn: nn.Module, mlp: nn.Module) -> None:
        nn.Module.__init__(self)
        self.ln_1, self.attn, self.ln_2, self.mlp = full.ln_1, attn, full.ln_2, mlp


class RankDecoder(nn.Module):
    """One rank's decoder: the model's embeddings, norms and head, its share of every block."""

    def __init__(self, model: Decoder, comm: Comm, parts: Parts = STANDARD) -> None:
        super().__init__()
        self.config, self.comm = model.config, comm
        self.shard = head_shard(model.config, comm.tp, comm.tp_rank)
        self.context = parts.context(comm) if comm.cp > 1 else None
        self.wte, self.wpe = model.wte, model.wpe  # shared, not copied: every rank keeps them
        self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.h = nn.ModuleList(
            ShardedBlock(b, parts.attention(b.attn, self.shard, comm, self.context),
                         ShardedMLP(b.mlp, comm.tp, comm.tp_rank, comm)) for b in model.h)

    def new_cache(self, batch_size: int) -> KVCache:
        """An empty cache of this rank's K/V heads, growing with its positions."""
        weight = self.wte.weight
        return KVCache([DynamicLayer.empty(batch_size, len(self.shard.kv_heads),
                                           (self.config.head_dim,) * 2, weight.dtype,
                                           weight.device) for _ in self.h])

    def held(self, end: int) -> torch.Tensor:
        """The positions ``< end`` whose K/V this rank keeps."""
        return torch.arange(end) if self.context is None else self.context.held(end)

    def forward(self, idx: torch.Tensor, cache: KVCache,
                start: int) -> tuple[torch.Tensor, KVCache]:
        """Last-position logits ``[B, 1, V]`` of ``idx`` at positions ``start ..`` and this rank's
        cache with its new rows (``cache`` itself is left as it was)."""
        C = idx.shape[1]
        x = embed_tokens(self.wte, idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + C, device=idx.device))
        work = cache.begin()
        for layer_idx, block in enumerate(self.h):
            x = block(x, work, layer_idx, start)
        logits = self.lm_head(self.ln_f(x[:, -1:]))
        work.finish(len(self.held(start + C)))
        return logits, work


@dataclass
class RankResult:
    """What one rank computed and holds at the end of :func:`rank_generate`."""

    rank: int
    tp_rank: int
    cp_rank: int
    kv_heads: tuple[int, ...]
    """The K/V heads and the positions it cached."""
    positions: tuple[int, ...]
    tokens: torch.Tensor
    """``[B, P + N]``: the prompt and the tokens it fed (every rank's are rank 0's)."""
    logits: torch.Tensor
    """``[B, N, V]``: the logits each new token was chosen from."""
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Its cache: each layer's K and V, ``[B, len(kv_heads), len(positions), D_h]``."""
    cache_bytes: int
    collectives: list[dict[str, int]]
    """Collectives of each forward call: the prefill, then each decode step."""


@torch.no_grad()
def rank_generate(model: Decoder, prompt: torch.Tensor, max_new_tokens: int, comm: Comm,
                  parts: Parts = STANDARD) -> RankResult:
    """This rank's share of greedy generation: a prefill, then ``max_new_tokens - 1`` steps."""
    decoder = RankDecoder(model, comm, parts).eval()
    comm.take_counts()  # building the groups is not part of decoding
    logits, cache = decoder(prompt, decoder.new_cache(prompt.shape[0]), 0)
    collectives = [comm.take_counts()]

    def step(token: torch.Tensor, cache: KVCache, start: int) -> tuple[torch.Tensor, KVCache]:
        out = decoder(token, cache, start)
        collectives.append(comm.take_counts())
        return out
    tokens, chosen, cache = greedy(logits, cache, prompt, max_new_tokens, step, comm.broadcast)
    end = prompt.shape[1] + max_new_tokens - 1  # the last token is chosen, never fed
    return RankResult(comm.rank, comm.tp_rank, comm.cp_rank, tuple(decoder.shard.kv_heads),
                      tuple(decoder.held(end).tolist()), tokens, chosen,
                      [tuple(layer.tensors()) for layer in cache.layers], measured_bytes(cache),
                      collectives)


def _rank(rank: int, world_size: int, model: Decoder, prompt: torch.Tensor, max_new_tokens: int,
          tp: int, cp: int, parts: Parts) -> RankResult:
    return rank_generate(model, prompt, max_new_tokens, Comm(rank, tp, cp), parts)


class ParallelRun(NamedTuple):
    """What :func:`parallel_generate` returns: ``tokens`` ``[B, P + N]`` (as ``generate``),
    the ``logits`` ``[B, N, V]`` they were chosen from, and every rank's result."""

    tokens: torch.Tensor
    logits: torch.Tensor
    ranks: list[RankResult]


def nonstandard(model: object) -> str | None:
    """What keeps ``model`` from being split into heads over ranks; None when every layer is a
    ``Block`` of ``CausalSelfAttention`` (no q/k norms, ``H x D_h = d``) and ``MLP``.

    >>> from kvdoc.core.mla import MLAConfig, MLADecoder
    >>> nonstandard(MLADecoder(MLAConfig()))  # doctest: +ELLIPSIS
    'MLADecoder: its layer 0 is a LatentBlock of LatentAttention (a latent per ...'
    """
    name = type(model).__name__
    if not isinstance(model, Decoder):
        return f"{name} is not a kvdoc Decoder"
    standard = (Block, CausalSelfAttention, MLP)
    for i, b in enumerate(model.h):
        attn = getattr(b, "attn", None) or getattr(b, "self_attn", None)
        if (type(b), type(attn), type(getattr(b, "mlp", None))) != standard:
            latent = (" (a latent per position, not K/V heads: kvdoc.parallel.latent "
                      "splits it)" if isinstance(model, MLADecoder) else "")
            what = "without attention" if attn is None else f"of {type(attn).__name__}"
            return f"{name}: its layer {i} is a {type(b).__name__} {what}{latent}"
        if attn.qk_norm or attn.n_head * attn.head_dim != attn.c_attn.in_features:
            what = "q/k norms" if attn.qk_norm else "H x D_h != d"
            return f"{name}: its attention has {what} (Qwen3-style)"
    return None


def check_run(model: Decoder, prompt: torch.Tensor, max_new_tokens: int, tp: int,
              cp: int) -> None:
    """Raise ``ValueError`` for a layout or an input :func:`parallel_generate` cannot run."""
    why = nonstandard(model)
    if why is not None:
        raise ValueError("parallel decoding takes a kvdoc Decoder of standard attention blocks "
                         f"(GPT-2 or Llama style), got {why}")
    device = model.wte.weight.device
    if device.type != "cpu":  # the ranks talk over gloo, on CPU tensors
        raise ValueError(f"parallel decoding runs on CPU (gloo); the model is on {device}")
    check_tp(model.config, tp)
    check_int("cp", cp)
    model.check_input(prompt, None)
    embed_tokens(model.wte, prompt)  # an id outside the vocabulary: refused here, not on a rank
    check_int("max_new_tokens", max_new_tokens)
    total = prompt.shape[1] + max_new_tokens
    if total > model.config.n_positions:
        raise ValueError(f"prompt of {prompt.shape[1]} + {max_new_tokens} new tokens = {total} "
                         f"positions, model has {model.config.n_positions}")


def parallel_generate(model: Decoder, prompt: torch.Tensor, max_new_tokens: int, tp: int = 1,
                      cp: int = 1, *, parts: Parts = STANDARD) -> ParallelRun:
    """Greedy generation on ``tp * cp`` ranks, ``tp``-way tensor parallel and ``cp``-way context
    parallel: started here (gloo, CPU), or in the process group this process belongs to; a
    ValueError, before any rank starts, for what :func:`check_run` refuses."""
    check_run(model, prompt, max_new_tokens, tp, cp)
    ranks = launch(_rank, tp * cp, model, prompt, max_new_tokens, tp, cp, parts,
                   backend="gloo")  # CPU tensors: NCCL carries CUDA tensors only
    return ParallelRun(ranks[0].tokens, ranks[0].logits, ranks)
