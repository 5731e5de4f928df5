"""The checks of what equality with a solo run cannot see, as scenarios of the verification grid.

A request served by the scheduler or through the radix cache can equal its solo run while the
policy around it is wrong, and greedy decoding can be right while sampling is not. Each check
here compares a component with something other than itself:

* ``schedule``: every step of the scheduler against its written specification
  (:func:`kvdoc.proofs.schedule_spec.check_schedule`).

Each runs on the paged kind of the model implementation of every model (the scheduler and the
tree build their own pools); a broken variant's scheduler class is ``case.caches["scheduler"]``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvdoc.serving.scheduler import Scheduler

from .schedule_spec import check_schedule

CHECKS: dict[str, str] = {
    "schedule": "every step's rows, queue, preemptions and blocks vs the scheduler's written "
                "specification",
}
"""The checks these scenarios make, by name, with what each compares."""


def _applies(case, check: str, out: list) -> bool:
    if case.impl == "model" and case.kind == "paged":
        return True
    out.append(case.result(check, None, 0.0, "runs the model itself over its own paged blocks"))
    return False


def schedule_scenario(case, out: list) -> None:
    """``schedule``: :func:`~kvdoc.proofs.schedule_spec.check_schedule` on the case's model."""
    if not _applies(case, "schedule", out):
        return
    checks = check_schedule(case.model, case.caches.get("scheduler", Scheduler))
    wrong = [c.difference for c in checks if not c.passed]
    out.append(case.result(
        "schedule", not wrong, float(len(wrong)),
        f"{len(checks)} runs ({sum(c.steps for c in checks)} steps, "
        f"{sum(c.preemptions for c in checks)} preemptions): static, prefill-first, budgets "
        "of 6 and 5, preemption on 8 blocks" + (f"; first difference: {wrong[0]}" if wrong
                                                 else ", every step as specified")))


SCENARIOS: dict[str, Callable] = {"schedule": schedule_scenario}
"""Scenario name -> function, as :data:`kvdoc.proofs.scenarios.SCENARIOS` takes them."""
