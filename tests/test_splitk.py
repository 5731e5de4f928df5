"""Split-K attention equals one softmax over every key: a grid of splits, heads, masks, dtypes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvdoc import Decoder, GPTConfig, mistral_config
from kvdoc.core.cache import offset_causal_mask
from kvdoc.proofs.compare import TOLERANCE
from kvdoc.serving.splitk import (
    all_partials,
    merge,
    partial_attention,
    split_k_attention,
    split_k_decoder,
)


def qkv(B: int, H: int, H_kv: int, C: int, T: int, D: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, C, D, generator=g, dtype=torch.float64).to(dtype)
    k, v = torch.randn(2, B, H_kv, T, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def reference(q, k, v, mask):
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
# with 12 keys: splits that divide, that do not, one chunk exactly, one chunk with room
@pytest.mark.parametrize("split", [1, 3, 4, 5, 12, 40])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("past, new", [(11, 1), (7, 5)], ids=["decode", "chunk"])
def test_split_k_equals_one_softmax(dtype, heads, split, window, past, new):
    H, H_kv = heads
    q, k, v = qkv(2, H, H_kv, new, past + new, 8, dtype)
    mask = offset_causal_mask(past, new, window=window)
    tol = TOLERANCE[dtype]
    got = split_k_attention(q, k, v, split, mask)
    torch.testing.assert_close(got, reference(q, k, v, mask), atol=tol, rtol=tol)


def test_log_sum_exp_is_that_of_the_scores():
    q, k, v = qkv(1, 2, 2, 1, 9, 4, torch.float64)
    _, lse = merge([partial_attention(q, k[:, :, s:s + 4], v[:, :, s:s + 4]) for s in (0, 4, 8)])
    scores = q @ k.transpose(-1, -2) / math.sqrt(4)
    torch.testing.assert_close(lse, scores.logsumexp(dim=-1), atol=1e-12, rtol=1e-12)


def test_a_chunk_that_hides_every_key_adds_nothing():
    q, k, v = qkv(1, 2, 2, 1, 8, 4, torch.float64)
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[:, 4:] = True  # the first chunk of 4 is wholly hidden
    got = split_k_attention(q, k, v, 4, mask)
    torch.testing.assert_close(got, reference(q, k, v, mask), atol=1e-12, rtol=1e-12)
    assert not got.isnan().any()


def test_merging_in_another_order_gives_the_same_output():
    q, k, v = qkv(1, 4, 2, 1, 10, 8, torch.float64)
    parts = [partial_attention(q, k[:, :, s:s + 3], v[:, :, s:s + 3]) for s in range(0, 10, 3)]
    forward, _ = merge(parts)
    backward, _ = merge(parts[::-1])
    torch.testing.assert_close(forward, backward, atol=1e-12, rtol=1e-12)


def test_a_wrong_merge_is_caught():
    # dropping the rescaling by exp(m_c - m) is the classic split-K bug: the check must see it
    q, k, v = qkv(1, 2, 2, 1, 10, 4, torch.float64)
    q = q * 4  # spread the scores so that chunks' maxima differ
    parts = [partial_attention(q, k[:, :, s:s + 5], v[:, :, s:s + 5]) for s in (0, 5)]
    wrong = sum(p.out for p in parts) / sum(p.l for p in parts)[..., None]
    assert not torch.allclose(wrong, reference(q, k, v, None), atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda q, k, v: split_k_attention(q, k, v, 0), "split must be a positive integer"),
    (lambda q, k, v: split_k_attention(q, k, v, 2.0), "split must be a positive integer"),
    (lambda q, k, v: split_k_attention(q, k[:, :1, :3], v, 2), "k, v both"),
    (lambda q, k, v: split_k_attention(q[:, :3], k, v, 2), "H must be a multiple of H_kv"),
    (lambda q, k, v: split_k_attention(q, k, v, 2, torch.ones(1, 5, dtype=torch.bool)),
     r"mask must be \[C, T\] = \[1, 6\]"),
    (lambda q, k, v: split_k_attention(q, k, v, 2, torch.zeros(1, 6, dtype=torch.bool)),
     "reads no key"),
])
def test_bad_input_is_refused(call, message):
    q, k, v = qkv(1, 4, 2, 1, 6, 4, torch.float32)
    with pytest.raises(ValueError, match=message):
        call(q, k, v)


@pytest.mark.parametrize("config", [GPTConfig(n_kv_head=2), mistral_config(sliding_window=6)],
                         ids=["gqa", "window"])
@pytest.mark.parametrize("split", [1, 4, 7])
def test_split_k_decoder_continues_every_cache_kind_like_the_model(config, split):
    torch.manual_seed(0)
    model = Decoder(config).double().eval()
    fast = split_k_decoder(model, split)
    ids = torch.randint(0, config.vocab_size, (2, 15))
    full = model(ids).logits
    for kind in ("dynamic", "static", *(("window",) if config.sliding_window else ())):
        cache, out = fast.new_cache(2, kind, capacity=15), []
        for s in (0, 5, 6, 11):  # a prompt of 5, one decode step, chunks of 5 and 4
            e = {0: 5, 5: 6, 6: 11, 11: 15}[s]
            logits, cache = fast(ids[:, s:e], cache)
            out.append(logits)
        torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-10, rtol=1e-10)


def test_split_k_decoder_takes_padded_batches():
    from kvdoc.serving.batching import left_pad, padded_mask, padded_positions

    torch.manual_seed(0)
    model = Decoder(GPTConfig()).double().eval()
    batch = left_pad([[5, 6, 7, 8, 9], [1, 2]])
    C = batch.ids.shape[1]
    kwargs = dict(positions=padded_positions(batch.pad, 0, C),
                  attn_mask=padded_mask(batch.pad, 0, C))
    got = split_k_decoder(model, 2)(batch.ids, **kwargs).logits
    torch.testing.assert_close(got, model(batch.ids, **kwargs).logits, atol=1e-10, rtol=1e-10)


def test_a_split_below_one_is_refused():
    with pytest.raises(ValueError, match="split"):
        split_k_decoder(Decoder(GPTConfig()), 0)


@pytest.mark.parametrize("split", [3, 4])
def test_all_partials_are_the_chunks_partials(split):
    q, k, v = qkv(2, 4, 2, 3, 10, 4, torch.float64)
    mask = offset_causal_mask(7, 3, window=6)
    stacked = all_partials(q, k, v, split, mask)
    for i, s in enumerate(range(0, 10, split)):
        one = partial_attention(q, k[:, :, s:s + split], v[:, :, s:s + split], mask[:, s:s + split])
        for got, want in zip(stacked, one, strict=True):
            torch.testing.assert_close(got[i], want, atol=1e-12, rtol=1e-12)
