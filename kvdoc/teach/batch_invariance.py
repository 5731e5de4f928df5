"""Batch invariance: under :func:`kvdoc.batch_invariant`, one sequence's logits bit for bit.

Row 0 of a short stream is computed many ways: a full forward alone and in a batch, fed through
every kind of :data:`KINDS` that serves the model in chunks, alone and batched, decode steps
among other rows: every result ``torch.equal`` to the first, in BF16, FP16 and FP32 (an absorbed
MLA model's cached runs against its one cached call, since it attends in latent space).
tests/test_batch_invariant.py runs it on :data:`MODELS` (it never varied by cache kind), with
:class:`~kvdoc.teach.broken_shown.ChunkSplitAttention`, within every tolerance and
caught only here.

>>> from kvdoc.proofs import grid
>>> rows = invariance_rows(grid.MODELS["mha"].build(0), (torch.float32,))
>>> [(name, ok, runs) for name, ok, _, runs in rows]
[('FP32', True, 9)]
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from kvdoc.core.feed import feed
from kvdoc.core.invariant import batch_invariant
from kvdoc.proofs import grid
from kvdoc.proofs.compare import DTYPE_NAMES

MODELS = ("mha", "split-k", "mla", "mla-absorbed", "gemma3")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KINDS = ("dynamic", "static", "window", "hybrid")
LENGTH = 24
CHUNKS = (2, 5)
BATCH = 3


def served_kinds(model: nn.Module) -> list[str]:
    return [kind for kind, _ in grid.served(model.config, kinds=KINDS, impls=("model",))]


def _cached_want(model: nn.Module, ids: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """What a cached run must equal: the full forward, or for an absorbed MLA model (other sums)
    its one cached call over the whole sequence."""
    if not getattr(model.config, "absorb", False):
        return want
    return model(ids, model.new_cache(1)).logits


def invariance_rows(model: nn.Module, dtypes=DTYPES,
                    seed: int = 0) -> list[tuple[str, bool, float, int]]:
    """``(dtype, bitwise, largest difference, runs)`` per dtype for ``model``."""
    g = torch.Generator().manual_seed(2000 + seed)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, LENGTH), generator=g)
    rows = []
    for dt in dtypes:
        m = copy.deepcopy(model).to(dt).eval()
        with torch.no_grad(), batch_invariant():
            want = m(ids[:1]).logits
            cached = _cached_want(m, ids[:1], want)
            runs = [(m(ids).logits[:1], want)]
            for kind in served_kinds(m):
                for chunk in CHUNKS:
                    got = feed(m, ids[:1], grid.CACHES[kind].new(m, 1, LENGTH), chunk).logits
                    runs.append((got, cached))
            for chunk in CHUNKS:
                batched = feed(m, ids, m.new_cache(BATCH, "dynamic"), chunk).logits[:1]
                runs.append((batched, cached))
            got = feed(m, ids[:1], m.new_cache(1, "static", LENGTH), (7, 1, 16)).logits
            runs.append((got, cached))
            # decode steps in a batch whose other rows differ: the serving case
            _, cache = m(ids[:, :9], m.new_cache(BATCH, "static", LENGTH))
            steps = [m(ids[:, t:t + 1], cache).logits[:1] for t in range(9, 12)]
            runs.append((torch.cat((cached[:, :9], *steps, cached[:, 12:]), dim=1), cached))
        equal = [r.shape == w.shape and torch.equal(r, w) for r, w in runs]
        worst = max(((r.float() - w.float()).abs().max().item() if r.shape == w.shape
                     else float("inf")) for r, w in runs)
        rows.append((DTYPE_NAMES[dt], all(equal), worst, len(runs)))
    return rows
