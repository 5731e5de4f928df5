"""The scheduler's policy written from its specification, and every step checked against it.

A wrong schedule (decodes waiting behind prompt chunks, a budget one token too large, the
oldest request preempted) changes step counts and latencies, not tokens. So the policy of
:mod:`kvdoc.serving.scheduler` is written here a second time, as arithmetic on lengths and block
counts only, and :func:`check_schedule` compares every step of a real run with it. The broken
schedulers at the end serve every request exactly as alone: only this check sees them.

The specification (:func:`expected_steps`), for requests without forks:

1. **Admission**, in order of arrival (a preempted request first in line), while the head has
   arrived and ``max_batch`` is not reached; ``static`` admits only into an empty batch. Without
   preemption a request is admitted if the free blocks, less what the admitted requests still
   need to their last position, cover its final ``prompt + output - 1`` positions; with
   preemption, if they cover the blocks of its prompt and tokens so far, less what the admitted
   requests need for theirs. The first request that does not fit stops admission.
2. **Composition**, the admitted in order of admission. Without a budget: every request still
   prefilling feeds all it lacks, and only if none is, every unfinished one decodes one token.
   With a budget of ``N``: each decoding request one token first, then the prefilling ones
   chunks of what they lack, until ``N`` tokens. This is vLLM V1's rule (running requests
   first, then the waiting, within ``max_num_batched_tokens``) when, as here, every decoding
   request was admitted before every prefilling one.
3. **Preemption** (with ``preempt=True``): rows get their blocks in order of admission; while
   one cannot, the most recently admitted request gives back all its blocks, forgets every
   position and goes to the front of the waiting queue (it may be that row itself), as vLLM
   V1's FCFS scheduler pops the last of its running list.
4. A row that has fed all it lacked chooses a token; finished requests give their blocks back
   (``static``: all at once, when the last of the batch finishes).

>>> from kvdoc.serving.requests import Request
>>> trace = [Request(0, (1,) * 5, 3, 0), Request(1, (2,) * 3, 2, 1)]
>>> for step in expected_steps(trace, num_blocks=8, token_budget=4):
...     print(step.rows, step.blocks_held)
((0, 4, 'prefill'),) 1
((0, 1, 'prefill'), (1, 3, 'prefill')) 3
((0, 1, 'decode'), (1, 1, 'decode')) 2
((0, 1, 'decode'),) 0
>>> from kvdoc.proofs.compare import default_model
>>> [c.passed for c in check_schedule(default_model())]
[True, True, True, True, True, True]
>>> [c.passed for c in check_schedule(default_model(), BudgetPlusOne)]
[True, True, False, False, False, True]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder
from kvdoc.serving.requests import Request, ServeRun, arrival_trace
from kvdoc.serving.scheduler import LiveRequest, Scheduler
from kvdoc.teach.scheduling import POLICY_TRACE, PREEMPTION_TRACE


@dataclass(frozen=True)
class SpecStep:
    """One step as the specification has it, in :class:`~kvdoc.serving.requests.StepRecord`'s
    terms: rows ``(rid, new tokens, kind)``, arrived requests not admitted, admitted ones not in
    the step, ``(rid, positions discarded)`` per preemption, blocks held after the step."""

    rows: tuple[tuple[int, int, str], ...]
    waiting: tuple[int, ...]
    holding: tuple[int, ...]
    preempted: tuple[tuple[int, int], ...]
    blocks_held: int


@dataclass
class _Seq:  # a request as the specification sees it: counts only

    rid: int
    prompt: int
    output: int
    arrival: int
    computed: int = 0  # positions whose K/V it holds
    produced: int = 0  # tokens chosen
    blocks: int = 0
    recomputes: int = 0

    def lacks(self) -> int:  # positions to feed before its next token is chosen
        return self.prompt + self.produced - self.computed

    def decoding(self) -> bool:
        return self.produced > 0 and self.lacks() == 1

    def finished(self) -> bool:
        return self.produced == self.output

    def kind(self) -> str:
        return "decode" if self.decoding() else "recompute" if self.recomputes else "prefill"

    def extra(self, n: int, block_size: int) -> int:  # blocks its next n positions add
        return math.ceil((self.computed + n) / block_size) - self.blocks

    def take(self, n: int, block_size: int) -> int:
        extra = self.extra(n, block_size)
        self.blocks += extra
        return extra


def _queue(trace: Sequence[Request]) -> list[_Seq]:  # in arrival order, ties by id
    return [_Seq(r.rid, len(r.prompt), r.output_len, r.arrival)
            for r in sorted(trace, key=lambda r: (r.arrival, r.rid))]


def _preempt_newest(running: list[_Seq], waiting: list[_Seq],
                    preempted: list[tuple[int, int]]) -> int:
    """Preempt the newest running request to the head of the queue; the blocks it gave back."""
    victim = running.pop()
    freed = victim.blocks
    preempted.append((victim.rid, victim.computed))
    victim.computed = victim.blocks = 0
    victim.recomputes += 1
    waiting.insert(0, victim)
    return freed


def _forward(rows: list[tuple[_Seq, int]], running: list[_Seq]) -> tuple[int, ...]:
    """Feed each row its positions; the running requests that got no row this step."""
    for s, n in rows:
        s.computed += n
        if s.computed == s.prompt + s.produced:
            s.produced += 1
    in_step = {s.rid for s, _ in rows}
    return tuple(s.rid for s in running if s.rid not in in_step)


def expected_steps(trace: Sequence[Request], num_blocks: int, block_size: int = 4,
                   max_batch: int | None = None, token_budget: int | None = None,
                   policy: str = "continuous", preempt: bool = False) -> list[SpecStep]:
    """Each step of serving ``trace`` under the specification of the module docstring, with
    :class:`~kvdoc.serving.scheduler.Scheduler`'s options. Raises ``ValueError`` for a request
    that forks, or a state the specification says cannot occur."""
    if any(r.samples != 1 for r in trace):
        raise ValueError("the specification covers requests without forks")

    def blocks(positions: int) -> int:
        return math.ceil(positions / block_size)

    waiting = _queue(trace)
    running: list[_Seq] = []
    free, steps = num_blocks, []
    while waiting or running:
        t = len(steps)
        # 1. admission
        if preempt:
            owed = sum(max(0, blocks(s.prompt + s.produced) - s.blocks) for s in running)
        else:
            owed = sum(blocks(s.prompt + s.output - 1) - s.blocks for s in running)
        admitting = policy == "continuous" or not running  # static: into an empty batch
        while admitting and waiting and waiting[0].arrival <= t:
            head = waiting[0]
            need = blocks(head.prompt + head.produced) if preempt else blocks(
                head.prompt + head.output - 1)
            if (max_batch is not None and len(running) >= max_batch) or need > free - owed:
                break
            running.append(waiting.pop(0))
            owed += need
        if not running and waiting and waiting[0].arrival <= t:
            raise ValueError(f"request {waiting[0].rid} can never be admitted")
        # 2. composition
        prefilling = [s for s in running if not s.decoding() and not s.finished()]
        decoding = [s for s in running if s.decoding() and not s.finished()]
        if token_budget is None:
            rows = [(s, s.lacks()) for s in (prefilling or decoding)]
        else:
            left, rows = token_budget, []
            for s in decoding + prefilling:
                n = min(s.lacks(), left)
                if n == 0:
                    break
                rows.append((s, n))
                left -= n
        kinds = {s.rid: s.kind() for s, _ in rows}
        # 3. blocks for every row, oldest admitted first; preempt the newest while short
        preempted = []
        for s, n in sorted(rows, key=lambda row: running.index(row[0])):
            if not any(x is s for x in running):
                continue
            while any(x is s for x in running) and s.extra(n, block_size) > free:
                if not preempt:
                    raise ValueError(f"request {s.rid} was admitted without room to write")
                free += _preempt_newest(running, waiting, preempted)
            if any(x is s for x in running):
                free -= s.take(n, block_size)
        rows = [(s, n) for s, n in rows if any(x is s for x in running)]
        # 4. the forward, then retirement
        holding = _forward(rows, running)
        done = [s for s in running if s.finished()]
        if policy == "continuous" or len(done) == len(running):
            free += sum(s.blocks for s in done)
            running = [s for s in running if not s.finished()]
        steps.append(SpecStep(tuple((s.rid, n, kinds[s.rid]) for s, n in rows),
                              tuple(s.rid for s in waiting if s.arrival <= t), holding,
                              tuple(preempted), num_blocks - free))
    return steps


SCHEDULED = ("rows", "preempted", "blocks_held")
"""What a step schedules: compared with vLLM's rule (:func:`vllm_v1_steps`), which requests
merely wait is not (kvdoc admits a request that gets no tokens this step, vLLM leaves it
waiting)."""


def first_difference(run: ServeRun, spec: Sequence[SpecStep],
                     fields: Sequence[str] = tuple(SpecStep.__dataclass_fields__),
                     against: str = "the specification") -> str | None:
    """Where ``run`` leaves ``spec`` (named ``against``): the first step and field of ``fields``
    that differ, or None.

    >>> from types import SimpleNamespace
    >>> step = SpecStep(((0, 4, "prefill"),), (), (), (), 1)
    >>> run = SimpleNamespace(steps=[SimpleNamespace(step=0, **{**vars(step), "blocks_held": 2})])
    >>> first_difference(run, [step])
    'step 0: blocks_held 2, the specification 1'
    >>> first_difference(run, [step, step], fields=("rows",), against="vLLM's rule")
    "1 steps, vLLM's rule 2"
    """
    for got, want in zip(run.steps, spec, strict=False):
        for name in fields:
            if getattr(got, name) != getattr(want, name):
                return (f"step {got.step}: {name} {getattr(got, name)}, "
                        f"{against} {getattr(want, name)}")
    if len(run.steps) != len(spec):
        return f"{len(run.steps)} steps, {against} {len(spec)}"
    return None


SCHEDULES: tuple[tuple[str, dict, dict], ...] = (
    ("policy", POLICY_TRACE, dict(num_blocks=16, policy="static", max_batch=4)),
    ("policy", POLICY_TRACE, dict(num_blocks=16)),
    ("policy", POLICY_TRACE, dict(num_blocks=16, token_budget=6)),
    ("policy", POLICY_TRACE, dict(num_blocks=16, token_budget=5, max_batch=2)),
    ("preemption", PREEMPTION_TRACE, dict(num_blocks=8, token_budget=6, preempt=True)),
    ("preemption", PREEMPTION_TRACE, dict(num_blocks=8, preempt=True)),
)
"""The runs :func:`check_schedule` makes: (trace name, :func:`arrival_trace` arguments,
scheduler options); the traces are those of :mod:`kvdoc.teach.scheduling`."""


@dataclass(frozen=True)
class ScheduleCheck:
    """One run against the specification: its options, steps, preemptions, and the first
    difference (None: every step as specified)."""

    trace: str
    options: dict
    steps: int
    preemptions: int
    difference: str | None

    @property
    def passed(self) -> bool:
        return self.difference is None


@torch.no_grad()
def check_schedule(model: Decoder, scheduler: type[Scheduler] = Scheduler,
                   block_size: int = 4) -> list[ScheduleCheck]:
    """Each of :data:`SCHEDULES` served by ``scheduler``, every step against
    :func:`expected_steps`."""
    checks = []
    for name, trace_args, options in SCHEDULES:
        trace = arrival_trace(**trace_args, vocab_size=model.config.vocab_size)
        opts = dict(options)
        blocks = opts.pop("num_blocks")
        run = scheduler(model, blocks, block_size, **opts).run(trace)
        spec = expected_steps(trace, blocks, block_size, **opts)
        checks.append(ScheduleCheck(name, options, len(run.steps), run.preemptions,
                                    first_difference(run, spec)))
    return checks


def vllm_v1_steps(trace: Sequence[Request], num_blocks: int, token_budget: int,
                  block_size: int = 4, max_batch: int | None = None) -> list[SpecStep]:
    """Each step of ``trace`` under vLLM V1's rule, as :class:`SpecStep` s (``waiting``:
    arrived, not running): a reading of ``Scheduler.schedule`` in vLLM 0.33's
    ``vllm/v1/core/sched/scheduler.py`` (FCFS, no prefix caching or speculative tokens), not
    vLLM run, as arithmetic like :func:`expected_steps`:

    1. the running requests in order, each given what it has not computed, capped by the budget
       left; when blocks are short, the last running request is preempted by recompute (maybe
       the request itself, ending the loop);
    2. only if nothing was preempted, the waiting requests in order while budget and
       ``max_num_seqs`` allow, each admitted if the blocks of the tokens scheduled now (not its
       whole prompt, as kvdoc asks) are free; the first that does not fit stops admission.

    >>> from kvdoc.serving.requests import Request
    >>> trace = [Request(0, (1,) * 5, 3, 0), Request(1, (2,) * 3, 2, 1)]
    >>> [s.rows for s in vllm_v1_steps(trace, num_blocks=8, token_budget=4)][:2]
    [((0, 4, 'prefill'),), ((0, 1, 'prefill'), (1, 3, 'prefill'))]
    """
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
            kind[s.rid] = s.kind()
            while s.extra(n, block_size) > free:
                free += _preempt_newest(running, waiting, preempted)
                if not any(x is s for x in running):
                    break
            if s not in running:
                break
            free -= s.take(n, block_size)
            rows.append((s, n))
            left -= n
        while (not preempted and waiting and waiting[0].arrival <= t and left > 0
               and (max_batch is None or len(running) < max_batch)):
            s = waiting[0]
            n = min(s.lacks(), left)
            if s.extra(n, block_size) > free:
                break
            running.append(waiting.pop(0))
            kind[s.rid] = s.kind()
            free -= s.take(n, block_size)
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


class PrefillBeforeDecode(Scheduler):
    """BROKEN: with a budget, the prefilling requests take it first and the decoding ones get
    what is left, so a long prompt stalls every decode (the waiting before the running)."""

    def compose(self, live):
        if self.token_budget is None:
            return super().compose(live)
        prefilling = [x for x in live if not x.decoding]
        decoding = [x for x in live if x.decoding and not x.done]
        budget, rows = self.token_budget, []
        for x in prefilling + decoding:  # BUG: prefills first (the spec puts decodes first)
            if budget == 0:
                break
            rows.append((x, x.next_ids(budget)))
            budget -= len(rows[-1][1])
        return rows


class BudgetPlusOne(Scheduler):
    """BROKEN: a step may carry ``token_budget + 1`` new tokens (``<=`` where ``<`` was
    meant)."""

    def compose(self, live):
        if self.token_budget is None:
            return super().compose(live)
        self.token_budget += 1  # BUG: one past the budget
        try:
            return super().compose(live)
        finally:
            self.token_budget -= 1


class PreemptOldest(Scheduler):
    """BROKEN: preemption takes the oldest admitted request, the one closest to finishing,
    instead of the most recently admitted."""

    def victim(self, live: list[LiveRequest]) -> LiveRequest:
        return live[0]  # BUG: live[-1]
