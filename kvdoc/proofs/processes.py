"""The checks that need processes of their own, and the broken variants only they catch.

``verify`` runs them after the suite, from its own process (pool workers cannot start ranks):
two ranks decode at TP = 2 and CP = 2 and run MLA's latent under TP and DP-attention
(:mod:`kvdoc.parallel`); three ranks hand a TP = 2 prefill's blocks to a decode rank, pushed
and pulled; one process serves a multi-turn workload from offloaded blocks; each beside the
broken variants of :mod:`kvdoc.proofs.broken.parallel` and the offload key. Each
:class:`ProcessCheck` of the implementation must pass; each of a variant must fail.
"""

from __future__ import annotations

import tempfile
from typing import NamedTuple

import torch

from kvdoc.parallel.blocks import Handover, handover_jobs
from kvdoc.parallel.checks import Job, build_model, check_jobs, compare_jobs, rank_jobs
from kvdoc.parallel.latent import (
    MODES,
    LatentJob,
    check_latent_job,
    compare_latent,
    latent_model,
    rank_latent_jobs,
)
from kvdoc.parallel.launch import launch, together
from kvdoc.serving.offload import TieredStore, check_offload, multi_turn

from .broken.parallel import BROKEN as PARALLEL_BROKEN
from .broken.parallel import HANDOVER_BROKEN, LATENT_BROKEN, PULL_BROKEN
from .broken.serving import OFFLOAD_BROKEN

PROMPT = torch.tensor([[11, 3, 57, 20, 8, 91, 42, 5, 77]])
NEW = 5
BLOCK = 4
LATENT_PROMPTS = torch.tensor([[11, 3, 57, 20, 8, 91, 42, 5, 77],
                               [60, 2, 33, 14, 70, 9, 25, 88, 1]])
"""One request a rank under DP-attention."""


class ProcessCheck(NamedTuple):
    """One run across processes: a variant (it must fail) or not, what it compared, passed."""

    name: str
    variant: bool
    what: str
    passed: bool

    @property
    def as_expected(self) -> bool:
        return self.passed != self.variant


def process_checks(variants: bool = True) -> list[ProcessCheck]:
    """Run every check across processes (with ``variants``, the broken ones too)."""
    llama = build_model("llama")
    jobs = [Job("tp=2", llama, PROMPT, NEW, 2, 1), Job("cp=2", llama, PROMPT, NEW, 1, 2)]
    mla = latent_model()
    latent = [LatentJob(f"latent, {mode}", mla, LATENT_PROMPTS, NEW, mode) for mode in MODES]
    if variants:
        jobs += [Job(name, llama, PROMPT, NEW, b.tp, b.cp, b.parts)
                 for name, b in PARALLEL_BROKEN.items()]
        latent += [LatentJob(name, mla, LATENT_PROMPTS, NEW, b.mode, b.split, b.bytes_rule)
                   for name, b in LATENT_BROKEN.items()]
    for j in latent:
        check_latent_job(j, 2)
    decoded, latents = zip(*launch(together, check_jobs(jobs),
                                   [(rank_jobs, (jobs,)), (rank_latent_jobs, (latent,))],
                                   backend="gloo"),
                           strict=True)
    out = [ProcessCheck(c.name if c.name in PARALLEL_BROKEN else f"parallel decode, {c.name}",
                        c.name in PARALLEL_BROKEN, "tokens, logits, each rank's K/V and bytes, "
                        "collectives, against one process", c.ok)
           for c in compare_jobs(jobs, list(decoded))]
    out += [ProcessCheck(j.name, j.name in LATENT_BROKEN, "MLA tokens, logits and each rank's "
                         "latent against one process, latent bytes against the formula",
                         compare_latent(j, [r[i] for r in latents]).ok)
            for i, j in enumerate(latent)]
    handed = [Handover(f"block hand-over, {mode}", llama, PROMPT, NEW, BLOCK, mode)
              for mode in ("logits", "recompute")]
    handed.append(Handover("block hand-over, pulled after 1 block", llama, PROMPT, NEW, BLOCK,
                           "recompute", transfer="pull", have=1))
    if variants:
        handed += [Handover(name, llama, PROMPT, NEW, BLOCK, "logits", place)
                   for name, place in HANDOVER_BROKEN.items()]
        handed += [Handover(name, llama, PROMPT, NEW, BLOCK, **fields)
                   for name, fields in PULL_BROKEN.items()]
    broken = {**HANDOVER_BROKEN, **PULL_BROKEN}
    out += [ProcessCheck(h.name, h.name in broken, "tokens and the decode rank's K/V against "
                         "one process, bytes and messages against the formula", h.ok)
            for h in handover_jobs(handed)]
    hashes = {"offloaded blocks, chained keys": None}
    if variants:
        hashes.update(OFFLOAD_BROKEN)
    for name, hash_fn in hashes.items():
        with tempfile.TemporaryDirectory() as folder:
            store = TieredStore(device_blocks=4, host_blocks=4, folder=folder)
            kwargs = {} if hash_fn is None else {"hash_fn": hash_fn}
            served = multi_turn(llama, store, block_size=BLOCK, max_new_tokens=3, **kwargs)
            check = check_offload(llama, served, 3)
        out.append(ProcessCheck(name, hash_fn is not None, f"{check.requests} requests' tokens "
                                "and first logits against their runs without offloading",
                                check.ok))
    return out


def processes_table(checks: list[ProcessCheck]) -> str:
    """One Markdown row per check."""
    from kvdoc.measure.tables import markdown_table

    return markdown_table(
        ["run", "compares", "expected", "outcome"],
        [[c.name, c.what, "caught" if c.variant else "pass",
          ("caught" if not c.passed else "NOT caught") if c.variant
          else ("pass" if c.passed else "FAIL")] for c in checks])
