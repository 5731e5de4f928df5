"""Deliberately wrong recurrent layers: a Gated DeltaNet layer or a Mamba-2 mixer that keeps the
wrong state between tokens, each a subclass of the real one that adds no parameters, swapped
into a copy of the model by class (:func:`~kvdoc.proofs.broken.decoders.with_mixer`). The
outputs a call computes stay right where only the state it leaves is wrong, so only what comes
after a boundary shows the bug; the undecayed carry is wrong in the chunked form both paths
share, past its first chunk.

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

from kvdoc.core.deltanet import GatedDeltaNet
from kvdoc.core.mamba2 import Mamba2Mixer, ssd_chunked
from kvdoc.core.state import RecurrentMixer

from .decoders import cached_only, with_mixer  # noqa: F401 (cached_only: the doctest)


class UncarriedChunkState(GatedDeltaNet):
    """BROKEN: the chunked delta rule starts every chunk from the state the call began with."""

    def mix(self, x: torch.Tensor, window: torch.Tensor, state: torch.Tensor,
            recurrent: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if recurrent or x.shape[1] <= self.chunk_size:
            return super().mix(x, window, state, recurrent)
        outs, first = [], (window, state)
        for at in range(0, x.shape[1], self.chunk_size):
            piece = x[:, at:at + self.chunk_size]
            # the conv window is carried (the bug is the state's): it is the real one here
            out, window, state = super().mix(piece, window, first[1], recurrent=False)
            outs.append(out)
        return torch.cat(outs, dim=1), window, state


class ShiftedConv(RecurrentMixer):
    """BROKEN: the conv window a call keeps is shifted by one: the ``K - 1`` inputs before the
    newest, which is left out."""

    def conv(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = super().conv(x, window)
        seq = torch.cat((window, x.transpose(1, 2)), dim=2)
        keep = window.shape[2]
        return out, seq[:, :, seq.shape[2] - keep - 1:-1]


class ShiftedConvWindow(ShiftedConv, GatedDeltaNet):
    """:class:`ShiftedConv`'s window in a Gated DeltaNet layer."""


class ShiftedConvStateMixer(ShiftedConv, Mamba2Mixer):
    """:class:`ShiftedConv`'s window in a Mamba-2 mixer (its conv state)."""


def undecayed_carry(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor, state: torch.Tensor,
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BROKEN: :func:`~kvdoc.core.mamba2.ssd_chunked` chunk by chunk, the state carried into
    the next chunk without the decay over this one."""
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


# a DeltaNet block holds its layer as .linear_attn, a Mamba block its mixer as .mamba (the
# attention blocks have neither)
state_not_carried = with_mixer(UncarriedChunkState, "linear_attn")
conv_window_shifted = with_mixer(ShiftedConvWindow, "linear_attn")
conv_state_shifted = with_mixer(ShiftedConvStateMixer, "mamba")
ssd_undecayed_carry = with_mixer(UndecayedCarryMixer, "mamba")
