"""The pages' tokens: one printable ASCII character per token, ``id = ord(ch) - 32``.

The printable ASCII characters are ids 0..94 of the default 97-token vocabulary, so prompts read
as ``"ABCDE"``; an id outside the printable capital letters is shown as ``id N`` rather than as a
stray glyph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_ids(text: str) -> torch.Tensor:
    """The ids of ``text``, one character per token (``id = ord(ch) - 32``), as ``[1, T]``.

    >>> token_ids("ABC")
    tensor([[33, 34, 35]])
    """
    bad = [ch for ch in text if not 32 <= ord(ch) < 127]
    if not text or bad:
        raise ValueError(f"token_ids takes a non-empty string of printable ASCII, got {text!r}")
    return torch.tensor([[ord(ch) - 32 for ch in text]])


def token_label(token_id: int | torch.Tensor) -> str:
    """A capital letter for the ids of ``A``..``Z``, else ``id N``: no stray glyphs in tables.

    >>> token_label(33), token_label(76)
    ('A', 'id 76')
    """
    i = int(token_id)
    return chr(i + 32) if "A" <= chr(i + 32) <= "Z" else f"id {i}"


def token_text(ids: Sequence[int] | torch.Tensor) -> str:
    """The labels of a 1-d sequence of ids, joined by spaces.

    >>> token_text(token_ids("AB")[0])
    'A B'
    """
    return " ".join(token_label(i) for i in ids)
