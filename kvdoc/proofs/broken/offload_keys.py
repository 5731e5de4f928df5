"""A deliberately wrong block key for the offload tiers (:mod:`kvdoc.serving.offload`).

:func:`parentless_hash` hashes a block's token ids alone, ignoring its parent's key: two
requests whose blocks hold the same tokens after different prefixes (or at other positions)
get one key, so the second reloads K/V computed for the first.
:func:`kvdoc.serving.offload.check_offload` catches it on
:func:`~kvdoc.serving.offload.multi_turn`'s workload, whose last request repeats a prompt from
its second block on (``tests/test_blocks.py`` shows it).

>>> parentless_hash(b"any parent", [1, 2]) == parentless_hash(None, [1, 2])
True
"""

from __future__ import annotations

from collections.abc import Sequence

from kvdoc.serving.offload import hash_block


def parentless_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of ``tokens`` as if every block were a sequence's first."""
    return hash_block(None, tokens)


BROKEN = {"offload-parentless-hash": parentless_hash}
"""Name -> the broken ``hash_fn`` for :func:`kvdoc.serving.offload.serve`."""
