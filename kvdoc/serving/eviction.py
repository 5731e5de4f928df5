"""What a radix cache's eviction works on: the tree's :class:`Node` and the policy (:class:`LRU`).

A policy says which leaves eviction may take (``may_evict``) and in what order (``priority``,
lowest first), as SGLang's eviction strategies do
(`evict_policy.py <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/mem_cache/evict_policy.py>`_).
How much of a leaf goes at a time is the tree's ``evict`` argument
(:class:`~kvdoc.serving.radix.RadixCache`): the whole leaf, or its last block.

>>> old, new = Node((1, 2), [0], None, last_used=3), Node((3, 4), [1], None, last_used=7)
>>> min([new, old], key=LRU().priority) is old, LRU().may_evict(Node((), [], None, lock=1))
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    """A node of the tree: the edge from its parent (``tokens``) and the blocks holding them.

    ``len(tokens) == len(blocks) * block_size``. ``lock`` counts the running requests whose
    matched prefix runs through this node; ``last_used`` is the tree's clock at its last match.
    """

    tokens: tuple[int, ...]
    blocks: list[int]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # by first block's ids
    lock: int = 0
    last_used: int = 0


class LRU:
    """The eviction policy: a leaf no running request locks, the one used longest ago first."""

    def may_evict(self, node: Node) -> bool:
        """No running request uses it (its path from the root is unlocked)."""
        return node.lock == 0

    def priority(self, node: Node) -> int:
        """Lower goes first: the tree's clock at the node's last match."""
        return node.last_used
