"""The radix cache's policy against an oracle, and the edge of a prompt found whole.

Every request served through :class:`~kvdoc.serving.radix.RadixCache` can equal its solo run
while the tree evicts the wrong leaves: only hit counts change. :func:`check_eviction` serves a
trace through a small pool and follows it with :class:`LRUOracle`, which knows nothing of nodes,
clocks or locks: it keeps the set of cached block paths (each the token ids from the start of a
sequence to the end of one block) and, for each, the last request that read or wrote it. For
every request it predicts the match (the longest prefix of the prompt among the cached paths,
short of the prompt's last token) and checks each eviction the tree logs
(:attr:`~kvdoc.serving.radix.RadixCache.evictions`): the evicted path was cached, is a leaf (no
cached path extends it), is not read by the request being admitted, and was used no later than
any other such leaf (least recently used; ties may go either way); eviction stops as soon as the
pool has the blocks the request writes. After each request the cached set must be the tree's.

:func:`check_full_match` serves prompts the tree holds entirely, to their last token, one ending
on a block boundary and one inside a block: the last token is computed again (its logits choose
the next token), the logits equal one full forward, the tokens equal ``generate`` alone.

The broken trees at the end serve every request as alone; only these checks see them.

>>> from kvdoc.proofs.compare import default_model
>>> model = default_model()
>>> check_eviction(model).passed, check_full_match(model).passed
(True, True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder, generate
from kvdoc.proofs.compare import TOLERANCE, close, max_abs
from kvdoc.serving.paged import BlockPool
from kvdoc.serving.radix import LRU, Node, RadixCache, common_prefix_len, serve_prompt
from kvdoc.teach.prefix_cache import invariant_errors


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


@dataclass(frozen=True)
class PolicyCheck:
    """A check of the tree's policy: passed, the hits (prompt positions reused), what it did,
    the evictions it checked."""

    passed: bool
    hits: int
    detail: str
    evictions: int = 0


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
            return PolicyCheck(False, hits, f"request {i} reused {served.matched} positions, "
                                            f"the oracle {matched}")
        for n, (path, blocks) in enumerate(tree.evictions[logged:]):  # all at admission
            if free >= need:
                return PolicyCheck(False, hits, f"request {i}: evicted with {free} blocks free "
                                                f"of the {need} it writes")
            wrong = oracle.evicted(path, blocks, reading)
            if evict == "block" and blocks != 1:
                wrong = f"evicted {blocks} blocks at once, not one"
            if wrong:
                return PolicyCheck(False, hits, f"request {i}, eviction {n}: {wrong}")
            free += blocks
        hits, evictions = hits + matched, len(tree.evictions)
        kept = served.tokens[:-1]
        for p in reading | {kept[:k * S] for k in range(1, len(kept) // S + 1)}:
            oracle.used[p] = i
        cached = {end[:len(end) - j * S] for node in tree.nodes()
                  for end in [tree.tokens_to(node)] for j in range(len(node.blocks))}
        if cached != set(oracle.used) or invariant_errors(tree):
            return PolicyCheck(False, hits, f"after request {i} the tree holds "
                                            f"{len(cached)} block paths, the oracle "
                                            f"{len(oracle.used)}")
    unit = "leaf" if evict == "leaf" else "leaf's last block"
    return PolicyCheck(True, hits, f"{i + 1} requests on {num_blocks} blocks: {evictions} "
                                   f"evictions, each the least recently used {unit}; "
                                   f"{hits} prompt positions reused, as the oracle predicts",
                       evictions)


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
            return PolicyCheck(False, 0, f"a {length}-token prompt held whole raised "
                                         f"{type(exc).__name__}: {exc}")
        ids = torch.tensor([served.tokens], device=weight.device)
        full = model(ids[:, :-1]).logits[:, served.matched:]
        alone = generate(model, ids[:, :length], max_new)
        worst = max(worst, max_abs(served.logits, full))
        if (served.matched != length - 1 or not close(served.logits, full, tol)
                or not torch.equal(alone, ids) or invariant_errors(tree)):
            return PolicyCheck(False, served.matched,
                               f"a {length}-token prompt held whole reused {served.matched} "
                               f"positions, logits off by {max_abs(served.logits, full):.1e}")
        reused.append(served.matched)
    return PolicyCheck(True, sum(reused), f"prompts of {2 * S} and {2 * S - 2} tokens held "
                                          f"whole reused {reused[0]} and {reused[1]}, the last "
                                          f"token computed; logits within {worst:.1e}")


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
