"""Which stored tensors a replaced token changes, on both hybrid decoders: a K/V row at
position i only for tokens 0..i, a recurrent state for every token, a first layer's conv window
only for the last K - 1 tokens."""

from __future__ import annotations

import pytest
import torch

from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder
from kvdoc.core.mamba2 import Mamba2Config, MambaDecoder
from kvdoc.teach.dependency_maps import changed_by_token, stored

IDS = torch.tensor([[5, 9, 2, 7, 11, 3]])
T = IDS.shape[1]


# a recurrent layer (h0), then an attention layer (h1)
DELTA = DeltaNetConfig(layer_types=("linear_attention", "full_attention"))
MAMBA = Mamba2Config(attn_layers=(1,))


@pytest.mark.parametrize("model", [DeltaNetDecoder(DELTA), MambaDecoder(MAMBA)],
                         ids=["deltanet", "mamba2"])
def test_rows_follow_their_prefix_states_the_whole_prompt(model):
    torch.manual_seed(0)
    model = model.double().eval()
    names, changed = changed_by_token(model, IDS)
    assert changed.shape == (len(names), T)
    rows = {n: r for n, r in zip(names, changed, strict=True)}
    for t in range(T):  # layer 1 is attention: row t moves with tokens 0..t, never later ones
        assert rows[f"h1 K/V {t}"].tolist() == [j <= t for j in range(T)]
    assert rows["h0 recurrent"].all()
    taps = (model.config.linear_conv_kernel_dim if isinstance(model, DeltaNetDecoder)
            else model.config.mamba_d_conv)
    assert rows["h0 conv"].tolist() == [j >= T - (taps - 1) for j in range(T)]


def test_stored_names_each_row_and_each_state():
    torch.manual_seed(0)
    model = DeltaNetDecoder(DELTA).eval()
    with torch.no_grad():
        cache = model(IDS, model.new_cache(1))[1]
    tensors = stored(cache)
    assert list(tensors) == ["h0 conv", "h0 recurrent", *(f"h1 K/V {t}" for t in range(T))]
    k, v = cache.layer(1)
    assert torch.equal(tensors["h1 K/V 2"], torch.cat([k[:, :, 2], v[:, :, 2]], dim=-1))
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        changed_by_token(model, IDS.repeat(2, 1))
