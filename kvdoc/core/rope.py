"""Rotary position embedding (RoPE): Q and K rotated by their absolute positions.

RoPE has no position table added to the input. Instead each head's features are taken in
pairs ``(x[i], x[i + D_h/2])`` (the "rotate half" layout of Llama and transformers), and the
pair is turned by the angle ``pos * theta**(-2i / D_h)``. A score ``q_m . k_n`` then depends
on the positions only through ``m - n``.

For the cache this means: K is rotated *before* it is stored, at its own absolute position,
so a cached key never needs touching again; a chunk of ``C`` new tokens after ``P`` cached
ones rotates its Q and K at positions ``P .. P + C - 1``. The angles are computed in float64
from integer positions and only then rounded to the model's dtype, so a position's rotation
does not depend on which call computes it beyond float64 rounding.

A batch whose rows sit at different positions (a left-padded batch, a scheduler's ragged step)
passes the positions themselves, ``[B, C]`` (or ``[C]`` for every row alike), instead of one
start: each row is turned at its own positions by the same arithmetic.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension.

    >>> rotate_half(torch.tensor([1., 2., 3., 4.]))
    tensor([-3., -4.,  1.,  2.])
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_angles(positions: torch.Tensor, head_dim: int,
                theta: float = 10000.0) -> torch.Tensor:
    """Rotation angles ``[..., D_h]`` in float64 for integer ``positions`` of any shape
    ``[...]`` (each pair's angle appears twice).

    >>> rope_angles(torch.tensor([0, 1]), head_dim=4, theta=100.0)
    tensor([[0.0000, 0.0000, 0.0000, 0.0000],
            [1.0000, 0.1000, 1.0000, 0.1000]], dtype=torch.float64)
    """
    pairs = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = theta ** -(pairs / head_dim)  # [D_h / 2]
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [..., D_h / 2]
    return torch.cat((angles, angles), dim=-1)  # [..., D_h]


def apply_rope(x: torch.Tensor, start: int | torch.Tensor,
               theta: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` (``[B, H, C, D_h]``) as the rows at positions ``start .. start + C - 1``, or,
    with a tensor ``start``, at the positions it holds: ``[C]`` for every row of the batch, or
    ``[B, C]`` per row.

    The attention calls it on the new Q and on the new K (before K is cached), with the same
    ``start`` for both.

    >>> x = torch.randn(2, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    >>> torch.equal(apply_rope(x, 0)[:, :, 0], x[:, :, 0])  # position 0 is not turned
    True
    >>> torch.allclose(apply_rope(x, 5).norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
    True
    >>> rows = apply_rope(x, torch.tensor([[5, 6, 7], [0, 1, 2]]))  # row 0 from 5, row 1 from 0
    >>> torch.equal(rows[0], apply_rope(x, 5)[0]), torch.equal(rows[1], apply_rope(x, 0)[1])
    (True, True)
    """
    C, D = x.shape[2], x.shape[3]
    if isinstance(start, int):  # one start for the batch: the decode step's path, kept lean
        angles = rope_angles(torch.arange(start, start + C, device=x.device), D, theta)
    else:
        if start.shape[-1:] != (C,) or start.dim() > 2 or (
                start.dim() == 2 and start.shape[0] not in (1, x.shape[0])):
            raise ValueError(f"positions must be [C] or [B, C] with (B, C) = "
                             f"{(x.shape[0], C)}, got {tuple(start.shape)}")
        angles = rope_angles(start, D, theta)  # [C, D_h] or [B, C, D_h]
        if angles.dim() == 3:
            angles = angles[:, None]  # [B, 1, C, D_h]: the same for every head of a row
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # broadcast over B, H
    return x * cos + rotate_half(x) * sin
