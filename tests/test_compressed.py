"""DeepSeek-V4's compressed caches: kvdoc's layer against transformers' ``DeepseekV4Attention``
over its own caches (full and chunked, FP32 and FP64), the decoder's cached path against its
full forward, the cache's invariants, its crops, and the broken variants the grid catches."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from kvdoc.core import v4
from kvdoc.core.cache import KVCache
from kvdoc.core.compressed import CompressedLayer
from kvdoc.core.v4 import CompressedAttention, CompressedConfig, CompressedDecoder
from kvdoc.interop.hf_deepseek_v4 import float64_lifted, run_layer, to_transformers
from kvdoc.proofs import grid
from kvdoc.proofs.suite import run_suite

# every size off CompressedConfig's default; blocks of 3 and 5, a window of 7
CONFIG = dataclasses.replace(grid.V4, layer_types=("csa", "hca", "sliding"))
T = 29  # a multiple of neither rate
CHUNKS = [None, (4, 1, 6, 2, 1, 1, 8, 6), (1,) * T]  # None: no cache; then chunks split blocks
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _layer(kind: str, dtype: torch.dtype, config: CompressedConfig = CONFIG):
    torch.manual_seed(0)
    ours = CompressedAttention(config, kind).to(dtype).eval()
    x = torch.randn(2, T, config.n_embd, dtype=dtype)
    return ours, x


def _ours(attn: CompressedAttention, x: torch.Tensor, chunks) -> torch.Tensor:
    if chunks is None:
        return attn(x, None, 0, 0)
    kind = attn.kind
    index = attn.config.layer_types.index(kind)
    cache, outs, start = KVCache([CompressedLayer(x.shape[0], **attn.config.layer_storage(index),
                                                  dtype=x.dtype)]), [], 0
    for size in chunks:
        work = cache.begin()
        outs.append(attn(x[:, start:start + size], work, 0, start))
        start += size
        work.finish(start)
        cache = work
    return torch.cat(outs, dim=1)


def _scores(monkeypatch) -> list[torch.Tensor]:
    """Every score matrix kvdoc's indexer ranks (``-inf``: not yet finished)."""
    seen = []
    real = v4.select

    def record(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
        seen.append(scores.masked_fill(~allowed, float("-inf")))
        return real(scores, allowed, k)

    monkeypatch.setattr(v4, "select", record)
    return seen


def _boundary_ties(scores: torch.Tensor, k: int) -> tuple[int, int]:
    """(rows whose k-th and (k+1)-th finite scores are equal, rows with more than k finite)."""
    ordered = scores.sort(dim=-1, descending=True).values
    finite = torch.isfinite(ordered).sum(-1)
    choosing = finite > k
    if ordered.shape[-1] <= k:
        return 0, 0
    tied = choosing & (ordered[..., k - 1] == ordered[..., k])
    return int(tied.sum()), int(choosing.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", ["csa", "hca", "sliding"])
def test_layer_matches_transformers(kind, dtype, monkeypatch):
    ours, x = _layer(kind, dtype)
    theirs = to_transformers(ours)
    scores = _scores(monkeypatch)
    lift = float64_lifted if dtype == torch.float64 else contextlib.nullcontext
    with torch.no_grad():
        full = _ours(ours, x, None)
        scale = full.abs().max().item()
        for chunks in CHUNKS:
            with lift():
                want = run_layer(theirs, x, chunks)
            got = _ours(ours, x, chunks)
            assert (got - want).abs().max().item() <= TOL[dtype] * scale, chunks
            assert (got - full).abs().max().item() <= TOL[dtype] * scale, chunks
    if kind == "csa":  # the selection mattered, and no tie decided it
        counts = [_boundary_ties(s, CONFIG.index_topk) for s in scores]
        assert sum(c[0] for c in counts) == 0
        assert sum(c[1] for c in counts) > 0


def test_ties_go_to_the_earlier_entry(monkeypatch):
    # one indexer head: a query whose ReLU zeroes two entries ranks them equal
    config = dataclasses.replace(CONFIG, index_n_heads=1)
    ours, x = _layer("csa", torch.float64, config)
    scores = _scores(monkeypatch)
    with torch.no_grad():
        full = _ours(ours, x, None)
        assert sum(_boundary_ties(s, config.index_topk)[0] for s in scores) > 0
        for chunks in CHUNKS[1:]:
            assert (_ours(ours, x, chunks) - full).abs().max().item() < 1e-12
        theirs = to_transformers(ours)  # transformers' top-k breaks the same ties its own way
        with float64_lifted():
            split = (run_layer(theirs, x, CHUNKS[1]) - run_layer(theirs, x)).abs().max().item()
        print(f"transformers on ties: chunked vs its full forward {split:.3g}")
        for i in (3, 11, 20):  # row i needs nothing after i
            assert (_ours(ours, x[:, :i + 1], None)[:, i] - full[:, i]).abs().max() < 1e-12


def _decoder(dtype: torch.dtype) -> CompressedDecoder:
    torch.manual_seed(0)
    return CompressedDecoder(CONFIG).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_decoder_cached_equals_full(dtype):
    model = _decoder(dtype)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 31), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cache, got, start = model.new_cache(2), [], 0
        for size in (8, 4, 2, 5, 1, 1, 1, 1, 1, 7):  # prefill, chunks, one-token steps, a chunk
            logits, cache = model(ids[:, start:start + size], cache)
            got.append(logits)
            start += size
            for i, layer in enumerate(cache.layers):
                rate = CONFIG.rate(i)
                assert layer.nbytes() == layer.expected_nbytes(start)
                assert layer.k.shape[2] == min(start, CONFIG.sliding_window)
                if rate is not None:  # one entry a finished block; the buffer the rest
                    assert layer.entries.shape[1] == start // rate
                    assert layer.buffer.shape[1] == start % rate
    scale = full.abs().max().item()
    assert (torch.cat(got, dim=1) - full).abs().max().item() <= TOL[dtype] * scale


def test_crop_within_the_unfinished_block_restores_the_buffer():
    config = CompressedConfig()  # window 16, blocks of 4 and 8
    torch.manual_seed(0)
    model = CompressedDecoder(config).eval()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    alt = (ids + 1) % 97
    with torch.no_grad():
        _, cache = model(ids[:, :14], model.new_cache(1))
        kept = [t.clone() for t in cache.tensors()]
        with pytest.raises(ValueError, match="pooled into an entry"):
            cache.crop(11)  # the CSA block 8 .. 11 has its entry
        assert cache.seq_len == 14 and all(
            torch.equal(a, b) for a, b in zip(kept, cache.tensors(), strict=True))
        cache.crop(12)
        assert [la.buffer.shape[1] for la in cache.layers[:2]] == [0, 4]
        target = torch.cat((ids[:, :12], alt[:, 12:]), dim=1)
        logits, cache = model(target[:, 12:], cache)
        assert (logits - model(target).logits[:, 12:]).abs().max() < 1e-5
        with pytest.raises(ValueError, match="dropped the ones before"):
            cache.crop(19)  # past the window


def test_refusals():
    model = CompressedDecoder(CompressedConfig()).eval()
    ids = torch.tensor([[1, 2, 3]])
    cache = model.new_cache(1)
    with pytest.raises(ValueError, match="no attn_mask or positions"):
        model(ids, cache, positions=torch.tensor([4, 5, 6]))
    assert cache.seq_len == 0 and cache.nbytes() == 0
    with pytest.raises(ValueError, match="not 'static'"):
        model.new_cache(1, "static")
    with pytest.raises(ValueError, match="layer_types"):
        CompressedConfig(layer_types=("csa", "mla"))


def test_grid_catches_the_broken_variants():
    run = dict(models=("v4-compressed",), dtypes=(torch.float32,), length=31)
    assert run_suite(scenarios=("stream", "reference"), **run).passed
    for variant in ("v4-entry-before-block-full", "v4-buffer-dropped"):
        assert "logits" in run_suite(variant, scenarios=("stream",), **run).failed_checks()
    assert run_suite("v4-sink-twice", scenarios=("reference",), **run).failed_checks() == [
        "reference"]
