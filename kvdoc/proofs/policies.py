"""The checks of what equality with a solo run cannot see, as scenarios of the verification grid.

A request served by the scheduler or through the radix cache can equal its solo run while the
policy around it is wrong, and greedy decoding can be right while sampling is not. Each check
here compares a component with something other than itself:

* ``schedule``: every step of the scheduler against its written specification
  (:func:`kvdoc.proofs.schedule_spec.check_schedule`).
* ``eviction``: the radix cache's matches and evictions against an LRU oracle on a trace that
  reuses documents through a small pool (:func:`kvdoc.proofs.radix_policy.check_eviction`).
* ``full-match``: prompts the radix cache holds entirely, to their last token
  (:func:`kvdoc.proofs.radix_policy.check_full_match`).
* ``speculative-distribution``: one round of speculative sampling, enumerated exactly on a
  vocabulary of 4, against the target's distribution
  (:func:`kvdoc.proofs.sampling.check_speculative_distribution`).
* ``preempted-stream``: seeded requests preempted and recomputed, each against its
  uninterrupted run with the same seed (:func:`kvdoc.proofs.sampling.check_sampled_preemption`).

Each runs once per model, on the paged kind of the model implementation (the scheduler and the
tree build their own pools); a broken variant's scheduler class is ``case.caches["scheduler"]``,
its tree class ``case.caches["radix"]``, its acceptance rule ``case.caches["acceptance"]``.
"""

from __future__ import annotations

import functools

from kvdoc.serving.radix import RadixCache
from kvdoc.serving.scheduler import Scheduler
from kvdoc.serving.speculative import acceptance

from .case import scenario
from .radix_policy import check_eviction, check_full_match
from .sampling import EXACT, check_sampled_preemption, check_speculative_distribution
from .schedule_spec import check_schedule

CHECKS: dict[str, str] = {
    "schedule": "every step's rows, queue, preemptions and blocks vs the scheduler's written "
                "specification",
    "eviction": "a radix cache's matches, evictions and contents vs an LRU oracle of block paths",
    "eviction-blocks": "the same, the tree evicting one block at a time (vLLM V1's order)",
    "full-match": "prompts a radix cache holds to their last token: last token computed, vs alone",
    "speculative-distribution": "one round of speculative sampling, enumerated exactly, vs the "
                                "target's distribution",
    "preempted-stream": "seeded requests preempted and recomputed vs their uninterrupted runs",
}
"""The checks these scenarios make, by name, with what each compares."""


def _applies(case, out: list, *checks: str) -> bool:
    if case.impl == "model" and case.kind == "paged":
        return True
    out.extend(case.result(check, None, 0.0, "once per model: on the model itself, paged kind")
               for check in checks)
    return False


@scenario("schedule", {"schedule": CHECKS["schedule"]})
def schedule_scenario(case, out: list) -> None:
    """``schedule``: :func:`~kvdoc.proofs.schedule_spec.check_schedule` on the case's model."""
    if not _applies(case, out, "schedule"):
        return
    checks = check_schedule(case.model, case.caches.get("scheduler", Scheduler))
    wrong = [c.difference for c in checks if not c.passed]
    out.append(case.result(
        "schedule", not wrong, float(len(wrong)),
        f"{len(checks)} runs ({sum(c.steps for c in checks)} steps, "
        f"{sum(c.preemptions for c in checks)} preemptions): static, prefill-first, budgets "
        "of 6 and 5, preemption on 8 blocks" + (f"; first difference: {wrong[0]}" if wrong
                                                 else ", every step as specified")))


@scenario("radix-policy", {c: CHECKS[c] for c in ("eviction", "eviction-blocks", "full-match")})
def radix_scenario(case, out: list) -> None:
    """``eviction``, ``eviction-blocks`` and ``full-match``:
    :func:`~kvdoc.proofs.radix_policy.check_eviction` (whole leaves, then single blocks) and
    :func:`~kvdoc.proofs.radix_policy.check_full_match` on the case's model."""
    if not _applies(case, out, "eviction", "eviction-blocks", "full-match"):
        return
    tree = case.caches.get("radix", RadixCache)
    for name, check in (("eviction", check_eviction),
                        ("eviction-blocks", functools.partial(check_eviction, evict="block")),
                        ("full-match", check_full_match)):
        result = check(case.model, tree)
        out.append(case.result(name, result.passed, 0.0 if result.passed else 1.0,
                               result.detail))


@scenario("sampling", {c: CHECKS[c] for c in ("speculative-distribution", "preempted-stream")})
def sampling_scenario(case, out: list) -> None:
    """``speculative-distribution`` and ``preempted-stream`` on the case's model."""
    if not _applies(case, out, "speculative-distribution", "preempted-stream"):
        return
    spec = check_speculative_distribution(case.model, case.caches.get("acceptance", acceptance))
    out.append(case.result(
        "speculative-distribution", spec.passed, spec.error,
        f"vocabulary of {spec.vocab}, {spec.k} proposals from the model at temperature 2: every "
        f"draft, acceptance and redraw enumerated; {spec.k + 1} tokens vs the target's joint "
        f"distribution within {EXACT:.0e} (rejected with probability >= {spec.rejection:.3f})"))
    stream = check_sampled_preemption(case.model, case.caches.get("scheduler", Scheduler))
    out.append(case.result(
        "preempted-stream", stream.passed, stream.logit_error,
        f"5 seeded requests on 8 blocks, {stream.preemptions} preemptions ({stream.interrupted} "
        "after drawing tokens): each request's tokens and logits vs its uninterrupted run"))

