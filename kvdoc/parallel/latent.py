"""DP-attention for a latent cache: an MLA model's latent under TP against requests split
over ranks.

An MLA layer (:mod:`kvdoc.core.mla`) caches one latent per position that every head reads.
Tensor parallelism (``"tp"``) splits the heads over ``n`` ranks, but each needs the whole
latent: every rank caches all of it, for every request. Data-parallel attention (``"dp"``)
splits the batch instead: rank ``r`` runs every head for its own ``B / n`` requests
(:meth:`RequestSplit.requests`) and caches only their latents, ``n`` times less
(:func:`latent_rank_bytes`). The MLP stays tensor parallel: each rank all-gathers every rank's
rows, runs its ``1 / n`` of the columns and keeps its own rows.

>>> from kvdoc.core.mla import MLAConfig
>>> latent_rank_bytes(MLAConfig(), "tp", ranks=2, rank=1, batch=4, seq_len=10)  # 4 x 10 x 320
12800
>>> latent_rank_bytes(MLAConfig(), "dp", ranks=2, rank=1, batch=4, seq_len=10)  # 2 requests
6400
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import nn

from kvdoc.core.cache import KVCache, check_int
from kvdoc.core.mla import LatentAttention, LatentBlock, MLAConfig, MLADecoder
from kvdoc.core.model import decode_step, generate, prefill
from kvdoc.measure.kv_bytes import measured_bytes
from kvdoc.measure.model_caches import config_cache

from .comm import Comm
from .comparison import MARK, TOLERANCE, reference, rows_close
from .decode import greedy
from .launch import launch
from .tensor import ShardedMLP, head_rows

MODES = ("tp", "dp")
"""``"tp"``: heads split, the latent replicated; ``"dp"``: requests split (DP-attention)."""


def _check(mode: str, ranks: int, batch: int) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown latent layout {mode!r}; known: {', '.join(MODES)}")
    check_int("ranks", ranks)
    if mode == "dp" and check_int("batch", batch) % ranks:
        raise ValueError(f"DP-attention splits the batch evenly: batch {batch} over {ranks} "
                         "ranks")


class RequestSplit:
    """Which requests a DP-attention rank holds: the hook a broken variant overrides."""

    def requests(self, batch: int, ranks: int, rank: int) -> range:
        """Rank ``rank``'s ``batch / ranks`` consecutive requests.

        >>> RequestSplit().requests(batch=4, ranks=2, rank=1)
        range(2, 4)
        """
        per_rank = batch // ranks
        return range(rank * per_rank, (rank + 1) * per_rank)


def latent_rank_bytes(config: MLAConfig, mode: str, ranks: int, rank: int, batch: int, seq_len: int,
                      dtype: torch.dtype = torch.float32) -> int:
    """Latent bytes rank ``rank`` holds after ``seq_len`` positions (``B x T x L x (r + d_R) x
    s`` under ``"tp"``; its ``batch / ranks`` requests' under ``"dp"``)."""
    _check(mode, ranks, batch)
    held = batch if mode == "tp" else len(RequestSplit().requests(batch, ranks, rank))
    return config_cache(config).kv_bytes(seq_len, held, dtype)


WIDE = MLAConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=48, n_inner=96,
                 q_lora_rank=8, kv_lora_rank=24, qk_nope_head_dim=10,
                 qk_rope_head_dim=6, v_head_dim=18)
"""An MLA model whose widths all differ, and their sums (``d_nope + d_R = 16``, ``d_nope +
d_v = 28``, ``r + d_R = 30``), its query through a LoRA: a head split that takes one width for
another moves rows here, where the site's model (no query LoRA, ``d_nope = d_v = r / 2``) and
the grid's (``q_lora_rank = d_nope``) run it right. ``q_lora_rank < d_nope < d_v``: rows found
at the smaller width still fit, so the mix-up changes numbers instead of raising.

>>> w = (WIDE.q_lora_rank, WIDE.qk_nope_head_dim, WIDE.qk_rope_head_dim, WIDE.v_head_dim,
...      WIDE.kv_lora_rank)
>>> len(set(w)) == len(w), WIDE.q_lora_rank < WIDE.qk_nope_head_dim < WIDE.v_head_dim
(True, True)
"""


def latent_model(seed: int = 0, config: MLAConfig | None = None) -> MLADecoder:
    """The site's small :class:`~kvdoc.core.mla.MLADecoder` (4 heads, a latent of 32 + 8), or
    one of ``config``, weights from ``torch.manual_seed(seed)``, in eval mode."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return MLADecoder(config or MLAConfig()).eval()


def take_heads(full: LatentAttention, comm: Comm) -> LatentAttention:
    """Rank ``comm.tp_rank``'s ``H / n`` heads of ``full``; the latent's projections
    whole (the hook a broken variant overrides)."""
    c = full.config
    per_rank = c.n_head // comm.tp
    heads = range(comm.tp_rank * per_rank, (comm.tp_rank + 1) * per_rank)
    mine = LatentAttention(replace(c, n_head=per_rank))
    state = {k: v.clone() for k, v in full.state_dict().items()}
    q = "q_proj.weight" if c.q_lora_rank is None else "q_b_proj.weight"
    state[q] = state[q][head_rows(heads, c.qk_head_dim)]
    kv_rows = head_rows(heads, c.qk_nope_head_dim + c.v_head_dim)
    state["kv_b_proj.weight"] = state["kv_b_proj.weight"][kv_rows]
    state["o_proj.weight"] = state["o_proj.weight"][:, head_rows(heads, c.v_head_dim)]
    mine.load_state_dict(state)
    return mine


class _TPAttention(nn.Module):
    """This rank's heads over the whole (replicated) latent; one all-reduce adds the heads."""

    def __init__(self, full: LatentAttention, comm: Comm, heads: Callable = take_heads
                 ) -> None:
        super().__init__()
        self.local, self.comm = heads(full, comm), comm

    def forward(self, x, cache, layer_idx, start, attn_mask=None, **positions):
        return self.comm.all_reduce(self.local(x, cache, layer_idx, start, attn_mask,
                                               **positions))


class _Block(nn.Module):
    """A :class:`~kvdoc.core.mla.LatentBlock` with this rank's attention and MLP columns; under
    DP-attention its rows meet every rank's rows at the MLP."""

    def __init__(self, full: LatentBlock, comm: Comm, mode: str,
                 heads: Callable = take_heads) -> None:
        super().__init__()
        self.ln_1, self.ln_2, self.comm, self.mode = full.ln_1, full.ln_2, comm, mode
        self.attn = full.attn if mode == "dp" else _TPAttention(full.attn, comm, heads)
        self.mlp = ShardedMLP(full.mlp, comm.tp, comm.tp_rank, comm)

    def forward(self, x, cache, layer_idx, start, attn_mask=None, **positions):
        x = x + self.attn(self.ln_1(x), cache, layer_idx, start, attn_mask, **positions)
        h = self.ln_2(x)
        if self.mode == "tp":
            return x + self.mlp(h)
        y = self.mlp(torch.cat(self.comm.all_gather(h, tp=True)))  # every rank's requests
        return x + y.chunk(self.comm.tp)[self.comm.tp_rank]  # its own rows, summed over columns


def rank_model(model: MLADecoder, comm: Comm, mode: str,
               heads: Callable = take_heads) -> MLADecoder:
    """This rank's decoder: embeddings, norms and LM head whole, its share of every block."""
    mine = MLADecoder.__new__(MLADecoder)
    nn.Module.__init__(mine)
    mine.config, mine.wte, mine.wpe = model.config, model.wte, None
    mine.ln_f, mine.lm_head = model.ln_f, model.lm_head
    mine.h = nn.ModuleList(_Block(b, comm, mode, heads) for b in model.h)
    return mine.eval()


@dataclass
class LatentRank:
    """What one rank of a latent run computed and holds."""

    rank: int
    requests: tuple[int, ...]
    """The batch rows it decoded and cached."""
    tokens: torch.Tensor
    logits: torch.Tensor
    latent: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer ``c_KV`` and ``k_rope`` of its requests."""
    cache_bytes: int
    collectives: dict[str, int]


class LatentJob(NamedTuple):
    """One latent run: an MLA model on ``ranks`` ranks in ``mode``."""

    name: str
    model: MLADecoder
    prompt: torch.Tensor
    max_new_tokens: int
    mode: str
    split: type = RequestSplit
    bytes_rule: object = latent_rank_bytes
    """What a rank's bytes must equal: a broken variant brings a wrong rule."""
    heads: Callable = take_heads
    """How a ``"tp"`` rank takes its heads: a broken variant brings a wrong split."""


@torch.no_grad()
def rank_latent(rank: int, world_size: int, job: LatentJob) -> LatentRank:
    """This rank's greedy decoding of its requests (all of them under ``"tp"``)."""
    comm = Comm(rank, world_size, 1)
    B = job.prompt.shape[0]
    rows = range(B) if job.mode == "tp" else job.split().requests(B, world_size, rank)
    model = rank_model(job.model, comm, job.mode, job.heads)
    prompt = job.prompt[list(rows)]
    logits, cache = prefill(model, prompt, model.new_cache(prompt.shape[0], "dynamic"))
    comm.take_counts()
    counts = [{}]

    def step(token: torch.Tensor, cache: KVCache, _: int) -> tuple[torch.Tensor, KVCache]:
        out = decode_step(model, token, cache)
        counts.append(comm.take_counts())
        return out
    choose = comm.broadcast if job.mode == "tp" else lambda token: token
    tokens, chosen, cache = greedy(logits, cache, prompt, job.max_new_tokens, step, choose)
    return LatentRank(rank, tuple(rows), tokens, chosen,
                      [tuple(layer.tensors()) for layer in cache.layers], measured_bytes(cache),
                      counts[-1])


def rank_latent_jobs(rank: int, world_size: int, jobs: list[LatentJob]) -> list[LatentRank]:
    """Every job on this rank, in order."""
    return [rank_latent(rank, world_size, j) for j in jobs]


@dataclass
class LatentCheck:
    """One latent run against one process."""

    name: str
    mode: str
    ranks: int
    tokens_equal: bool
    logits_close: bool
    latent_close: bool
    bytes: list[tuple[int, int]]
    """Per rank: (measured, the job's rule)."""
    collectives: dict[str, int]

    @property
    def ok(self) -> bool:
        return (self.tokens_equal and self.logits_close and self.latent_close
                and all(m == f for m, f in self.bytes))

    def lines(self) -> list[str]:
        """What was compared, for a reader."""
        steps = ", ".join(f"{n} {k}" for k, n in sorted(self.collectives.items())) or "none"
        return [f"{self.name}: MLA latent, {self.mode} on {self.ranks} ranks: tokens "
                f"{MARK[self.tokens_equal]}, logits {MARK[self.logits_close]}, each rank's "
                f"latent {MARK[self.latent_close]}",
                f"  latent bytes per rank: {', '.join(f'{m:,}' for m, _ in self.bytes)} "
                f"(formula: {MARK[all(m == f for m, f in self.bytes)]}); collectives per "
                f"decode step: {steps}"]


def compare_latent(job: LatentJob, ranks: list[LatentRank]) -> LatentCheck:
    """Each rank's tokens, logits and latent against its rows of one process's batch (every
    row under ``"tp"``; the rank's share under ``"dp"``, whatever the job's split says)."""
    want = generate(job.model, job.prompt, job.max_new_tokens)
    _, full_logits, cache = reference(job.model, job.prompt, job.max_new_tokens)
    tol = TOLERANCE.get(job.model.wte.weight.dtype, 1e-5)
    tokens = logits = latent = True
    B = job.prompt.shape[0]
    for r in ranks:  # the rows the rank must hold, not the rows it says it holds
        rows = list(range(B) if job.mode == "tp" else RequestSplit().requests(B, len(ranks),
                                                                             r.rank))
        tokens &= torch.equal(r.tokens, want[rows])
        logits &= torch.allclose(r.logits, full_logits[rows], atol=tol, rtol=tol)
        latent &= rows_close(r.latent, cache, tol, lambda t, rows=rows: t[rows])
    fed = want.shape[1] - 1
    sizes = [(r.cache_bytes, job.bytes_rule(job.model.config, job.mode, len(ranks), r.rank,
                                            job.prompt.shape[0], fed, job.model.wte.weight.dtype))
             for r in ranks]
    return LatentCheck(job.name, job.mode, len(ranks), bool(tokens), bool(logits), bool(latent),
                       sizes, ranks[0].collectives)


def check_latent_job(job: LatentJob, ranks: int) -> None:
    """Raise ``ValueError`` for a job that cannot run on ``ranks`` ranks."""
    if not isinstance(job.model, MLADecoder):
        raise ValueError(f"a latent run takes an MLADecoder, got {type(job.model).__name__}")
    _check(job.mode, ranks, job.prompt.shape[0])
    c = job.model.config
    if c.n_head % ranks or c.n_inner % ranks:
        raise ValueError(f"{ranks} ranks must divide n_head={c.n_head} and n_inner={c.n_inner}")
    job.model.check_input(job.prompt, None)
    check_int("max_new_tokens", job.max_new_tokens)


def latent_jobs(jobs: list[LatentJob], ranks: int = 2) -> list[LatentCheck]:
    """Every job on one launch of ``ranks`` ranks, each compared with one process; a job
    :func:`check_latent_job` refuses raises before any rank starts."""
    for j in jobs:
        check_latent_job(j, ranks)
    per_rank = launch(rank_latent_jobs, ranks, jobs, backend="gloo")  # CPU tensors
    return [compare_latent(j, [r[i] for r in per_rank]) for i, j in enumerate(jobs)]
