"""Checks of the radix-tree prefix cache (:mod:`kvdoc.serving.radix`).

:func:`compare_workload` holds every request served through the tree to itself alone (logits
within the tolerance, greedy tokens equal ``generate``'s), with :func:`invariant_errors` after
each and every block free once the tree is cleared; :func:`check_locked_eviction` and
:func:`check_admission` hold the admission contracts at their edges. The broken trees of
:mod:`kvdoc.teach.broken_shown` are what each must catch (``tests/test_radix.py``):

>>> from kvdoc.teach.broken_shown import EvictLocked
>>> from kvdoc.proofs.compare import default_model
>>> model = default_model()
>>> check_locked_eviction(model).passed, check_locked_eviction(model, EvictLocked).passed
(True, False)

Every request can equal its solo run while the tree evicts the wrong leaves (only hit counts
change), or computes nothing for a prompt it holds whole: :func:`check_eviction` follows a small
pool's evictions with :class:`LRUOracle`, which knows nothing of nodes, clocks or locks, and
:func:`check_full_match` serves prompts the tree holds entirely, to their last token. The broken
trees at the end pass :func:`compare_workload`; only these checks see them.

>>> check_eviction(model).passed, check_full_match(model).passed
(True, True)
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder, generate
from kvdoc.proofs.compare import TOLERANCE, close, max_abs
from kvdoc.serving.paged import BlockPool
from kvdoc.serving.prefix_workload import Turn, WorkloadRun, run_workload
from kvdoc.serving.radix import LRU, Node, RadixCache, common_prefix_len, serve_prompt


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
class PolicyCheck:
    """A check of an admission or eviction rule: passed, what it did; for the policy's checks,
    the hits (prompt positions reused) and the evictions checked."""

    passed: bool
    detail: str
    hits: int = 0
    evictions: int = 0


def check_locked_eviction(model: Decoder, tree_cls: type[RadixCache] = RadixCache,
                          block_size: int = 4) -> PolicyCheck:
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
        return PolicyCheck(ok, f"refused ({refused}); {'; '.join(errors) or 'tree as before'}")
    errors = invariant_errors(tree)
    return PolicyCheck(False, f"admitted {request.matched} matched positions; "
                              f"{'; '.join(errors) or 'no invariant broken'}")


def check_admission(model: Decoder, tree_cls: type[RadixCache] = RadixCache,
                    block_size: int = 4) -> PolicyCheck:
    """A prompt of 8 with ``max_new=5`` writes 12 positions, 3 blocks: a pool of 3 must take it.
    In block mode that prompt, found whole, reuses its first block, recomputes the second and
    copies no shared block."""
    weight = model.wte.weight
    prompt = list(range(1, 2 * block_size + 1))
    tree = tree_cls(BlockPool(model.config, 3, block_size, weight.dtype, weight.device))
    try:
        serve_prompt(model, tree, prompt, max_new=block_size + 1)
    except ValueError as refused:
        return PolicyCheck(False, f"a request writing 3 blocks refused by a pool of 3 "
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
    return PolicyCheck(ok, f"pool of 3 took 3 blocks; a whole {len(prompt)}-token prompt "
                           f"matched {matched}, its shared blocks {shared} became {became}"
                           f"{'; ' + '; '.join(errors) if errors else ''}")


# --- the tree's policy against an oracle ---------------------------------------------------


class LRUOracle:
    """What an LRU prefix cache of whole blocks holds, from the requests alone.

    ``used[path]``: the index of the last request that read or wrote the block ending ``path``.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.used: dict[tuple[int, ...], int] = {}

    def match(self, prompt: Sequence[int]) -> int:
        """Prompt positions the cache gives a request: the longest common prefix with a cached
        path, short of the prompt's last token."""
        longest = max((common_prefix_len(prompt, p) for p in self.used), default=0)
        return min(longest, len(prompt) - 1)

    def read(self, prompt: Sequence[int], matched: int) -> set[tuple[int, ...]]:
        """The cached paths a match of ``matched`` positions reads (its last block may be one
        it shares only in part)."""
        S = self.block_size
        return {p for p in self.used if len(p) <= math.ceil(matched / S) * S
                and common_prefix_len(prompt, p) >= min(len(p) - S + 1, matched)}

    def leaves(self) -> list[tuple[int, ...]]:
        return [p for p in self.used
                if not any(len(q) > len(p) and q[:len(p)] == p for q in self.used)]

    def evicted(self, path: tuple[int, ...], blocks: int, reading: set) -> str | None:
        """Check one eviction of ``blocks`` blocks ending ``path``; forget them. What is wrong,
        or None."""
        S = self.block_size
        chain = [path[:len(path) - j * S] for j in range(blocks)]
        if any(p not in self.used for p in chain):
            return f"evicted {len(path)} tokens the cache does not hold"
        candidates = [p for p in self.leaves() if p not in reading]
        if path not in candidates:
            return f"evicted a path of {len(path)} tokens that is not an unread leaf"
        oldest = min(self.used[p] for p in candidates)
        if self.used[path] != oldest:
            return (f"evicted a leaf last used by request {self.used[path]}; request {oldest}'s "
                    f"is older")
        for p in chain:
            del self.used[p]
        return None


def eviction_trace(vocab: int, seed: int = 0, docs: int = 4, doc_len: int = 8,
                   order: Sequence[int] = (0, 1, 2, 0, 3, 1, 0, 2, 3, 1)
                   ) -> list[tuple[int, ...]]:
    """Prompts that reuse ``docs`` documents of ``doc_len`` tokens in ``order``, each followed
    by a question of 3 tokens, ids from a ``torch.Generator`` seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (n,), generator=g).tolist())

    texts = [ids(doc_len) for _ in range(docs)]
    return [texts[d] + ids(3) for d in order]


@torch.no_grad()
def check_eviction(model: Decoder, tree_cls: type[RadixCache] = RadixCache,
                   num_blocks: int = 10, block_size: int = 4, max_new: int = 2,
                   evict: str = "leaf") -> PolicyCheck:
    """Serve :func:`eviction_trace` through a tree of ``num_blocks`` blocks that evicts by
    ``evict`` (whole leaves, or one block at a time), each request against :class:`LRUOracle`:
    the match, every eviction (in block mode: of one block), the cached set afterwards."""
    weight, S = model.wte.weight, block_size
    tree = tree_cls(BlockPool(model.config, num_blocks, S, weight.dtype, weight.device),
                    evict=evict)
    oracle, hits, evictions = LRUOracle(S), 0, 0
    for i, prompt in enumerate(eviction_trace(model.config.vocab_size)):
        matched = oracle.match(prompt)
        reading = oracle.read(prompt, matched)
        free = num_blocks - len(oracle.used)
        need = math.ceil((len(prompt) + max_new - 1) / S) - matched // S
        logged = len(tree.evictions)
        served = serve_prompt(model, tree, prompt, max_new)
        if served.matched != matched:
            return PolicyCheck(False, f"request {i} reused {served.matched} positions, the "
                                      f"oracle {matched}", hits)
        for n, (path, blocks) in enumerate(tree.evictions[logged:]):  # all at admission
            if free >= need:
                return PolicyCheck(False, f"request {i}: evicted with {free} blocks free of "
                                          f"the {need} it writes", hits)
            wrong = oracle.evicted(path, blocks, reading)
            if evict == "block" and blocks != 1:
                wrong = f"evicted {blocks} blocks at once, not one"
            if wrong:
                return PolicyCheck(False, f"request {i}, eviction {n}: {wrong}", hits)
            free += blocks
        hits, evictions = hits + matched, len(tree.evictions)
        kept = served.tokens[:-1]
        for p in reading | {kept[:k * S] for k in range(1, len(kept) // S + 1)}:
            oracle.used[p] = i
        cached = {end[:len(end) - j * S] for node in tree.nodes()
                  for end in [tree.tokens_to(node)] for j in range(len(node.blocks))}
        if cached != set(oracle.used) or invariant_errors(tree):
            return PolicyCheck(False, f"after request {i} the tree holds {len(cached)} block "
                                      f"paths, the oracle {len(oracle.used)}", hits)
    unit = "leaf" if evict == "leaf" else "leaf's last block"
    return PolicyCheck(True, f"{i + 1} requests on {num_blocks} blocks: {evictions} evictions, "
                             f"each the least recently used {unit}; {hits} prompt positions "
                             "reused, as the oracle predicts", hits, evictions)


@torch.no_grad()
def check_full_match(model: Decoder, tree_cls: type[RadixCache] = RadixCache,
                     block_size: int = 4, max_new: int = 3) -> PolicyCheck:
    """A sequence of two blocks goes into the tree; then its 8 tokens, and its first 6, come
    as prompts held entirely: each must reuse all but its last token, and equal its solo run."""
    weight, S = model.wte.weight, block_size
    tree = tree_cls(BlockPool(model.config, 16, S, weight.dtype, weight.device))
    first = serve_prompt(model, tree, list(range(3, 3 + 2 * S - 1)), max_new=2)
    tol, reused, worst = TOLERANCE[weight.dtype], [], 0.0
    for length in (2 * S, 2 * S - 2):  # on a block boundary, and inside a block
        prompt = list(first.tokens[:length])
        try:
            served = serve_prompt(model, tree, prompt, max_new)
        except Exception as exc:  # the code under test failed: a failed check
            return PolicyCheck(False, f"a {length}-token prompt held whole raised "
                                      f"{type(exc).__name__}: {exc}")
        ids = torch.tensor([served.tokens], device=weight.device)
        full = model(ids[:, :-1]).logits[:, served.matched:]
        alone = generate(model, ids[:, :length], max_new)
        worst = max(worst, max_abs(served.logits, full))
        if (served.matched != length - 1 or not close(served.logits, full, tol)
                or not torch.equal(alone, ids) or invariant_errors(tree)):
            return PolicyCheck(False, f"a {length}-token prompt held whole reused "
                                      f"{served.matched} positions, logits off by "
                                      f"{max_abs(served.logits, full):.1e}", served.matched)
        reused.append(served.matched)
    return PolicyCheck(True, f"prompts of {2 * S} and {2 * S - 2} tokens held whole reused "
                             f"{reused[0]} and {reused[1]}, the last token computed; logits "
                             f"within {worst:.1e}", sum(reused))


class MostRecentFirst(LRU):
    """BROKEN: an eviction policy that takes the most recently used leaf first."""

    def priority(self, node: Node) -> int:
        return -node.last_used  # BUG: LRU's order reversed


def most_recent_first() -> type[RadixCache]:
    """A :class:`~kvdoc.serving.radix.RadixCache` factory with :class:`MostRecentFirst` passed
    as its ``policy``."""
    return functools.partial(RadixCache, policy=MostRecentFirst())


class LastTokenFromTree(RadixCache):
    """BROKEN: the match is cut one token short of the prompt only in block mode; in token
    mode a prompt the tree holds entirely is matched to its last token, whose logits then are
    never computed."""

    def reusable(self, prompt):
        length, blocks, node = self.match(prompt)
        if self.granularity == "block":  # BUG: min(length, len(prompt) - 1) in both modes
            length = min(length, len(prompt) - 1) // self.block_size * self.block_size
        return length, blocks[:math.ceil(length / self.block_size)], node
