"""Checks of the scheduler (:mod:`kvdoc.serving.scheduler`): every request against its solo run.

* :func:`compare_trace_with_alone`: each request of a served trace against
  :func:`kvdoc.core.model.generate` on its prompt alone (the tokens) and one full forward over
  prompt + tokens (the logits behind each choice, within :data:`kvdoc.proofs.verify.TOLERANCE`).
* :func:`check_policies`: static, continuous and chunked-prefill runs of one trace, each compared
  so, with the block invariants of :attr:`~kvdoc.serving.scheduler.ServeRun.invariants_hold`.
* Broken schedulers the checks must catch: :class:`SharedStartScheduler` (a newly admitted row
  embedded from the step's common start instead of its own length) and
  :class:`LeakingScheduler` (a finished request's table cleared, its blocks never given back).
* :func:`scheduling_scenario`: the check as a scenario of the verification grid
  (:mod:`kvdoc.proofs.scenarios` signature), on the paged kind of the learned-position models.

>>> from kvdoc.proofs.verify import default_model
>>> from kvdoc.serving.scheduler import arrival_trace, serve
>>> model = default_model()
>>> trace = arrival_trace(5, prompt_lens=(2, 8), output_lens=(1, 5), max_gap=2, seed=3)
>>> all(c.passed for c in compare_trace_with_alone(model, trace, serve(model, trace, 12)))
True
>>> broken = SharedStartScheduler(model, num_blocks=12).run(trace)
>>> all(c.passed for c in compare_trace_with_alone(model, trace, broken))
False
>>> LeakingScheduler(model, num_blocks=12).run(trace).invariants_hold
False
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder, generate
from kvdoc.serving.scheduler import (
    LiveRequest,
    RaggedStep,
    Request,
    Scheduler,
    ServeRun,
    arrival_trace,
)

from .verify import DTYPE_NAMES, TOLERANCE, close, max_abs


class SharedStartScheduler(Scheduler):
    """BROKEN: every row of a step is embedded at the step's common start ``T - C`` on, not at
    its own length: right only when every row of the step is as long as the longest."""

    def positions(self, view: RaggedStep) -> torch.Tensor:
        C = max(view.new)
        return view.seq_len + torch.arange(C, device=view.device).expand(len(view.new), C)


class LeakingScheduler(Scheduler):
    """BROKEN: retiring a request forgets its table but never gives its blocks back."""

    def retire(self, live: LiveRequest) -> None:
        live.table.clear()  # BUG: no self.pool.release(live.table) first


@dataclass(frozen=True)
class RequestCheck:
    """One served request against its prompt generated alone.

    Attributes:
        rid: the request. logit_error: max ``|served - alone|`` over its steps and the vocabulary.
        logits_close: within ``atol = rtol`` of :data:`kvdoc.proofs.verify.TOLERANCE`.
        same_tokens: the greedy tokens are identical.
    """

    rid: int
    logit_error: float
    logits_close: bool
    same_tokens: bool

    @property
    def passed(self) -> bool:
        return self.logits_close and self.same_tokens


def _alone(model: Decoder, request: Request) -> tuple[list[int], torch.Tensor]:
    """``generate``'s tokens for the prompt alone, and the full forward's logits behind them."""
    device, L = model.wte.weight.device, len(request.prompt)
    out = generate(model, torch.tensor([request.prompt], device=device), request.output_len)
    return out[0, L:].tolist(), model(out[:, :-1]).logits[0, L - 1:]


@torch.no_grad()
def compare_trace_with_alone(model: Decoder, trace: Sequence[Request], run: ServeRun,
                             alone: dict | None = None) -> list[RequestCheck]:
    """Each request of ``trace`` in ``run`` against ``model`` on its prompt alone (``alone``:
    rid -> (tokens, logits), to reuse references over several runs)."""
    tol, checks = TOLERANCE[model.wte.weight.dtype], []
    for r in trace:
        tokens, ref = alone[r.rid] if alone else _alone(model, r)
        got = run.logits.get(r.rid, torch.empty(0))
        checks.append(RequestCheck(r.rid, max_abs(got, ref), close(got, ref, tol),
                                   run.tokens.get(r.rid) == tokens))
    return checks


@dataclass(frozen=True)
class PolicyCheck:
    """One policy on one trace: every request equal to its solo run, and the block invariants."""

    policy: str
    token_budget: int | None
    logit_error: float
    requests_equal: bool
    invariants_hold: bool
    steps: int

    @property
    def passed(self) -> bool:
        return self.requests_equal and self.invariants_hold


POLICIES: tuple[dict, ...] = (dict(policy="static", max_batch=4), dict(),
                              dict(token_budget=6))
"""The runs :func:`check_policies` makes: static batches of 4, continuous, chunked prefill."""


@torch.no_grad()
def check_policies(model: Decoder, trace: Sequence[Request] | None = None,
                   num_blocks: int = 16, block_size: int = 4) -> list[PolicyCheck]:
    """Serve ``trace`` (default: 5 requests, seed 0) under each of :data:`POLICIES`; compare every
    request with its solo run.

    >>> from kvdoc.proofs.verify import default_model
    >>> [(c.policy, c.token_budget, c.passed) for c in check_policies(default_model())]
    [('static', None, True), ('continuous', None, True), ('continuous', 6, True)]
    """
    trace = trace or arrival_trace(5, prompt_lens=(2, 8), output_lens=(1, 5), max_gap=2)
    alone = {r.rid: _alone(model, r) for r in trace}
    checks = []
    for options in POLICIES:
        run = Scheduler(model, num_blocks, block_size, **options).run(trace)
        rows = compare_trace_with_alone(model, trace, run, alone)
        checks.append(PolicyCheck(run.policy, run.token_budget,
                                  max(c.logit_error for c in rows), all(c.passed for c in rows),
                                  run.invariants_hold, len(run.steps)))
    return checks


def scheduling_scenario(case, out: list) -> None:
    """The ``scheduling`` check on one combination of the grid (a scenario of
    :mod:`kvdoc.proofs.scenarios`): :func:`check_policies` on the case's model, for the paged
    kind of the model implementation of a learned-position model; not applicable elsewhere."""
    model = case.model
    if case.impl != "model" or case.kind != "paged" or getattr(model, "wpe", None) is None:
        out.append(case.result("scheduling", None, 0.0,
                               "the scheduler runs the model itself, paged, learned positions"))
        return
    checks = check_policies(model)
    ok = all(c.passed for c in checks)
    out.append(case.result("scheduling", ok, max(c.logit_error for c in checks),
                           "static, continuous and chunked-prefill runs of a 5-request trace, "
                           f"each request vs its solo run ({DTYPE_NAMES[case.dtype]}); "
                           "blocks held == blocks named, free + held == pool"))
