"""The offset-mask exercise: which keys each new query reads after ``P`` cached tokens, with the
offset causal mask and with a top-left (``is_causal=True``) one, computed from the masks
themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoc.core.model import offset_causal_mask
from kvdoc.proofs.broken.decoders import top_left_causal_mask


@dataclass(frozen=True)
class MaskExercise:
    """Answers for ``C`` new tokens after ``P`` cached ones.

    Attributes:
        query_positions: absolute positions of the new queries, ``P .. P + C - 1``.
        scores_shape: last two dimensions of the scores, ``(C, P + C)``.
        keys_offset: keys each query may read with the offset mask.
        keys_top_left: keys each query may read with a top-left (``is_causal=True``) mask.
    """

    query_positions: list[int]
    scores_shape: tuple[int, int]
    keys_offset: list[int]
    keys_top_left: list[int]


def mask_exercise(past_len: int, new_len: int) -> MaskExercise:
    """Compute the exercise's answers from :mod:`kvdoc.core.model` (and, for the top-left mask,
    :func:`kvdoc.proofs.broken.decoders.top_left_causal_mask`).

    >>> mask_exercise(10, 3).keys_offset
    [11, 12, 13]
    """
    off = offset_causal_mask(past_len, new_len)
    tl = top_left_causal_mask(past_len, new_len)
    return MaskExercise(
        list(range(past_len, past_len + new_len)),
        (int(off.shape[0]), int(off.shape[1])),
        [int(n) for n in off.sum(dim=1)],
        [int(n) for n in tl.sum(dim=1)],
    )
