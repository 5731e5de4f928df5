"""Checks of the scheduler (:mod:`kvdoc.serving.scheduler`): every request against its solo run.

:func:`compare_trace_with_alone` holds each request of a served trace to ``generate`` on its
prompt alone (tokens) and one full forward (logits, within
:data:`kvdoc.proofs.compare.TOLERANCE`); :func:`check_policies` (static, continuous, chunked
prefill, with the block invariants), :func:`check_preemption` (a pool too small, preempting by
recompute) and :func:`check_forks` (seeded samples of one prompt, copy-on-write) run it on every
model the grid serves paged (``tests/test_policies.py``; the hybrids DeltaNet and Bamba, whose
states the scheduler carries, in ``tests/test_snapshots.py``); :func:`check_sampled_preemption`
holds seeded requests preempted mid-stream to their uninterrupted runs, which
:class:`RestartStream` fails. The broken schedulers of :mod:`kvdoc.teach.broken_shown` are
what they catch:

>>> from kvdoc.teach.broken_shown import ResumeWithoutRecompute
>>> from kvdoc.proofs.compare import default_model
>>> check_preemption(default_model()).passed, check_preemption(default_model(),
...                                                            ResumeWithoutRecompute).passed
(True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvdoc.core.model import Decoder, decode_step, generate, prefill
from kvdoc.proofs.compare import TOLERANCE, close, max_abs
from kvdoc.serving.requests import Request, ServeRun, arrival_trace, choose, sample_generator
from kvdoc.serving.scheduler import LiveRequest, Scheduler


@dataclass(frozen=True)
class RequestCheck:
    """One sample of a served request against it alone (greedy, or drawn with its seed)."""

    rid: int
    logit_error: float
    logits_close: bool
    same_tokens: bool
    sample: int = 0

    @property
    def passed(self) -> bool:
        return self.logits_close and self.same_tokens


def _alone(model: Decoder, request: Request, sample: int = 0) -> tuple[list[int], torch.Tensor]:
    """The request's tokens alone (greedy, or chosen with its sample's generator) and the full
    forward's logits behind them."""
    device, L = model.wte.weight.device, len(request.prompt)
    prompt, g = torch.tensor([request.prompt], device=device), sample_generator(request, sample)
    if g is None:
        out = generate(model, prompt, request.output_len)
    else:
        logits, cache = prefill(model, prompt)
        tokens = []
        for _ in range(request.output_len):
            tokens.append(choose(logits[0, -1], g))
            if len(tokens) < request.output_len:
                logits, cache = decode_step(model, torch.tensor([tokens[-1]], device=device),
                                            cache)
        out = torch.cat((prompt, torch.tensor([tokens], device=device)), dim=1)
    return out[0, L:].tolist(), model(out[:, :-1]).logits[0, L - 1:]


@torch.no_grad()
def compare_trace_with_alone(model: Decoder, trace: Sequence[Request], run: ServeRun,
                             alone: dict | None = None) -> list[RequestCheck]:
    """Each sample of each request of ``trace`` in ``run`` against ``model`` on its prompt alone
    (``alone``: ``(rid, sample) -> (tokens, logits)`` reused over several runs)."""
    tol, checks = TOLERANCE[model.wte.weight.dtype], []
    for r in trace:
        for j in range(r.samples):
            tokens, ref = alone[r.rid, j] if alone else _alone(model, r, j)
            got = run.sample_logits.get((r.rid, j), torch.empty(0))
            checks.append(RequestCheck(r.rid, max_abs(got, ref), close(got, ref, tol),
                                       run.samples.get((r.rid, j)) == tokens, j))
    return checks


@dataclass(frozen=True)
class PolicyCheck:
    """One policy on one trace: every request equal to its solo run, the block invariants."""

    policy: str
    token_budget: int | None
    logit_error: float
    requests_equal: bool
    invariants_hold: bool
    steps: int

    @property
    def passed(self) -> bool:
        return self.requests_equal and self.invariants_hold


# up to 25 positions, past the grid's window of 16: a ragged step that let a windowed layer read
# past it would show
POLICY_TRACE = dict(n=5, prompt_lens=(2, 20), output_lens=(1, 6), max_gap=2, seed=0)
# static batches of 4, continuous, chunked prefill
POLICIES: tuple[dict, ...] = (dict(policy="static", max_batch=4), dict(), dict(token_budget=6))


@torch.no_grad()
def check_policies(model: Decoder, trace: Sequence[Request] | None = None,
                   num_blocks: int = 16, block_size: int = 4,
                   scheduler: type[Scheduler] = Scheduler) -> list[PolicyCheck]:
    """``trace`` served under each of :data:`POLICIES`, each request vs its solo run.

    >>> from kvdoc.proofs.compare import default_model
    >>> [(c.policy, c.token_budget, c.passed) for c in check_policies(default_model())]
    [('static', None, True), ('continuous', None, True), ('continuous', 6, True)]
    """
    trace = trace or arrival_trace(**POLICY_TRACE, vocab_size=model.config.vocab_size)
    alone = {(r.rid, 0): _alone(model, r) for r in trace}
    checks = []
    for options in POLICIES:
        run = scheduler(model, num_blocks, block_size, **options).run(trace)
        rows = compare_trace_with_alone(model, trace, run, alone)
        checks.append(PolicyCheck(run.policy, run.token_budget,
                                  max(c.logit_error for c in rows), all(c.passed for c in rows),
                                  run.invariants_hold, len(run.steps)))
    return checks


PREEMPTION_TRACE = dict(n=5, prompt_lens=(4, 8), output_lens=(6, 10), max_gap=1, seed=2)


@dataclass(frozen=True)
class PreemptionCheck:
    """Runs with preemption on a ``tight`` pool and a ``roomy`` one, every request vs its solo run;
    it passes only if the tight runs did preempt."""

    tight: tuple[ServeRun, ...]
    roomy: tuple[ServeRun, ...]
    requests_equal: bool
    invariants_hold: bool
    logit_error: float

    @property
    def passed(self) -> bool:
        return (self.requests_equal and self.invariants_hold
                and all(run.preemptions > 0 for run in self.tight))


@torch.no_grad()
def check_preemption(model: Decoder, scheduler: type[Scheduler] = Scheduler,
                     trace: Sequence[Request] | None = None, tight: int = 8, roomy: int = 32,
                     block_size: int = 4, token_budget: int = 6) -> PreemptionCheck:
    """``trace`` served with ``preempt=True`` on ``tight`` and ``roomy`` blocks, with and without
    ``token_budget``."""
    trace = trace or arrival_trace(**PREEMPTION_TRACE, vocab_size=model.config.vocab_size)
    alone = {(r.rid, 0): _alone(model, r) for r in trace}
    runs = {blocks: tuple(scheduler(model, blocks, block_size, token_budget=b, preempt=True)
                          .run(trace) for b in (token_budget, None)) for blocks in (tight, roomy)}
    rows = [c for group in runs.values() for run in group
            for c in compare_trace_with_alone(model, trace, run, alone)]
    return PreemptionCheck(runs[tight], runs[roomy], all(c.passed for c in rows),
                           all(run.invariants_hold for g in runs.values() for run in g),
                           max(c.logit_error for c in rows))


@dataclass(frozen=True)
class ForkCheck:
    """One request forked into seeded samples vs each sample alone and vs independent requests
    seeded as the samples (``copies``)."""

    forked: ServeRun
    copies: ServeRun
    samples_equal: bool
    copies_equal: bool
    invariants_hold: bool
    logit_error: float

    @property
    def passed(self) -> bool:
        return self.samples_equal and self.copies_equal and self.invariants_hold


@torch.no_grad()
def check_forks(model: Decoder, scheduler: type[Scheduler] = Scheduler, samples: int = 4,
                prompt_len: int = 10, output_len: int = 6, seed: int = 5, num_blocks: int = 32,
                block_size: int = 4) -> ForkCheck:
    """A request of ``prompt_len`` tokens forked into ``samples`` (off the block size: every fork
    but the last writer copies the partly filled last block)."""
    g = torch.Generator().manual_seed(seed)
    prompt = tuple(torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist())
    request = Request(0, prompt, output_len, 0, samples=samples, seed=seed)
    copies = [Request(j, prompt, output_len, 0, seed=seed + j) for j in range(samples)]
    forked = scheduler(model, num_blocks, block_size).run([request])
    alone = scheduler(model, num_blocks, block_size).run(copies)
    rows = compare_trace_with_alone(model, [request], forked)
    same = all(forked.samples[0, j] == alone.tokens[j] for j in range(samples))
    return ForkCheck(forked, alone, all(c.passed for c in rows), same,
                     forked.invariants_hold and alone.invariants_hold,
                     max(c.logit_error for c in rows))



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
    """:data:`PREEMPTION_TRACE` with request ``r`` seeded ``100 + r``, served with preemption on
    ``num_blocks``: every request's tokens as drawn alone.

    >>> from kvdoc.proofs.compare import default_model
    >>> model = default_model()
    >>> check_sampled_preemption(model).passed
    True
    >>> check_sampled_preemption(model, RestartStream).passed
    False
    """
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
