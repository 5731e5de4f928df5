"""Broken recurrent states: a Gated DeltaNet layer that keeps the wrong state between tokens.

Wrong on purpose (:mod:`kvdoc.proofs.broken`). Each is a
:class:`~kvdoc.core.deltanet.GatedDeltaNet` whose :meth:`mix` returns a wrong state, put into a
copy of the model in place of every DeltaNet layer; the outputs of the tokens a call computes
stay right, so only what comes after a boundary shows the bug.
"""

from __future__ import annotations

import torch

from kvdoc.core.deltanet import GatedDeltaNet

from .decoders import with_mixer


class UncarriedChunkState(GatedDeltaNet):
    """The chunked delta rule starts every chunk of ``chunk_size`` tokens from the state the
    call began with: the state is not advanced on a chunk boundary (a call of one chunk, and
    every decode step, is right)."""

    def mix(self, x: torch.Tensor, window: torch.Tensor, state: torch.Tensor, recurrent: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if recurrent or x.shape[1] <= self.chunk_size:
            return super().mix(x, window, state, recurrent)
        outs, first = [], (window, state)
        for at in range(0, x.shape[1], self.chunk_size):
            piece = x[:, at:at + self.chunk_size]
            # the conv window is carried (the bug is the state's): it is the real one here
            out, window, state = super().mix(piece, window, first[1], recurrent=False)
            outs.append(out)
        return torch.cat(outs, dim=2), window, state


class ShiftedConvWindow(GatedDeltaNet):
    """The conv window a call keeps is shifted by one: its last ``K - 1`` inputs but the
    newest, and one older (the next call convolves a stale channel history)."""

    def mix(self, x: torch.Tensor, window: torch.Tensor, state: torch.Tensor, recurrent: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, _, state = super().mix(x, window, state, recurrent)
        inputs = torch.cat((window, self.in_proj_qkv(x).transpose(1, 2)), dim=2)
        keep = self.taps - 1
        return out, inputs[:, :, inputs.shape[2] - keep - 1:inputs.shape[2] - 1], state


# the mixers add no parameters: swapped in by class (a DeltaNet block holds its own as
# .linear_attn; the attention blocks have none)
state_not_carried = with_mixer(UncarriedChunkState, "linear_attn")
conv_window_shifted = with_mixer(ShiftedConvWindow, "linear_attn")
