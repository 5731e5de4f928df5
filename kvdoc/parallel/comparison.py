"""Each parallel run compared with the same model in one process, and what was compared.

:func:`compare` checks a :class:`~kvdoc.parallel.decode.ParallelRun` against one process: the
tokens equal on every rank; the logits within :data:`TOLERANCE`; every rank's cache holding
exactly its K/V heads at its positions (those rows of the one-process cache, within the
tolerance), in :func:`~kvdoc.parallel.decode.rank_kv_bytes`; every forward call making
:func:`~kvdoc.parallel.decode.collectives_per_call`'s collectives.

Why this tolerance: TP and CP change only the order of floating-point sums (a row-parallel
``c_proj`` adds ``tp`` partial sums; the split-K merge rescales and adds ``cp`` partial
softmaxes), never what is summed. Reordering ``n`` FP32 terms moves the sum by a few units in the
last place of its magnitude (about ``n x 6e-8`` relative, ``n`` here at most 256); the site's
logits are of order 1, so the differences are ``1e-6`` or less, under the ``1e-5`` that
:mod:`kvdoc.proofs.compare` grants any two FP32 orders of one computation (``1e-10`` in FP64).

:func:`run_jobs` runs several models' checks in one launch of the ranks (starting them costs
seconds where nothing has imported torch for them, a tiny model's decode milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvdoc.core.cache import KVCache
from kvdoc.core.model import (
    Decoder,
    GPTConfig,
    decode_step,
    generate,
    llama_config,
    mistral_config,
    prefill,
)

from .comm import Comm
from .decode import (
    STANDARD,
    ParallelRun,
    Parts,
    check_run,
    collectives_per_call,
    greedy,
    rank_generate,
    rank_kv_bytes,
)
from .launch import launch

TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float64: 1e-10}
"""``atol = rtol`` for logits and cached K/V, by dtype (see the module docstring)."""

MARK = {True: "ok", False: "FAILED"}
"""How a check's line reads a verdict."""

MODELS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(),                              # MHA, 4 heads, learned positions
    "llama": llama_config(),                          # GQA 4 / 2, RoPE
    "mqa": llama_config(n_kv_head=1),                 # one K/V head: replicated under TP
    "mistral": mistral_config(sliding_window=5),      # a window shorter than the sequence
    "qwen2": llama_config(qkv_bias=True),             # Q/K/V biases: split with their heads
}
"""The configurations ``python -m kvdoc parallel`` checks (seeded weights, never trained)."""


def build_model(name: str, seed: int = 0) -> Decoder:
    """:data:`MODELS` ``[name]`` with weights from ``torch.manual_seed(seed)``, in eval mode."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Decoder(MODELS[name]).eval()


def rows_close(mine: list, cache: KVCache, tol: float,
               rows: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> bool:
    """Each layer's tensors in ``mine`` equal, within ``tol``, to ``rows`` of the one-process
    ``cache``'s (a rank's heads and positions, say)."""
    return all(m.shape == rows(w).shape and torch.allclose(m, rows(w), atol=tol, rtol=tol)
               for tensors, layer in zip(mine, cache.layers, strict=True)
               for m, w in zip(tensors, layer.read(cache.seq_len), strict=True))


@torch.no_grad()
def reference(model: Decoder, prompt: torch.Tensor, max_new_tokens: int):
    """One process's greedy decoding: ``(tokens, logits [B, N, V], cache of every position)``."""
    logits, cache = prefill(model, prompt, model.new_cache(prompt.shape[0], "dynamic"))
    return greedy(logits, cache, prompt, max_new_tokens,
                  lambda token, cache, _: decode_step(model, token, cache))


@dataclass
class Comparison:
    """One parallel run against one process."""

    name: str
    tp: int
    cp: int
    tokens_equal: bool
    max_logit_diff: float
    tolerance: float
    logits_close: bool
    kv_close: bool
    bytes: list[tuple[int, int]] = field(default_factory=list)
    """Per rank: (measured, formula)."""
    collectives: dict[str, int] = field(default_factory=dict)
    """One decode step's collectives on rank 0."""
    collectives_ok: bool = True
    held: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    """Per rank: the K/V heads and the positions its cache held."""

    @property
    def ok(self) -> bool:
        return (self.tokens_equal and self.logits_close and self.kv_close and self.collectives_ok
                and all(m == f for m, f in self.bytes))

    def lines(self) -> list[str]:
        """What was compared, for a reader."""
        per_rank = ", ".join(f"{m:,}" for m, _ in self.bytes)
        steps = ", ".join(f"{n} {kind}" for kind, n in sorted(self.collectives.items())) or "none"
        return [
            f"{self.name}: tp={self.tp} cp={self.cp} on {self.tp * self.cp} rank(s)",
            f"  tokens equal to generate: {MARK[self.tokens_equal]}",
            f"  logits: max |diff| {self.max_logit_diff:.2e} (tolerance {self.tolerance:g}): "
            f"{MARK[self.logits_close]}",
            f"  each rank's K/V equal to its heads and positions of one process's cache: "
            f"{MARK[self.kv_close]}",
            f"  cache bytes per rank: {per_rank} (formula: "
            f"{MARK[all(m == f for m, f in self.bytes)]})",
            f"  collectives per decode step: {steps} ({MARK[self.collectives_ok]})",
        ]


def compare(name: str, model: Decoder, prompt: torch.Tensor, max_new_tokens: int,
            run: ParallelRun, tp: int, cp: int) -> Comparison:
    """Check ``run`` (``tp x cp`` ranks) against ``model`` in one process."""
    tokens, logits, cache = reference(model, prompt, max_new_tokens)
    tol = TOLERANCE.get(logits.dtype, 1e-5)
    generated = generate(model, prompt, max_new_tokens)
    tokens_equal = torch.equal(tokens, generated) and all(
        torch.equal(r.tokens, generated) for r in run.ranks)
    diff = max(float((r.logits - logits).abs().max()) for r in run.ranks)
    close = all(r.logits.shape == logits.shape
                and torch.allclose(r.logits, logits, atol=tol, rtol=tol) for r in run.ranks)
    kv_close = all(rows_close(r.kv, cache, tol,
                              lambda t, r=r: t[:, list(r.kv_heads)][:, :, list(r.positions)])
                   for r in run.ranks)
    fed = prompt.shape[1] + max_new_tokens - 1
    sizes = [(r.cache_bytes, rank_kv_bytes(model.config, tp, cp, r.rank, prompt.shape[0], fed,
                                            logits.dtype)) for r in run.ranks]
    want = [collectives_per_call(model.config, tp, cp, decode=False)] + [
        collectives_per_call(model.config, tp, cp, decode=True)] * (max_new_tokens - 1)
    return Comparison(name, tp, cp, bool(tokens_equal), diff, tol, bool(close), bool(kv_close),
                      sizes, run.ranks[0].collectives[-1],
                      all(r.collectives == want for r in run.ranks),
                      [(r.kv_heads, r.positions) for r in run.ranks])


class Job(NamedTuple):
    """One model to run on the ranks of a :func:`run_jobs` launch."""

    name: str
    model: Decoder
    prompt: torch.Tensor
    max_new_tokens: int
    tp: int
    cp: int
    parts: Parts = STANDARD


def rank_jobs(rank: int, world_size: int, jobs: list[Job]) -> list:
    """This rank's :func:`~kvdoc.parallel.decode.rank_generate` of every job."""
    return [rank_generate(j.model, j.prompt, j.max_new_tokens, Comm(rank, j.tp, j.cp), j.parts)
            for j in jobs]


def check_jobs(jobs: list[Job]) -> int:
    """The one world size of ``jobs`` (a ValueError if they differ), each checked."""
    worlds = {j.tp * j.cp for j in jobs}
    if len(worlds) != 1:
        raise ValueError(f"one launch runs one number of ranks, the jobs need {sorted(worlds)}")
    for j in jobs:
        check_run(j.model, j.prompt, j.max_new_tokens, j.tp, j.cp)
    return worlds.pop()


def compare_jobs(jobs: list[Job], per_rank: list[list]) -> list[Comparison]:
    """Each job's :func:`rank_jobs` results (``per_rank[rank][job]``) compared."""
    return [compare(j.name, j.model, j.prompt, j.max_new_tokens,
                    ParallelRun(per_rank[0][i].tokens, per_rank[0][i].logits,
                                [ranks[i] for ranks in per_rank]), j.tp, j.cp)
            for i, j in enumerate(jobs)]


def run_jobs(jobs: list[Job]) -> list[Comparison]:
    """Every job on one launch of ranks (:func:`check_jobs`), each compared."""
    if not jobs:
        return []
    return compare_jobs(jobs, launch(rank_jobs, check_jobs(jobs), jobs, backend="gloo"))
