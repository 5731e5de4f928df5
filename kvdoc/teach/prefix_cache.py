"""Checks of the radix-tree prefix cache (:mod:`kvdoc.serving.radix`).

:func:`compare_workload` holds every request served through the tree to itself alone (logits
within the tolerance, greedy tokens equal ``generate``'s), with :func:`invariant_errors` after
each and every block free once the tree is cleared; :func:`check_locked_eviction` and
:func:`check_admission` hold the admission contracts at their edges. The broken trees of
:mod:`kvdoc.teach.broken_shown` are what each must catch (``tests/test_radix.py``):

>>> from kvdoc.teach.broken_shown import EvictLocked
>>> from kvdoc.proofs.compare import default_model
>>> check_locked_eviction(default_model()).passed, check_locked_eviction(default_model(),
...                                                                      EvictLocked).passed
(True, False)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder, generate
from kvdoc.proofs.compare import TOLERANCE, close, max_abs
from kvdoc.serving.paged import BlockPool
from kvdoc.serving.prefix_workload import Turn, WorkloadRun, run_workload
from kvdoc.serving.radix import RadixCache, serve_prompt


def invariant_errors(tree: RadixCache) -> list[str]:
    """What is wrong with ``tree``'s bookkeeping: refcounts vs holders, free + held vs the pool,
    running paths and locks, the bytes it reports."""
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
    """One request through the tree against it alone, and what :func:`invariant_errors` found
    after it."""

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
    """The run, one check per request, every block free once the tree was cleared."""

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
    """``turns`` served through a tree, every request against itself alone; the tree is cleared
    at the end."""
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
    """A pool of 6 blocks holding two sequences of 2: a request matching the first and needing
    5 more (2 free + 2 evictable) must be refused, its matched path kept."""
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
    """A prompt of 8 with ``max_new=5`` writes 12 positions, 3 blocks: a pool of 3 must take it.
    In block mode that prompt, found whole, reuses its first block, recomputes the second and
    copies no shared block."""
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

