"""Workloads whose prompts share prefixes (few-shot prompts, multi-turn chat, and
:func:`prefix_workload`, the page's: both), served one request after another through one
:class:`~kvdoc.serving.radix.RadixCache` by :func:`run_workload`; and :func:`chat_prompts`,
prompts alone as a chat server receives them, with the mistakes that defeat a prefix cache.

>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> turns = few_shot_workload(requests=3)
>>> run = run_workload(Decoder(GPTConfig()).eval(), turns, num_blocks=32)
>>> run.prompt_tokens == sum(len(t.text) for t in turns), run.reused_tokens > 0
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvdoc.core.model import Decoder

from .paged import BlockPool
from .radix import RadixCache, Served, serve_prompt
from .requests import random_ids


@dataclass(frozen=True)
class Turn:
    """A request: ``text`` after request ``after``'s whole sequence, if given; ``kind``, a label."""

    text: tuple[int, ...]
    max_new: int
    kind: str
    after: int | None = None


def few_shot_workload(seed: int = 0, requests: int = 6, vocab: int = 97, tasks: int = 2,
                      instruction: int = 10, examples: int = 3, example_len: int = 7,
                      question: tuple[int, int] = (3, 6), max_new: int = 3) -> list[Turn]:
    """Few-shot prompts: a task's instruction and examples, then a question, per request."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [random_ids(g, instruction, vocab)
                + sum((random_ids(g, example_len, vocab) for _ in range(examples)), ())
                for _ in range(tasks)]
    out = []
    for _ in range(requests):
        task = prefixes[int(torch.randint(0, tasks, (), generator=g))]
        out.append(Turn(task + random_ids(g, question, vocab), max_new, "few-shot"))
    return out


def chat_workload(seed: int = 0, conversations: int = 2, turns: int = 3, vocab: int = 97,
                  system: int = 9, message: tuple[int, int] = (3, 6),
                  max_new: int = 4) -> list[Turn]:
    """Multi-turn chat sharing a system prompt: each turn a message after the whole last turn."""
    g = torch.Generator().manual_seed(seed)
    shared, out, last = random_ids(g, system, vocab), [], [None] * conversations
    for _ in range(turns):
        for c in range(conversations):
            user = random_ids(g, message, vocab)
            out.append(Turn(user if last[c] is not None else shared + user, max_new, "chat",
                            last[c]))
            last[c] = len(out) - 1
    return out


def prefix_workload(seed: int = 0) -> list[Turn]:
    """The page's: :func:`few_shot_workload`, then :func:`chat_workload` (``seed + 1``)."""
    few = few_shot_workload(seed)
    chat = [Turn(t.text, t.max_new, t.kind, None if t.after is None else t.after + len(few))
            for t in chat_workload(seed + 1)]  # another seed: its ids must not repeat few-shot's
    return few + chat


SYSTEM, USER, ASSISTANT, END = 1, 2, 3, 4
"""The chat template's markers in :func:`chat_prompts` (text ids start at 10)."""


def chat_prompts(seed: int = 0, conversations: int = 6, turns: int = 4, system: int = 300,
                 user: tuple[int, int] = (20, 80), reply: tuple[int, int] = (60, 200),
                 stamp: bool = False, drift: int = 0, repeat: int = 1,
                 vocab: int = 32000) -> list[tuple[int, ...]]:
    """Chat prompts as a server receives them: a system prompt of ``system`` ids, then every
    earlier turn (user message, assistant reply) and the new user message, each turn wrapped
    in the markers above; conversations arrive in a seeded random order. Sizes (least, most)
    are drawn per message. The mistakes users report, each on request:

    * ``stamp``: 6 ids that change every request (a clock) at token 0;
    * ``drift``: each reply carries ``drift`` ids of reasoning that the template renders in the
      latest reply only, so the next request renders that reply differently;
    * ``repeat``: each prompt is sent ``repeat`` times (retries).
    """
    g = torch.Generator().manual_seed(seed)

    def ids(n: int | tuple[int, int]) -> tuple[int, ...]:
        return random_ids(g, n, vocab, low=10)

    head = (SYSTEM, *ids(system), END)
    talks = [[(ids(user), ids(reply), ids(drift)) for _ in range(turns)]
             for _ in range(conversations)]
    order = [c for c in range(conversations) for _ in range(turns)]
    order = [order[k] for k in torch.randperm(len(order), generator=g).tolist()]
    done, out = [0] * conversations, []
    for c in order:
        t, done[c] = done[c], done[c] + 1
        prompt = list(head)
        for k, (asked, answer, thought) in enumerate(talks[c][:t + 1]):
            prompt += [USER, *asked, END, ASSISTANT]
            if k < t:
                prompt += [*(thought if k == t - 1 else ()), *answer, END]
        for _ in range(repeat):
            clock = ids(6) if stamp else ()
            out.append((*clock, *prompt))
    return out


@dataclass(frozen=True)
class WorkloadRun:
    """Every request of a workload served through one tree, and the tree afterwards."""

    served: list[Served]
    tree: RadixCache

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_len for s in self.served)

    @property
    def reused_tokens(self) -> int:
        """Prompt positions found in the tree: not prefilled."""
        return sum(s.matched for s in self.served)

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens

    @property
    def blocks_saved(self) -> int:
        """Whole blocks shared instead of written (a partly matched block is copied)."""
        return sum(s.matched // self.tree.block_size for s in self.served)


def run_workload(model: Decoder, turns: Sequence[Turn], num_blocks: int, block_size: int = 4,
                 granularity: Literal["token", "block"] = "token",
                 tree_cls: type[RadixCache] = RadixCache,
                 after: Callable[[RadixCache], None] | None = None,
                 evict: Literal["leaf", "block"] = "leaf") -> WorkloadRun:
    """Serve ``turns`` in turn through a new tree, calling ``after(tree)`` after each."""
    weight = model.wte.weight
    pool = BlockPool(model.config, num_blocks, block_size, weight.dtype, weight.device)
    tree = tree_cls(pool, granularity, evict=evict)
    served: list[Served] = []
    for turn in turns:
        before = () if turn.after is None else served[turn.after].tokens
        served.append(serve_prompt(model, tree, before + turn.text, turn.max_new))
        if after is not None:
            after(tree)
    return WorkloadRun(served, tree)
