"""Sampling checked against its distribution, and a sampled stream across a preemption.

Greedy decoding is checked token for token elsewhere; these are the sampled paths, where a wrong
rule still gives plausible tokens.

* :func:`check_speculative_distribution`: one round of speculative sampling
  (:mod:`kvdoc.serving.speculative`) on a vocabulary small enough to enumerate: the model's
  next-token distribution over its first ``V`` ids is the target, the same at temperature 2 the
  draft. Every draft of ``k`` tokens, every accept-or-reject outcome and every redraw is
  enumerated with its probability (:func:`round_distribution`), the round's tokens are extended
  to ``k + 1`` with the target's own conditionals, and the result must be the target's joint
  distribution of ``k + 1`` tokens (:func:`target_distribution`): exactly, up to FP64 rounding,
  not a statistical test.
* :func:`check_sampled_preemption`: seeded requests preempted by recompute on a small pool:
  each must continue its own random stream and equal its uninterrupted run with the same seed
  (:func:`kvdoc.proofs.scheduling.compare_trace_with_alone`).

Each has a broken variant that still gives plausible tokens: :func:`residual_is_target` and
:class:`RestartStream`.

>>> from kvdoc.proofs.compare import default_model
>>> model = default_model()
>>> check_speculative_distribution(model).passed
True
>>> check_speculative_distribution(model, residual_is_target).passed
False
>>> check_sampled_preemption(model).passed, check_sampled_preemption(model, RestartStream).passed
(True, False)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from kvdoc.core.model import Decoder
from kvdoc.proofs.scheduling import PREEMPTION_TRACE, compare_trace_with_alone
from kvdoc.serving.requests import arrival_trace, sample_generator
from kvdoc.serving.scheduler import LiveRequest, Scheduler
from kvdoc.serving.speculative import Rule, acceptance

Table = dict[tuple[int, ...], list[float]]
"""Next-token probabilities over a small vocabulary, by the tokens generated so far."""

EXACT = 1e-12
"""How far the two distributions may differ: the enumeration runs in FP64, whatever the
model's dtype, so only FP64 rounding over a few hundred products and sums separates them."""


@torch.no_grad()
def tables(model: Decoder, prompt: tuple[int, ...], vocab: int, depth: int,
           temperature: float = 1.0) -> Table:
    """The model's next-token distribution over ids ``0 .. vocab - 1`` (renormalised, FP64)
    after ``prompt`` followed by every sequence of those ids of length ``0 .. depth``."""
    device, out = model.wte.weight.device, {}
    for n in range(depth + 1):
        tails = list(itertools.product(range(vocab), repeat=n))
        ids = torch.tensor([prompt + t for t in tails], device=device)
        logits = model(ids, last_only=True).logits[:, -1, :vocab].double() / temperature
        out.update(zip(tails, logits.softmax(dim=-1).cpu().tolist(), strict=True))
    return out


def target_distribution(p: Table, vocab: int, n: int) -> torch.Tensor:
    """``[vocab] * n``: the target's probability of each sequence of ``n`` tokens."""
    out = []
    for seq in itertools.product(range(vocab), repeat=n):  # in row-major order
        w = 1.0
        for i, x in enumerate(seq):
            w *= p[seq[:i]][x]
        out.append(w)
    return torch.tensor(out, dtype=torch.float64).view([vocab] * n)


def round_distribution(p: Table, q: Table, vocab: int, k: int,
                       rule: Rule = acceptance) -> torch.Tensor:
    """``[vocab] * (k + 1)``: the probability of each ``k + 1`` tokens after one round of
    speculative sampling under ``rule`` (draft ``q`` proposes ``k``; the first rejection is
    redrawn from the rule's residual, or all are kept and the target adds one), extended to
    ``k + 1`` tokens with the target's own conditionals."""
    out = dict.fromkeys(itertools.product(range(vocab), repeat=k + 1), 0.0)
    rules = {ctx: [t.tolist() for t in rule(torch.tensor(p[ctx], dtype=torch.float64),
                                            torch.tensor(q[ctx], dtype=torch.float64))]
             for ctx in q}

    def emit(seq: tuple[int, ...], w: float) -> None:  # extend with the target's conditionals
        if len(seq) == k + 1:
            out[seq] += w
            return
        for x in range(vocab):
            emit(seq + (x,), w * p[seq][x])

    for draft in itertools.product(range(vocab), repeat=k):
        alive = 1.0  # the probability of drawing this draft and keeping it so far
        for i in range(k):
            alive *= q[draft[:i]][draft[i]]
        for i in range(k):
            keep, residual = rules[draft[:i]]
            for x in range(vocab):  # rejected at i: the residual draw
                emit(draft[:i] + (x,), alive * (1 - keep[draft[i]]) * residual[x])
            alive *= keep[draft[i]]
        for x in range(vocab):  # every proposal kept: the target's bonus token
            emit(draft + (x,), alive * p[draft][x])
    return torch.tensor(list(out.values()), dtype=torch.float64).view([vocab] * (k + 1))


@dataclass(frozen=True)
class DistributionCheck:
    """The largest difference between the round's and the target's distribution, and the
    smallest probability a round rejects with (a check in which nothing is rejected would not
    reach the residual)."""

    error: float
    rejection: float
    vocab: int
    k: int

    @property
    def passed(self) -> bool:
        return self.error <= EXACT and self.rejection > 0


def check_speculative_distribution(model: Decoder, rule: Rule = acceptance, vocab: int = 4,
                                   k: int = 2, prompt: tuple[int, ...] = (5, 6, 7)
                                   ) -> DistributionCheck:
    """One round's exact distribution (:func:`round_distribution`) against the target's, on
    ``model``'s first ``vocab`` ids after ``prompt``, the draft the same at temperature 2."""
    p = tables(model, prompt, vocab, k)
    q = tables(model, prompt, vocab, k - 1, temperature=2.0)
    got = round_distribution(p, q, vocab, k, rule)
    want = target_distribution(p, vocab, k + 1)
    rejection = min(1 - sum(min(a, b) for a, b in zip(p[ctx], q[ctx], strict=True))
                    for ctx in q)
    return DistributionCheck(float((got - want).abs().max()), rejection, vocab, k)


@dataclass(frozen=True)
class StreamCheck:
    """Seeded requests on a pool that preempts them: each against its uninterrupted run."""

    requests_equal: bool
    preemptions: int
    interrupted: int
    """Preemptions of a request that had already drawn tokens (whose stream must continue)."""
    logit_error: float

    @property
    def passed(self) -> bool:
        return self.requests_equal and self.interrupted > 0


@torch.no_grad()
def check_sampled_preemption(model: Decoder, scheduler: type[Scheduler] = Scheduler,
                             num_blocks: int = 8, block_size: int = 4,
                             token_budget: int = 6) -> StreamCheck:
    """:data:`~kvdoc.proofs.scheduling.PREEMPTION_TRACE` with request ``r`` seeded ``100 +
    r``, served with preemption on ``num_blocks``: every request's tokens as drawn alone."""
    trace = [replace(r, seed=100 + r.rid) for r in
             arrival_trace(**PREEMPTION_TRACE, vocab_size=model.config.vocab_size)]
    prompts = {r.rid: len(r.prompt) for r in trace}
    run = scheduler(model, num_blocks, block_size, token_budget=token_budget,
                    preempt=True).run(trace)
    rows = compare_trace_with_alone(model, trace, run)
    interrupted = sum(n > prompts[rid] for s in run.steps for rid, n in s.preempted)
    return StreamCheck(all(c.passed for c in rows), run.preemptions, interrupted,
                       max(c.logit_error for c in rows))


class RestartStream(Scheduler):
    """BROKEN: a preempted request gets a new generator of its seed, so after its recompute it
    draws the random numbers its first tokens already used."""

    def preempt(self, live: LiveRequest) -> int:
        live.generator = sample_generator(live.req, live.sample)  # BUG: the stream restarts
        return super().preempt(live)


def residual_is_target(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BROKEN: :func:`~kvdoc.serving.speculative.acceptance`, but a rejected proposal is redrawn
    from ``p`` itself, not from ``max(0, p - q)`` normalised."""
    keep, _ = acceptance(p, q)
    return keep, p  # BUG: the residual is the target
