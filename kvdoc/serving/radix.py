"""A radix-tree prefix cache over token ids whose nodes own blocks of a paged pool.

SGLang's RadixAttention (Zheng et al., 2024), written for reading: a finished request leaves
its K/V in a :class:`RadixCache`, a tree whose edges are runs of token ids and whose nodes own
the :class:`~kvdoc.serving.paged.BlockPool` blocks holding them; a new request's
:class:`~kvdoc.serving.paged.PagedCache` starts from the blocks of its longest prefix found,
shared, and only the rest of its prompt is prefilled. Rules:

* **Whole blocks in the tree**: every block belongs to one node; a partly filled last block is
  not kept.
* **Token granularity** (the default): a match may end inside a block, which the request then
  shares; its first write copies it (copy-on-write), so the tree's block never changes.
  ``granularity="block"`` keeps whole matched blocks only, as vLLM's prefix caching does.
* **At least one token to compute**: a prompt found whole still prefills its last token, whose
  logits choose the next one.
* **Reference counts**: every holder of a block, node or running request, holds a reference; a
  running request locks its path from the root (before :meth:`RadixCache.admit` makes room).
* **Eviction** of unlocked leaves in the policy's order (:class:`LRU`) when the pool lacks
  blocks: a leaf whole (``evict="leaf"``, SGLang's) or its last block first (``evict="block"``,
  the order of vLLM V1's free queue).

>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> tree = RadixCache(BlockPool(model.config, num_blocks=8, block_size=4))
>>> a = serve_prompt(model, tree, [5, 6, 7, 8, 9, 10], max_new=3)  # 8 tokens: 2 blocks kept
>>> b = serve_prompt(model, tree, [5, 6, 7, 8, 9, 11, 12], max_new=2)
>>> a.matched, b.matched  # b shares block 0 whole and one position of block 1 (then copied)
(0, 5)
>>> print(tree.render(width=2))  # b's copy of block 1 is block 2
root
└── 4 tokens [5 6 ...], blocks [0]
    ├── 4 tokens [9 10 ...], blocks [1]
    └── 4 tokens [9 11 ...], blocks [2]
>>> tree.clear(); tree.pool.num_free
8
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvdoc.core.model import Decoder
from kvdoc.core.state import snapshot

from .paged import BlockPool, PagedCache, paged_cache
from .snapshots import SnapshotStore, Where, store_for


@dataclass(eq=False)
class Node:
    """A node: the edge from its parent (``tokens``) and the blocks holding them; ``lock``: the
    running requests whose prefix runs through it; ``last_used``: the tree's clock then."""

    tokens: tuple[int, ...]
    blocks: list[int]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # by first block's ids
    lock: int = 0
    last_used: int = 0


class LRU:
    """The eviction policy, as SGLang's strategies say it: which leaves may go (``may_evict``)
    and in what order (``priority``, lowest first): unlocked, the one used longest ago first.

    >>> old, new = Node((1, 2), [0], None, last_used=3), Node((3, 4), [1], None, last_used=7)
    >>> min([new, old], key=LRU().priority) is old, LRU().may_evict(Node((), [], None, lock=1))
    (True, False)
    """

    def may_evict(self, node: Node) -> bool:
        return node.lock == 0

    def priority(self, node: Node) -> int:
        return node.last_used


@dataclass(eq=False)
class Admission:
    """A request admitted by :meth:`RadixCache.admit`: its cache starts ``matched`` positions in."""

    prompt: tuple[int, ...]
    matched: int
    cache: PagedCache
    node: Node  # the deepest node locked for it (the root if nothing matched)
    saved: list = field(default_factory=list)  # a hybrid model's snapshots, taken in its prefill


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the common prefix of ``a`` and ``b`` (token ids, or a string's characters)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


class RadixCache:
    """A radix tree over token ids whose nodes own blocks of ``pool``; ``granularity`` and
    ``evict`` as in the module docstring; ``policy``: an object with ``may_evict(node)`` and
    ``priority(node)`` (default :class:`LRU`); ``states``: for a hybrid model, where prefills
    save recurrent states (:data:`~kvdoc.serving.snapshots.WHERE`, or a
    :class:`~kvdoc.serving.snapshots.SnapshotStore`)."""

    def __init__(self, pool: BlockPool, granularity: Literal["token", "block"] = "token",
                 policy: LRU | None = None, evict: Literal["leaf", "block"] = "leaf",
                 states: Where | SnapshotStore | None = None) -> None:
        if granularity not in ("token", "block"):
            raise ValueError(f"granularity must be 'token' or 'block', got {granularity!r}")
        if evict not in ("leaf", "block"):
            raise ValueError(f"evict must be 'leaf' or 'block', got {evict!r}")
        self.pool, self.block_size, self.granularity = pool, pool.block_size, granularity
        self.unit = evict
        self.policy = LRU() if policy is None else policy
        self.states = store_for(pool, states)  # None: no recurrent layer, no state to save
        self.root = Node((), [], None)
        self.running: list[Admission] = []
        self.clock = 0
        self.evicted_nodes = self.evicted_blocks = 0
        self.evictions: list[tuple[tuple[int, ...], int]] = []
        """Each eviction, in order: the token ids from the root to the end of what was evicted,
        and its blocks (a whole leaf's, or 1)."""

    # --- looking up -----------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> tuple[int, list[int], Node]:
        """The longest prefix of ``tokens`` held: ``(length, blocks, deepest node)``, ``blocks``
        covering positions ``0 .. length - 1`` (the last may hold another sequence's after)."""
        S, node, pos, blocks = self.block_size, self.root, 0, []
        while True:
            child = node.children.get(tuple(tokens[pos:pos + S]))
            if child is None:  # no whole first block agrees: at most part of one child's
                rest = tokens[pos:pos + S]
                best = max(node.children.values(), default=None,
                           key=lambda c: common_prefix_len(c.tokens[:S], rest))
                if best is not None and common_prefix_len(best.tokens[:S], rest) > 0:
                    pos += common_prefix_len(best.tokens[:S], rest)
                    blocks.append(best.blocks[0])
                    node = best
                break
            n = common_prefix_len(child.tokens, tokens[pos:])
            blocks += child.blocks[:math.ceil(n / S)]
            pos, node = pos + n, child
            if n < len(child.tokens):
                break
        if self.granularity == "block":
            pos = pos // S * S
            blocks = blocks[:pos // S]
        return pos, blocks, node

    def reusable(self, prompt: Sequence[int]) -> tuple[int, list[int], Node]:
        """What a request for ``prompt`` takes: :meth:`match`, short of the last prompt token,
        in block mode rounded down to whole blocks, for a hybrid model to a saved state."""
        length, blocks, node = self.match(prompt)
        length = min(length, len(prompt) - 1)
        if self.granularity == "block":  # a whole prompt found: its last block is recomputed
            length = length // self.block_size * self.block_size
        if self.states is not None:  # a recurrent state resumes only where one was saved
            length = self.states.deepest(prompt, length)
        return length, blocks[:math.ceil(length / self.block_size)], node

    # --- a request's life -----------------------------------------------------------------
    def admit(self, prompt: Sequence[int], max_new: int = 0) -> Admission:
        """Match ``prompt``, lock its path, evict until the free list covers what it will write
        (``len(prompt) + max_new - 1`` positions), and give it a cache holding the matched
        positions. A ValueError, the tree as it was (but an edge cut at the match), if even
        evicting every unlocked node leaves too few blocks."""
        prompt = tuple(int(t) for t in prompt)
        if not prompt or max_new < 0:
            raise ValueError(f"need a non-empty prompt and max_new >= 0, got {len(prompt)} tokens "
                             f"and max_new={max_new}")
        S = self.block_size
        length, blocks, node = self.reusable(prompt)
        # the last token is chosen, never fed: the cache ends one short of prompt + output
        written = len(prompt) + max(max_new - 1, 0)
        needed = math.ceil(written / S) - length // S
        node = self._cut(node, len(blocks))
        self._lock(node, +1)  # before making room: eviction must not take this path
        # an unlocked node's whole subtree is unlocked: leaf by leaf, all of it can go
        evictable = sum(len(n.blocks) for n in self.nodes() if self.policy.may_evict(n))
        if needed > self.pool.num_free + evictable:
            self._lock(node, -1)
            raise ValueError(f"out of blocks: a request of {len(prompt)} + {max_new} positions "
                             f"needs {needed} blocks, {self.pool.num_free} free and {evictable} "
                             f"evictable of {self.pool.num_blocks}")
        self.evict(needed - self.pool.num_free)
        cache = paged_cache(self.pool, 1)
        cache.tables[0].extend(blocks)
        self.pool.share(blocks)
        cache.finish(length)  # the shared blocks hold exactly these positions
        if self.states is not None:
            self.states.restore(cache, prompt[:length])
        request = Admission(prompt, length, cache, node)
        self.running.append(request)
        return request

    def retire(self, request: Admission, tokens: Sequence[int]) -> int:
        """Keep a finished request's whole blocks, unlock its path, release its cache."""
        tokens = tuple(int(t) for t in tokens)
        cache = request.cache
        if request not in self.running:
            raise ValueError("this request is not running in this tree")
        overlap = min(len(tokens), len(request.prompt))
        if len(tokens) != cache.seq_len or tokens[:overlap] != request.prompt[:overlap]:
            raise ValueError(f"tokens must be the {cache.seq_len} ids the cache holds, starting "
                             f"with the prompt; got {len(tokens)}")
        whole = cache.seq_len // self.block_size
        gained = self.insert(tokens[:whole * self.block_size], cache.tables[0][:whole])
        if self.states is not None:
            self.states.keep(tokens, request.saved, whole * self.block_size)
        self._lock(request.node, -1)
        self.running.remove(request)
        cache.release()
        return gained

    # --- the tree -------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Put ``tokens`` (whole blocks in ``blocks``) into the tree; returns blocks gained."""
        S = self.block_size
        if len(tokens) != len(blocks) * S:
            raise ValueError(f"{len(tokens)} tokens are not the {len(blocks)} whole blocks given")
        node, pos = self.root, 0
        self.clock += 1
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + S]))
            if child is None:
                new = Node(tuple(tokens[pos:]), list(blocks[pos // S:]), node,
                           last_used=self.clock)
                node.children[new.tokens[:S]] = new
                self.pool.share(new.blocks)
                return len(new.blocks)
            # >= 1: the first block agrees
            whole = common_prefix_len(child.tokens, tokens[pos:]) // S
            if whole < len(child.blocks):
                child = self._split(child, whole)
            child.last_used = self.clock
            node, pos = child, pos + whole * S
        return 0

    def _cut(self, node: Node, used: int) -> Node:
        """The node holding exactly ``node``'s first ``used`` blocks (splitting ``node``)."""
        start = sum(len(n.blocks) for n in self._path(node)) - len(node.blocks)
        while node is not self.root and used <= start:
            node = node.parent
            start -= len(node.blocks)
        if node is not self.root and used - start < len(node.blocks):
            node = self._split(node, used - start)
        return node

    def _path(self, node: Node) -> list[Node]:
        path = []
        while node is not None:
            path.append(node)
            node = node.parent
        return path

    def tokens_to(self, node: Node) -> tuple[int, ...]:
        """The token ids from the root to the end of ``node``'s edge."""
        return sum((n.tokens for n in reversed(self._path(node))), ())

    def _split(self, child: Node, whole: int) -> Node:
        """Cut ``child``'s edge after ``whole`` blocks; returns the new upper node."""
        S = self.block_size
        upper = Node(child.tokens[:whole * S], child.blocks[:whole], child.parent,
                     lock=child.lock, last_used=child.last_used)
        child.parent.children[upper.tokens[:S]] = upper
        child.tokens, child.blocks, child.parent = (child.tokens[whole * S:],
                                                    child.blocks[whole:], upper)
        upper.children[child.tokens[:S]] = child
        return upper

    def _lock(self, node: Node, delta: int) -> None:
        self.clock += 1
        while node is not None:
            node.lock += delta
            node.last_used = self.clock
            node = node.parent

    def drop(self, leaf: Node, n: int) -> None:  # free the last n blocks, cut their tokens
        self.pool.release(leaf.blocks[-n:])
        leaf.tokens, leaf.blocks = leaf.tokens[:-n * self.block_size], leaf.blocks[:-n]

    def evict(self, blocks: int) -> int:
        """Evict allowed leaves, lowest priority first, till ``blocks`` are freed (or none left)."""
        freed = 0
        while freed < blocks:
            leaves = [n for n in self.nodes() if not n.children and self.policy.may_evict(n)]
            if not leaves:
                break
            leaf = min(leaves, key=self.policy.priority)
            path = self.tokens_to(leaf)
            n = 1 if self.unit == "block" else len(leaf.blocks)
            self.evictions.append((path, n))
            self.drop(leaf, n)
            if not leaf.blocks:  # the key it is filed under was its first block
                del leaf.parent.children[path[len(path) - n * self.block_size:][:self.block_size]]
                self.evicted_nodes += 1
            freed += n
        self.evicted_blocks += freed
        if self.states is not None and freed:  # a state is no use without the rows before it
            self.states.prune(lambda ids: self.match(ids)[0])
        return freed

    def clear(self) -> None:
        """Give back every block the tree holds (no request may be running)."""
        if self.running:
            raise ValueError(f"{len(self.running)} requests are still running")
        for node in list(self.nodes()):
            self.pool.release(node.blocks)
        self.root.children.clear()
        if self.states is not None:
            self.states.saved.clear()

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, depth first."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def blocks_held(self) -> int:
        """Blocks the tree holds."""
        return sum(len(n.blocks) for n in self.nodes())

    def nbytes(self) -> int:
        """Bytes of the blocks the tree holds (K and V of every layer)."""
        return self.blocks_held() * self.pool.block_nbytes

    def render(self, width: int = 6) -> str:
        """The tree as text: each node's length, first ``width`` token ids and blocks."""
        lines = ["root"]

        def walk(node: Node, indent: str) -> None:
            kids = sorted(node.children.values(), key=lambda n: n.tokens)
            for i, kid in enumerate(kids):
                last = i == len(kids) - 1
                ids = " ".join(map(str, kid.tokens[:width]))
                more = " ..." if len(kid.tokens) > width else ""
                lock = f", locked by {kid.lock}" if kid.lock else ""
                lines.append(f"{indent}{'└── ' if last else '├── '}{len(kid.tokens)} tokens "
                             f"[{ids}{more}], blocks [{' '.join(map(str, kid.blocks))}]{lock}")
                walk(kid, indent + ("    " if last else "│   "))

        walk(self.root, "")
        return "\n".join(lines)


# --- using it ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Served:
    """A request served through the tree: its tokens, its positions found, computed logits."""

    tokens: tuple[int, ...]
    prompt_len: int
    matched: int
    logits: torch.Tensor


@torch.no_grad()
def serve_prompt(model: Decoder, tree: RadixCache, prompt: Sequence[int],
                 max_new: int) -> Served:
    """Admit ``prompt``, prefill what the tree lacks, decode, and leave the result in it."""
    if max_new < 1:
        raise ValueError(f"max_new must be at least 1, got {max_new}")
    request = tree.admit(prompt, max_new)
    device = model.wte.weight.device
    tokens, cache, steps = list(request.prompt), request.cache, []
    # a hybrid model's prefill stops at each position where it saves its states (a branching
    # point: where the rows the tree holds end, short of the last token)
    rows = min(tree.match(tokens)[0], len(tokens) - 1)
    cuts = [] if tree.states is None else tree.states.points(len(tokens), request.matched, rows)
    for start, end in zip([request.matched, *cuts], [*cuts, len(tokens)], strict=True):
        if end > start:
            logits, cache = model(torch.tensor([tokens[start:end]], device=device), cache)
            steps.append(logits)
        if end in cuts:
            request.saved.append(snapshot(cache))
    while True:
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) == len(prompt) + max_new:
            break
        logits, cache = model(torch.tensor([tokens[-1:]], device=device), cache)
        steps.append(logits)
    request.cache = cache  # a hybrid model's call returns a copy (its states replaced)
    tree.retire(request, tokens[:-1])  # the last token was never fed: its K/V is not held
    return Served(tuple(tokens), len(prompt), request.matched, torch.cat(steps, dim=1))
