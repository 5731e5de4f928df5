"""vLLM V1's scheduling rule, as read from its scheduler, on the lengths of a trace.

The loop of ``Scheduler.schedule`` in vLLM 0.33's
`vllm/v1/core/sched/scheduler.py <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py>`_,
without prefix caching, speculative tokens or priorities (its FCFS policy), written as
arithmetic on lengths and block counts like :func:`kvdoc.proofs.schedule_spec.expected_steps`:

1. the running requests, in order, each asking for what it has not computed, capped by the
   budget left (``max_num_batched_tokens``) while any is left; when the blocks for a request's
   tokens are short, the last running request is preempted (recompute: all its blocks back, to
   the front of the waiting queue), which may be the request itself, ending the loop;
2. only if nothing was preempted, the waiting requests in order while budget is left and
   ``max_num_seqs`` allows, each admitted if the blocks of the tokens it is scheduled now (not
   its whole prompt) are free; the first that does not fit stops admission.

This is a reading of vLLM's code, not vLLM run: it shows where kvdoc's scheduler with a budget
and ``preempt=True`` schedules as vLLM would, and where the two part (kvdoc admits a request
only when the blocks of its whole prompt are free).

>>> from kvdoc.serving.requests import Request
>>> trace = [Request(0, (1,) * 5, 3, 0), Request(1, (2,) * 3, 2, 1)]
>>> [s.rows for s in vllm_v1_steps(trace, num_blocks=8, token_budget=4)][:2]
[((0, 4, 'prefill'),), ((0, 1, 'prefill'), (1, 3, 'prefill'))]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvdoc.serving.requests import Request
from kvdoc.serving.runs import ServeRun

from .schedule_spec import SpecStep, _forward, _preempt_newest, _queue, _Seq


def vllm_v1_steps(trace: Sequence[Request], num_blocks: int, token_budget: int,
                  block_size: int = 4, max_batch: int | None = None) -> list[SpecStep]:
    """Each step of ``trace`` under vLLM V1's rule (module docstring), as
    :class:`~kvdoc.proofs.schedule_spec.SpecStep` s (``waiting``: arrived, not running)."""
    def blocks(positions: int) -> int:
        return math.ceil(positions / block_size)

    waiting = _queue(trace)
    running: list[_Seq] = []
    free, steps = num_blocks, []
    while waiting or running:
        t, left, rows, preempted = len(steps), token_budget, [], []
        kind = {}
        for s in list(running):
            if left == 0 or s not in running:
                break
            n = min(s.lacks(), left)
            kind[s.rid] = "decode" if s.decoding() else "recompute" if s.recomputes else "prefill"
            while blocks(s.computed + n) - s.blocks > free:
                free += _preempt_newest(running, waiting, preempted)
                if not any(x is s for x in running):
                    break
            if s not in running:
                break
            free -= blocks(s.computed + n) - s.blocks
            s.blocks = blocks(s.computed + n)
            rows.append((s, n))
            left -= n
        while (not preempted and waiting and waiting[0].arrival <= t and left > 0
               and (max_batch is None or len(running) < max_batch)):
            s = waiting[0]
            n = min(s.lacks(), left)
            if blocks(s.computed + n) - s.blocks > free:
                break
            running.append(waiting.pop(0))
            kind[s.rid] = "recompute" if s.recomputes else "prefill"
            free -= blocks(s.computed + n) - s.blocks
            s.blocks = blocks(s.computed + n)
            rows.append((s, n))
            left -= n
        if not running and waiting and waiting[0].arrival <= t:
            raise ValueError(f"request {waiting[0].rid} can never be scheduled")
        holding = _forward(rows, running)
        free += sum(s.blocks for s in running if s.finished())
        running = [s for s in running if not s.finished()]
        steps.append(SpecStep(tuple((s.rid, n, kind[s.rid]) for s, n in rows),
                              tuple(s.rid for s in waiting if s.arrival <= t), holding,
                              tuple(preempted), num_blocks - free))
    return steps


def first_departure(run: ServeRun, steps: Sequence[SpecStep]) -> str | None:
    """The first step at which ``run`` schedules other rows, preemptions or blocks than
    ``steps`` (which requests merely wait, admitted or not, is not compared: kvdoc admits a
    request that gets no tokens this step, vLLM leaves it waiting), or None."""
    for got, want in zip(run.steps, steps, strict=False):
        for name in ("rows", "preempted", "blocks_held"):
            if getattr(got, name) != getattr(want, name):
                return (f"step {got.step}: {name} {getattr(got, name)}, vLLM's rule "
                        f"{getattr(want, name)}")
    if len(run.steps) != len(steps):
        return f"{len(run.steps)} steps, vLLM's rule {len(steps)}"
    return None
