"""What a hybrid decoder's cache stores, tensor by tensor, and which of those tensors change when
one token of the prompt changes: Part VI's check that a K/V row is a function of its own
position's prefix and a recurrent state of the whole prefix.

:func:`stored` names every tensor a cache holds after a prefill: one per row of a K/V layer
(``"h1 K/V 3"``: layer 1's keys and values at position 3) and one per named tensor of a state
layer (``"h0 recurrent"``). :func:`changed_by_token` prefills the prompt, then the prompt with
token ``j`` replaced, for every ``j``, and marks the stored tensors that moved at all (not
bit for bit equal): what a token cannot reach is computed from the same inputs by the same
operations, so it comes out identical, while what it reaches moves, if only a little (a gated
state forgets old tokens gradually, never entirely).

>>> import torch
>>> from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder
>>> _ = torch.manual_seed(0)
>>> config = DeltaNetConfig(layer_types=("linear_attention", "full_attention"))
>>> model = DeltaNetDecoder(config).double().eval()
>>> names, changed = changed_by_token(model, torch.tensor([[5, 9, 2, 7]]))
>>> names
['h0 conv', 'h0 recurrent', 'h1 K/V 0', 'h1 K/V 1', 'h1 K/V 2', 'h1 K/V 3']
>>> changed.int()          # a row per stored tensor, a column per replaced token
tensor([[0, 1, 1, 1],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1]], dtype=torch.int32)
"""

from __future__ import annotations

import torch

from kvdoc.core.cache import KVCache
from kvdoc.core.state import StateLayer, read_state


def stored(cache: KVCache) -> dict[str, torch.Tensor]:
    """Every tensor ``cache`` holds, by name: a K/V layer's rows one by one (``[B, H, w_K + w_V]``
    each), a state layer's named tensors whole."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, StateLayer):
            out.update({f"h{i} {name}": t for name, t in read_state(cache, i).items()})
            continue
        k, v = cache.layer(i)  # [B, H, T, D]
        for t in cache.held(i):
            out[f"h{i} K/V {t}"] = torch.cat([k[:, :, t], v[:, :, t]], dim=-1)
    return out


def changed_by_token(model: torch.nn.Module, ids: torch.Tensor
                     ) -> tuple[list[str], torch.Tensor]:
    """The names of the stored tensors after a prefill of ``ids`` (``[1, T]``), and a bool
    ``[tensors, T]``: True where replacing token ``j`` (by the next id) changes that tensor."""
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"need one prompt of at least one token, [1, T]; got {tuple(ids.shape)}")
    with torch.no_grad():
        base = stored(model(ids, model.new_cache(1))[1])
        columns = []
        for j in range(ids.shape[1]):
            other = ids.clone()
            other[0, j] = (other[0, j] + 1) % model.config.vocab_size
            moved = stored(model(other, model.new_cache(1))[1])
            columns.append([not torch.equal(moved[n], t) for n, t in base.items()])
    return list(base), torch.tensor(columns).T
