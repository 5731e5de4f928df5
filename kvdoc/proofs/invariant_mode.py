"""The ``invariant`` scenario: the batch-invariant mode computes the model's own function.

Under :func:`kvdoc.core.invariant.batch_invariant` the calls must agree bit for bit whatever the
chunking and the batch (``invariant_bits``, the self-consistency the mode promises), and those
bits must be the function computed outside the mode (``invariant``): the full forward of a
batch, the cached path in chunks, and a left-padded batch (prefill, then decode steps), each
within the dtype's tolerance of the full forward outside the mode. A mode that computes a wrong
function the same way on every path (a query head reading another group's K/V head, an FP64
model attended in FP32) passes the first and fails the second; FP64's tolerance sees rounding
through FP32 that FP32's cannot.

One combination per model and dtype runs it (the dynamic cache, the model's own call): the mode
changes how a call reduces, not what a cache kind stores, which the other scenarios check.

>>> from kvdoc.proofs.suite import run_suite
>>> report = run_suite(models=("gqa",), kinds=("dynamic",), impls=("model",),
...                    dtypes=(torch.float64,), scenarios=("invariant",))
>>> report.passed, [r.check for r in report.results]
(True, ['invariant', 'invariant_bits'])
"""

from __future__ import annotations

import torch

from kvdoc.core.invariant import batch_invariant

from .cache_invariants import padded_run
from .case import Case, scenario
from .compare import max_abs

LENGTH = 24
"""Tokens of the stream the mode runs: past the grid's window (16) and a split-K chunk (5); the
mode's attention is a loop over keys, so a long stream only costs."""
CHUNK = 5
"""The cached path's chunk: divides neither the stream nor the window."""


@scenario("invariant", {
    "invariant": "batch_invariant(): full, cached in chunks and a left-padded batch vs the "
                 "full forward outside the mode",
    "invariant_bits": "batch_invariant(): row 0 alone, in the batch, cached in chunks and "
                      "one token a call, bitwise"})
def _invariant(case: Case, out: list) -> None:
    if case.impl != "model" or case.kind != "dynamic":
        out.append(case.result("invariant", None, 0.0, "run once per model: the dynamic cache, "
                               "the model's own call"))
        return
    ids = case.ids[:, :LENGTH]
    want = case.full(ids)  # outside the mode: the function
    with batch_invariant():
        full = case.full(ids)
        alone = case.full(ids[:1])
        cached = case.feed(ids, CHUNK).logits
        stepped = case.feed(ids[:1], 1).logits  # one token a call
        padded, rows, lengths, length_ok = (padded_run(case) if ids.shape[0] > 1
                                            else ([], [], [], True))
    solo = [case.full(r[None]) for r in rows]  # outside the mode again
    pairs = [(full, want), (cached, want), *zip(padded, solo, strict=True)]
    out.append(case.compared("invariant", pairs, f"{LENGTH} tokens, full and in chunks of "
                             f"{CHUNK}; prompts of {lengths} tokens left-padded, then decode "
                             "steps", length_ok))
    # MLA's absorbed cached calls attend in latent space, another order than its full forward:
    # there, cached runs agree with one another only
    same = [(full[:1], alone), (cached[:1], stepped)]
    same += [] if getattr(case.model.config, "absorb", False) else [(stepped, alone)]
    bits = all(g.shape == w.shape and torch.equal(g, w) for g, w in same)
    out.append(case.result("invariant_bits", bits, max(max_abs(g, w) for g, w in same),
                           f"row 0 alone, in a batch of {ids.shape[0]}, in chunks of {CHUNK} "
                           "and of 1"))
