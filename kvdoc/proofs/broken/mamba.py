"""Deliberately wrong Mamba-2 mixers: a correct :class:`~kvdoc.core.mamba2.MambaDecoder` (same
weights) whose mixers are a subclass with one mistake, made through the mixer's ``conv`` and
``scan``. The conv state shifted by one leaves the full forward right and only a call after a
cached one wrong; the undecayed carry is wrong in the chunked form both paths share, past its
first chunk.

>>> import torch
>>> from kvdoc.core.mamba2 import Mamba2Config, MambaDecoder
>>> _ = torch.manual_seed(0)
>>> model = MambaDecoder(Mamba2Config()).eval()
>>> broken = conv_state_shifted(model)
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
>>> with torch.no_grad():
...     same = (broken(ids).logits - model(ids).logits).abs().max().item()
...     _, cache = broken(ids[:, :4], broken.new_cache(1))
...     wrong = broken(ids[:, 4:], cache).logits
...     right = model(ids).logits[:, 4:]
>>> same, bool((wrong - right).abs().max() > 1e-3)
(0.0, True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvdoc.core.mamba2 import Mamba2Mixer, MambaDecoder, ssd_chunked

from .decoders import copy_as


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


def _with_mixer(cls: type[Mamba2Mixer]) -> Callable[[MambaDecoder], MambaDecoder]:
    def build(model: MambaDecoder) -> MambaDecoder:
        clone, weight = copy_as(model, MambaDecoder), model.wte.weight
        for block in clone.h:
            if hasattr(block, "mamba"):
                with torch.random.fork_rng():
                    mixer = cls(model.config).to(weight.dtype).to(weight.device)
                mixer.load_state_dict(block.mamba.state_dict())
                block.mamba = mixer
        return clone
    return build


conv_state_shifted = _with_mixer(ShiftedConvStateMixer)
ssd_undecayed_carry = _with_mixer(UndecayedCarryMixer)
