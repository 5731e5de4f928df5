"""A sampled stream across a preemption, and the broken scheduler that restarts it.

A sampled request preempted by recompute must continue its own random stream, where a wrong
rule still gives plausible tokens: :func:`check_sampled_preemption` serves seeded requests on a
pool that preempts them, each against its uninterrupted run; :class:`RestartStream` fails it.

>>> from kvdoc.proofs.compare import default_model
>>> model = default_model()
>>> check_sampled_preemption(model).passed, check_sampled_preemption(model, RestartStream).passed
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvdoc.core.model import Decoder
from kvdoc.serving.requests import arrival_trace, sample_generator
from kvdoc.serving.scheduler import LiveRequest, Scheduler
from kvdoc.teach.scheduling import PREEMPTION_TRACE, compare_trace_with_alone


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
    """:data:`~kvdoc.teach.scheduling.PREEMPTION_TRACE` with request ``r`` seeded ``100 +
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

