"""Deliberately wrong policies: each serves every request exactly as alone, so only a check
against the policy's specification or its distribution can see it.

* :class:`PrefillBeforeDecode`: with a token budget, prompt chunks get the budget before the
  decoding requests; :class:`BudgetPlusOne`: a step carries one token more than the budget;
  :class:`PreemptOldest`: preemption takes the oldest admitted request, not the newest.
* :class:`RestartStream`: a sampled request preempted and recomputed draws from a new generator
  of its seed, so its stream restarts.
* :func:`most_recent_first`: a radix tree whose eviction policy, passed through its public
  ``policy`` argument, evicts the most recently used leaf.
* :class:`WholeLeafAlways`: a radix tree asked to evict one block at a time that evicts whole
  leaves (in least-recently-used order still).
* :class:`LastTokenFromTree`: a radix tree that, matching at token granularity, hands a prompt
  found whole all of its positions, its last token's too, so nothing is left to compute.
* :func:`residual_is_target`: a speculative-sampling rule that redraws a rejected token from the
  target's distribution instead of the residual ``max(0, p - q)``.

>>> from kvdoc.proofs.compare import default_model
>>> from kvdoc.teach.schedule_spec import check_schedule
>>> [c.passed for c in check_schedule(default_model(), BudgetPlusOne)]
[True, True, False, False, False, True]
"""

from __future__ import annotations

import functools
import math

import torch

from kvdoc.serving.eviction import LRU, Node
from kvdoc.serving.radix import RadixCache
from kvdoc.serving.requests import sample_generator
from kvdoc.serving.scheduler import LiveRequest, Scheduler
from kvdoc.serving.speculative import acceptance


class PrefillBeforeDecode(Scheduler):
    """BROKEN: with a budget, the prefilling requests take it first and the decoding ones get
    what is left, so a long prompt stalls every decode (the waiting before the running)."""

    def compose(self, live):
        if self.token_budget is None:
            return super().compose(live)
        prefilling = [x for x in live if not x.decoding]
        decoding = [x for x in live if x.decoding and not x.done]
        budget, rows = self.token_budget, []
        for x in prefilling + decoding:  # BUG: decodes first
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


class RestartStream(Scheduler):
    """BROKEN: a preempted request gets a new generator of its seed, so after its recompute it
    draws the random numbers its first tokens already used."""

    def preempt(self, live: LiveRequest) -> int:
        live.generator = sample_generator(live.req, live.sample)  # BUG: the stream restarts
        return super().preempt(live)


class MostRecentFirst(LRU):
    """BROKEN: an eviction policy that takes the most recently used leaf first."""

    def priority(self, node: Node) -> int:
        return -node.last_used  # BUG: LRU's order reversed


def most_recent_first() -> type[RadixCache]:
    """A :class:`~kvdoc.serving.radix.RadixCache` factory with :class:`MostRecentFirst` passed
    as its ``policy``."""
    return functools.partial(RadixCache, policy=MostRecentFirst())


class WholeLeafAlways(RadixCache):
    """BROKEN: asked to evict one block at a time (``evict="block"``), it evicts whole leaves;
    each eviction is still the least recently used leaf."""

    def __init__(self, pool, granularity="token", policy=None, evict="leaf"):
        super().__init__(pool, granularity, policy, evict)
        self.unit = "leaf"  # BUG: the evict argument is checked, then ignored


class LastTokenFromTree(RadixCache):
    """BROKEN: the match is cut one token short of the prompt only in block mode; in token
    mode a prompt the tree holds entirely is matched to its last token, whose logits then are
    never computed."""

    def reusable(self, prompt):
        length, blocks, node = self.match(prompt)
        if self.granularity == "block":  # BUG: min(length, len(prompt) - 1) in both modes
            length = min(length, len(prompt) - 1) // self.block_size * self.block_size
        return length, blocks[:math.ceil(length / self.block_size)], node


def residual_is_target(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BROKEN: :func:`~kvdoc.serving.speculative.acceptance`, but a rejected proposal is redrawn
    from ``p`` itself, not from ``max(0, p - q)`` normalised."""
    keep, _ = acceptance(p, q)
    return keep, p  # BUG: the residual is the target
