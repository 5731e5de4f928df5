"""Deliberately wrong Mamba-2 mixers: a correct :class:`~kvdoc.core.mamba2.MambaDecoder` (same
weights) whose mixers are a subclass with one mistake, made through the mixer's ``conv`` and
``scan``. The conv state shifted by one leaves the full forward right and only a call after a
cached one wrong; the undecayed carry is wrong in the chunked form both paths share, past its
first chunk.

>>> import torch
>>> from kvdoc.core.mamba2 import Mamba2Config, MambaDecoder
>>> _ = torch.manual_seed(0)
>>> model = MambaDecoder(Mamba2Config()).eval()
>>> full, split = cached_only(conv_state_shifted(model), model)
>>> full, split > 1e-3
(0.0, True)
"""

from __future__ import annotations

import torch

from kvdoc.core.mamba2 import Mamba2Mixer, ssd_chunked

from .decoders import cached_only, with_mixer  # noqa: F401 (cached_only: the doctest)


class ShiftedConvStateMixer(Mamba2Mixer):
    """Keeps as its conv state the ``d_conv - 1`` inputs before the last one: the newest input
    is dropped, one too old kept."""

    def conv(self, xBC: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, _ = super().conv(xBC, conv_state)
        seq = torch.cat((conv_state, xBC.transpose(1, 2)), dim=2)
        keep = conv_state.shape[2]
        return out, seq[:, :, seq.shape[2] - keep - 1:-1]


def undecayed_carry(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~kvdoc.core.mamba2.ssd_chunked` chunk by chunk, the state carried into the next
    chunk without the decay over this one (``exp(dt A)`` summed over its positions)."""
    ys = []
    for lo in range(0, x.shape[1], chunk):
        part = [t[:, lo:lo + chunk] for t in (x, dt)] + [A] + [t[:, lo:lo + chunk] for t in (B, C)]
        y, _ = ssd_chunked(*part, D, state, chunk)
        _, own = ssd_chunked(*part, D, torch.zeros_like(state), chunk)
        ys.append(y)
        state = state + own  # should be exp(sum of dt A over the chunk) * state + own
    return torch.cat(ys, dim=1), state


class UndecayedCarryMixer(Mamba2Mixer):
    scan = staticmethod(undecayed_carry)


# the mixers add no parameters: swapped in by class (a Mamba block holds its mixer as .mamba)
conv_state_shifted = with_mixer(ShiftedConvStateMixer, "mamba")
ssd_undecayed_carry = with_mixer(UndecayedCarryMixer, "mamba")
