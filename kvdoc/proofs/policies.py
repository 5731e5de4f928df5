"""The ``evicted`` scenario: a prefix cache's eviction judged by what is served after it.

Which leaf or block eviction takes is a decision, and other checks compare decisions with an
oracle; what a request reads afterwards is the K/V in the blocks that survived. Here two prompts
that share a prefix go through a :class:`~kvdoc.serving.radix.RadixCache` over a pool too small
for both, so serving the second evicts from the first (a whole leaf, or its tail blocks one at a
time); then a prompt that follows the first into the middle of a block is served from
whatever the tree kept, and its tokens and every logit it computed must equal one full forward
of its sequence, within the tolerance; matches of any length (``"token"``, sharing and copying
a partly matched block) and of whole blocks (``"block"``). Bookkeeping that keeps the right
counts but the wrong rows passes every decision and fails here.

It runs on the paged kind (the pool the tree's blocks live in), the model's own call. A hybrid
model's tree saves its recurrent states at every block boundary
(:mod:`kvdoc.serving.snapshots`), and no saved state may outlive the rows before it.

>>> from kvdoc.proofs.suite import run_suite
>>> report = run_suite(models=("llama",), kinds=("paged",), impls=("model",),
...                    dtypes=(torch.float32,), scenarios=("evicted",))
>>> report.passed, [r.detail.split(":")[0] for r in report.results]
(True, ['evict=leaf, token matches', 'evict=block, token matches', 'evict=block, block matches'])
"""

from __future__ import annotations

import torch

from kvdoc.serving.paged import BlockPool, paged_cache
from kvdoc.serving.radix import RadixCache, serve_prompt
from kvdoc.serving.snapshots import takes_states

from .case import Case, scenario
from .compare import close, max_abs

BLOCK = 4
SHARED, OWN, NEW = 8, 10, 3
"""Tokens of the prefix both prompts share, of each prompt's own part, generated after each."""
DIVERGE = 6
"""Where the re-served prompt leaves the first one, within its own part: position 14, inside
the block of positions 12 to 15."""
BLOCKS = 7
"""The pool: the first request keeps 5 blocks, the second needs 4 more than the 2 it shares."""


SETTINGS = (("leaf", "token"), ("block", "token"), ("block", "block"))
"""``(evict, granularity)`` the scenario runs: whole leaves or tail blocks evicted, matches
ending inside a block or at whole blocks only."""


def _reserved(case: Case, evict: str, granularity: str,
              tree_cls: type[RadixCache]) -> tuple[bool, float, str]:
    weight = case.model.wte.weight
    pool = BlockPool(case.model.config, BLOCKS, BLOCK, weight.dtype, weight.device)
    # a hybrid model resumes only where a state was saved: at every block boundary here
    states = {"states": "every"} if takes_states(paged_cache(pool, 1)) else {}
    tree = tree_cls(pool, granularity, evict=evict, **states)
    row = case.ids[0].tolist()
    shared, first = row[:SHARED], row[SHARED:SHARED + OWN]
    other = case.alt[0, :OWN].tolist()
    serve_prompt(case.model, tree, shared + first, NEW)
    serve_prompt(case.model, tree, shared + other, NEW)  # makes room by evicting from the first
    if not tree.evicted_blocks:
        return False, float("inf"), f"evict={evict}: nothing was evicted, nothing checked"
    # from the blocks left: the first prompt up to a position inside a block, then other
    # tokens, so a token-granular match shares (and copies) a partly matched block
    again = serve_prompt(case.model, tree, shared + first[:DIVERGE] + other[DIVERGE:], NEW)
    tokens = torch.tensor([again.tokens], device=weight.device)
    full = case.full(tokens[:, :-1])[:, again.matched:]
    want = full.argmax(dim=-1)[0].tolist()
    picked = list(again.tokens[again.prompt_len:])
    # a pick is the full forward's argmax, or within the tolerance of it (a near tie)
    gap = full.max(dim=-1).values - full.gather(-1, tokens[:, again.matched + 1:, None])[..., 0]
    # a saved state is no use without the rows before it: eviction drops both
    orphans = [] if tree.states is None else [
        key for key in tree.states.saved if tree.match(key)[0] < len(key)]
    ok = (close(again.logits, full, case.tol) and again.matched > 0 and not orphans
          and (picked == want[-NEW:] or float(gap[0, -NEW:].max()) <= 2 * case.tol))
    return ok, max_abs(again.logits, full), (
        f"evict={evict}, {granularity} matches: {tree.evicted_blocks} blocks evicted, "
        f"{again.matched} positions re-served from the blocks left, {full.shape[1]} computed"
        + ("" if tree.states is None else f"; {len(tree.states.saved)} saved states, "
           f"{len(orphans)} without their rows"))


@scenario("evicted", {"evicted": "after evictions (whole leaves, tail blocks), a prompt "
                                 "re-served from the blocks left vs one full forward"})
def _evicted(case: Case, out: list) -> None:
    if case.kind != "paged" or case.impl != "model":
        out.append(case.result("evicted", None, 0.0, "the radix tree's pool: the paged kind, "
                               "the model's own call"))
        return
    tree_cls = case.caches.get("radix", RadixCache)  # a variant's tree
    for evict, granularity in SETTINGS:
        ok, error, detail = _reserved(case, evict, granularity, tree_cls)
        out.append(case.result("evicted", ok, error, detail))
