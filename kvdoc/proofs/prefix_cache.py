"""Checks of the radix-tree prefix cache (:mod:`kvdoc.serving.radix`).

* :func:`compare_workload`: every request served through the tree against the same request run
  alone without it: its computed logits against one full forward (within
  :data:`kvdoc.proofs.compare.TOLERANCE`), its greedy tokens against
  :func:`kvdoc.core.model.generate` of its prompt alone; :func:`invariant_errors` after every
  request, and every block free once the tree is cleared.
* :func:`invariant_errors`: each block's reference count is its number of holders (tree nodes and
  running requests); free and held blocks add up to the pool; a block on the free list is held by
  nobody; every running request's path is still in the tree and each node's lock counts the
  requests through it; the bytes the tree reports are those of its blocks in the pool's tensors.
* :func:`check_locked_eviction`: a request that needs more blocks than the unlocked nodes can
  free is refused, and its own matched path is not evicted to make room.
* :func:`check_admission`: a request is admitted into a pool holding exactly the blocks it
  writes (``prompt + max_new - 1`` positions), and in block mode a prompt found whole, ending on
  a block boundary, matches all but its last block and copies nothing (as vLLM and SGLang do).

The broken trees of :mod:`kvdoc.proofs.broken.serving` are what each check must catch:

>>> from kvdoc.proofs.broken.serving import EvictLocked, WholeBlockMatch
>>> from kvdoc.proofs.compare import default_model
>>> from kvdoc.serving.prefix_workload import few_shot_workload
>>> model, turns = default_model(), few_shot_workload(requests=3)
>>> all(r.passed for r in compare_workload(model, turns, num_blocks=64).requests)
True
>>> all(r.passed for r in compare_workload(model, turns, 64, tree_cls=WholeBlockMatch).requests)
False
>>> check_locked_eviction(model).passed, check_locked_eviction(model, EvictLocked).passed
(True, False)
>>> from kvdoc.proofs.broken.serving import ReserveFinalToken, ShareLastBlock
>>> [check_admission(model, t).passed for t in (RadixCache, ReserveFinalToken, ShareLastBlock)]
[True, False, False]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder, generate
from kvdoc.serving.paged import BlockPool
from kvdoc.serving.prefix_workload import Turn, WorkloadRun, few_shot_workload, run_workload
from kvdoc.serving.radix import RadixCache, serve_prompt

from .case import scenario
from .compare import DTYPE_NAMES, TOLERANCE, close, max_abs


def invariant_errors(tree: RadixCache) -> list[str]:
    """What is wrong with ``tree`` and its pool's bookkeeping (empty when nothing is)."""
    pool, errors = tree.pool, []
    holders = Counter(b for n in tree.nodes() for b in n.blocks)
    holders.update(b for r in tree.running for b in r.cache.tables[0])
    wrong = [b for b in range(pool.num_blocks) if pool.refs(b) != holders[b]]
    if wrong:
        errors.append(f"blocks {wrong}: reference count is not the number of holders")
    free = pool._free  # the free list itself, read to check it
    held = sum(pool.refs(b) > 0 for b in range(pool.num_blocks))
    if len(set(free)) != len(free) or len(free) + held != pool.num_blocks:
        errors.append(f"{len(free)} on the free list + {held} held != {pool.num_blocks} blocks")
    if any(pool.refs(b) for b in free):
        errors.append("a block on the free list is held")
    in_tree = set(map(id, tree.nodes())) | {id(tree.root)}
    locks: Counter = Counter()
    for request in tree.running:
        node = request.node
        while node is not None:
            if id(node) not in in_tree:
                errors.append("a node locked by a running request is no longer in the tree")
                break
            locks[id(node)] += 1
            node = node.parent
    if any(n.lock != locks[id(n)] for n in tree.nodes()):
        errors.append("a node's lock is not the number of running requests through it")
    if any(len(n.tokens) != len(n.blocks) * tree.block_size for n in tree.nodes()):
        errors.append("a node's tokens are not whole blocks")
    blocks = [b for n in tree.nodes() for b in n.blocks]
    measured = sum(t[blocks].numel() * t.element_size() for t in (*pool.k, *pool.v))
    if tree.nbytes() != measured:
        errors.append(f"the tree reports {tree.nbytes()} bytes, its blocks hold {measured}")
    return errors


@dataclass(frozen=True)
class RequestCheck:
    """One request with the tree against the same request alone.

    Attributes:
        kind: the workload's label. prompt_len, matched: prompt tokens, and those found in the
            tree. logit_error: max ``|tree - full forward|`` over the positions computed and the
            whole vocabulary. logits_close: within the dtype's tolerance. same_tokens: its
            greedy tokens equal ``generate`` of its prompt alone. invariants: what
            :func:`invariant_errors` found after it.
    """

    kind: str
    prompt_len: int
    matched: int
    logit_error: float
    logits_close: bool
    same_tokens: bool
    invariants: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return self.logits_close and self.same_tokens and not self.invariants


@dataclass(frozen=True)
class WorkloadCheck:
    """:func:`compare_workload`'s result: the run, one check per request, and whether every block
    was free after the tree was cleared."""

    run: WorkloadRun
    requests: list[RequestCheck]
    all_free_after_clear: bool

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.requests) and self.all_free_after_clear


@torch.no_grad()
def compare_workload(model: Decoder, turns: list[Turn], num_blocks: int, block_size: int = 4,
                     granularity: str = "token", tree_cls: type[RadixCache] = RadixCache,
                     evict: str = "leaf") -> WorkloadCheck:
    """Serve ``turns`` through a tree that evicts by ``evict``
    (:func:`kvdoc.serving.prefix_workload.run_workload`) and check every request against itself
    alone; the tree is cleared at the end."""
    after: list[tuple[str, ...]] = []
    run = run_workload(model, turns, num_blocks, block_size, granularity, tree_cls,
                       after=lambda tree: after.append(tuple(invariant_errors(tree))),
                       evict=evict)
    tol, device = TOLERANCE[model.wte.weight.dtype], model.wte.weight.device
    checks = []
    for turn, served, errors in zip(turns, run.served, after, strict=True):
        ids = torch.tensor([served.tokens], device=device)
        full = model(ids[:, :-1]).logits[:, served.matched:]
        alone = generate(model, ids[:, :served.prompt_len], turn.max_new)
        checks.append(RequestCheck(turn.kind, served.prompt_len, served.matched,
                                   max_abs(served.logits, full), close(served.logits, full, tol),
                                   bool(torch.equal(alone, ids)), errors))
    run.tree.clear()
    return WorkloadCheck(run, checks, run.tree.pool.num_free == run.tree.pool.num_blocks
                         and not invariant_errors(run.tree))


@dataclass(frozen=True)
class EvictionCheck:
    passed: bool
    detail: str


def check_locked_eviction(model: Decoder, tree_cls: type[RadixCache] = RadixCache,
                          block_size: int = 4) -> EvictionCheck:
    """A pool of 6 blocks; the tree holds two sequences of 2 blocks each. A request matching the
    first and needing 5 more blocks must be refused (2 free + 2 evictable), its matched path
    kept, and the bookkeeping sound."""
    weight = model.wte.weight
    tree = tree_cls(BlockPool(model.config, 6, block_size, weight.dtype, weight.device))
    first, other = list(range(1, 9)), list(range(20, 28))
    serve_prompt(model, tree, first, max_new=1)
    serve_prompt(model, tree, other, max_new=1)
    before = tree.render()
    try:
        request = tree.admit(first + list(range(40, 56)), max_new=4)
    except ValueError as refused:
        errors = invariant_errors(tree)
        ok = not errors and tree.render() == before
        return EvictionCheck(ok, f"refused ({refused}); {'; '.join(errors) or 'tree as before'}")
    errors = invariant_errors(tree)
    return EvictionCheck(False, f"admitted {request.matched} matched positions; "
                                f"{'; '.join(errors) or 'no invariant broken'}")


def check_admission(model: Decoder, tree_cls: type[RadixCache] = RadixCache,
                    block_size: int = 4) -> EvictionCheck:
    """Two admission contracts at their edges.

    * An 8-token prompt with ``max_new=5`` writes 12 positions: 3 blocks of 4, and a pool of 3
      must take it.
    * Block mode: once that prompt's sequence is in the tree, the same 8 tokens are found whole;
      the request takes the first block (positions 0-3), recomputes the second, and no shared
      block is copied: after it runs, its table starts with the tree's first block and the
      tree's blocks hold what they held.
    """
    weight = model.wte.weight
    prompt = list(range(1, 2 * block_size + 1))
    tree = tree_cls(BlockPool(model.config, 3, block_size, weight.dtype, weight.device))
    try:
        serve_prompt(model, tree, prompt, max_new=block_size + 1)
    except ValueError as refused:
        return EvictionCheck(False, f"a request writing 3 blocks refused by a pool of 3 "
                                    f"({refused})")
    tree.clear()
    tree = tree_cls(BlockPool(model.config, 8, block_size, weight.dtype, weight.device),
                    "block")
    serve_prompt(model, tree, prompt, max_new=block_size + 1)
    kept = [t.clone() for t in (*tree.pool.k, *tree.pool.v)]
    held = sorted(b for n in tree.nodes() for b in n.blocks)
    request = tree.admit(prompt, max_new=1)
    matched, shared = request.matched, list(request.cache.tables[0])
    model(torch.tensor([prompt[matched:]], device=weight.device), request.cache)
    table = list(request.cache.tables[0])
    unchanged = all(torch.equal(t[held], k[held]) for t, k in
                    zip((*tree.pool.k, *tree.pool.v), kept, strict=True))
    tree.retire(request, prompt)
    errors = invariant_errors(tree)
    ok = (matched == block_size and table[:len(shared)] == shared and unchanged
          and not errors)
    became = table[:len(shared)]
    return EvictionCheck(ok, f"pool of 3 took 3 blocks; a whole {len(prompt)}-token prompt "
                             f"matched {matched}, its shared blocks {shared} became {became}"
                             f"{'; ' + '; '.join(errors) if errors else ''}")


@scenario("prefix-cache", {
    "prefix-cache": "requests served through a radix prefix cache vs each request alone"})
def prefix_cache_scenario(case, out: list) -> None:
    """The ``prefix-cache`` check on one combination of the grid (a
    :data:`~kvdoc.proofs.case.Scenario`): a few-shot workload served through a tree, token- and
    block-granular, against each request alone, the locked-eviction refusal and the admission
    edges (a broken variant's tree class comes in as ``case.caches["radix"]``); for the paged
    kind of the model implementation (the tree owns paged blocks), not applicable elsewhere."""
    if case.impl != "model" or case.kind != "paged":
        out.append(case.result("prefix-cache", None, 0.0,
                               "the tree serves the model itself from paged blocks"))
        return
    tree = case.caches.get("radix", RadixCache)  # a broken variant's tree class
    turns = few_shot_workload(requests=3, vocab=case.model.config.vocab_size)
    checks = [compare_workload(case.model, turns, num_blocks=32, granularity=g, tree_cls=tree)
              for g in ("token", "block")]
    eviction = check_locked_eviction(case.model, tree)
    admission = check_admission(case.model, tree)
    ok = all(c.passed for c in checks) and eviction.passed and admission.passed
    error = max(r.logit_error for c in checks for r in c.requests)
    out.append(case.result("prefix-cache", ok, error,
                           "3 few-shot requests through a radix tree (token and block matches) "
                           f"vs each alone ({DTYPE_NAMES[case.dtype]}); refcounts == holders; "
                           f"locked eviction: {eviction.detail}; admission: {admission.detail}"))
