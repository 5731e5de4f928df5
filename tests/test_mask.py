import re

import pytest
import torch
import torch.nn.functional as F

from kvdoc import offset_causal_mask
from kvdoc.proofs.broken.decoders import top_left_causal_mask


@pytest.mark.parametrize("past, new", [(0, 1), (0, 5), (4, 2), (10, 3), (7, 1)])
def test_offset_mask_rule(past, new):
    mask = offset_causal_mask(past, new)
    assert mask.shape == (new, past + new)
    for i in range(new):
        for j in range(past + new):
            assert bool(mask[i, j]) == (j <= past + i)
    assert mask.sum(dim=1).tolist() == [past + i + 1 for i in range(new)]


def test_masks_agree_only_without_a_cache():
    assert torch.equal(offset_causal_mask(0, 6), top_left_causal_mask(0, 6))
    assert not torch.equal(offset_causal_mask(4, 2), top_left_causal_mask(4, 2))
    # One new token after 9 cached: the offset mask shows all 10 keys, top-left only key 0.
    assert offset_causal_mask(9, 1).sum().item() == 10
    assert top_left_causal_mask(9, 1).tolist() == [[True] + [False] * 9]


@pytest.mark.parametrize("bad, message", [
    ((-1, 2), "past_len must be a non-negative integer, got -1"),
    ((2, 0), "new_len must be a positive integer, got 0"),
    ((1.5, 1), "past_len must be a non-negative integer, got 1.5"),
    ((True, 1), "past_len must be a non-negative integer, got True"),
])
def test_mask_rejects_bad_lengths(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        offset_causal_mask(*bad)


def _explicit_attention(q, k, v, allowed):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("past, new", [(4, 2), (5, 1), (10, 3)])
def test_sdpa_is_causal_is_top_left_and_wrong_with_a_cache(past, new):
    """SDPA's is_causal=True aligns the triangle top-left: right for P = 0, wrong once P > 0."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, new, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, past + new, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, past + new, 8, generator=g, dtype=torch.float64)
    right = _explicit_attention(q, k, v, offset_causal_mask(past, new))
    is_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(is_causal, _explicit_attention(q, k, v, top_left_causal_mask(past, new)))
    assert (is_causal - right).abs().max() > 1e-3
    with_mask = F.scaled_dot_product_attention(q, k, v, attn_mask=offset_causal_mask(past, new))
    assert torch.allclose(with_mask, right, atol=1e-12)


def test_sdpa_is_causal_right_without_cache():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          _explicit_attention(q, k, v, offset_causal_mask(0, 5)), atol=1e-12)


@pytest.mark.parametrize("past, new, window",
                         [(0, 6, 2), (4, 3, 3), (40, 1, 32), (30, 10, 32), (3, 2, 1)])
def test_window_mask_rule(past, new, window):
    """Query P + i reads key j iff P + i - W < j <= P + i (transformers' Mistral convention)."""
    mask = offset_causal_mask(past, new, window=window)
    assert mask.shape == (new, past + new)
    for i in range(new):
        q = past + i
        visible = [j for j in range(past + new) if q - window < j <= q]
        assert mask[i].nonzero().flatten().tolist() == visible
    assert mask.sum(dim=1).tolist() == [min(window, past + i + 1) for i in range(new)]


def test_a_window_longer_than_the_sequence_changes_nothing():
    assert torch.equal(offset_causal_mask(5, 4, window=9), offset_causal_mask(5, 4))
    assert not torch.equal(offset_causal_mask(5, 4, window=8), offset_causal_mask(5, 4))


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        offset_causal_mask(2, 2, window=window)
