"""What each query of a sparse layer reads (kvdoc.teach.sparse_reads), the figures of it, and
transformers' DeepSeek-V3.2 paths (kvdoc.teach.crosscheck), as the page on sparse layers uses
them."""

from __future__ import annotations

import dataclasses

import matplotlib
import pytest
import torch

from kvdoc.core.indexed import IndexedDecoder
from kvdoc.core.v4 import CompressedDecoder
from kvdoc.interop.hf_deepseek_v32 import earliest_ties, to_v32
from kvdoc.proofs.broken.decoders import copy_as
from kvdoc.proofs.broken.sparse import NewRowsTopkDecoder, TopkTiesDecoder
from kvdoc.proofs.grid import INDEXED, V4
from kvdoc.teach.crosscheck import path_gaps
from kvdoc.teach.sparse_reads import (
    compressed_reads,
    draw_compressed,
    draw_selection,
    entries_changed,
    indexed_trace,
    ties_at_k,
    unfinished,
)

matplotlib.use("Agg")
TWO = dataclasses.replace(INDEXED, n_layer=2)
T = 24


def stream(vocab: int, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def indexed() -> IndexedDecoder:
    torch.manual_seed(0)
    return IndexedDecoder(TWO).eval()


@pytest.fixture(scope="module")
def v4() -> CompressedDecoder:
    torch.manual_seed(0)
    return CompressedDecoder(V4).eval()


def test_each_query_reads_k_earlier_keys_the_same_on_every_path(indexed):
    ids = stream(TWO.vocab_size)
    full = indexed_trace(indexed, ids)
    assert ties_at_k(full.scores, TWO.index_topk) > 0  # the tie rule is exercised
    counts = full.reads.sum(-1)[0]  # [L, T]
    assert counts.tolist() == [[min(i + 1, TWO.index_topk) for i in range(T)]] * TWO.n_layer
    assert not (full.reads & ~torch.ones(T, T, dtype=torch.bool).tril()).any()
    for chunks in ([1] * T, [9, 1, 1, 5, 1, 7]):
        assert torch.equal(indexed_trace(indexed, ids, chunks).reads, full.reads)


def test_broken_selections_read_other_keys_on_the_cached_path(indexed):
    ids = stream(TWO.vocab_size)
    for cls in (NewRowsTopkDecoder, TopkTiesDecoder):
        broken = copy_as(indexed, cls)
        assert not torch.equal(indexed_trace(broken, ids, [1] * T).reads,
                               indexed_trace(broken, ids).reads), cls.__name__


def test_ties_at_k_counts_equal_finite_scores_at_the_kth_place():
    inf = float("inf")
    scores = torch.tensor([[5.0, 1.0, 1.0, -inf], [5.0, 1.0, -inf, -inf], [2.0, 2.0, 2.0, 0.0]])
    assert ties_at_k(scores, 2) == 2 and ties_at_k(scores, 1) == 1 and ties_at_k(scores, 4) == 0


def test_a_compressed_layer_reads_its_window_and_finished_entries_only(v4):
    reads = compressed_reads(v4, stream(V4.vocab_size))
    W = V4.sliding_window
    for layer, r in enumerate(reads):
        rate = V4.rate(layer)
        assert r.rate == rate
        for t in range(T):
            assert r.window[0, t].nonzero().flatten().tolist() == list(range(max(0, t - W + 1),
                                                                              t + 1))
            finished = (t + 1) // rate
            assert not r.entries[0, t, finished:].any()
            picked = int(r.entries[0, t].sum())
            if V4.layer_types[layer] == "hca":
                assert picked == finished
            else:
                assert picked == min(finished, V4.index_topk)


def test_the_buffer_holds_the_unfinished_block(v4):
    ids = stream(V4.vocab_size)
    for t in (0, 3, 4, 9, 14, 23):
        _, cache = v4(ids[:, :t + 1], v4.new_cache(1))
        for layer, kind_layer in enumerate(cache.layers):
            rate = V4.rate(layer)
            assert kind_layer.buffer.shape[1] == len(unfinished(t, rate))
            assert kind_layer.entries.shape[1] == (t + 1) // rate


def test_an_hca_entry_depends_on_the_positions_of_its_block(v4):
    changed = entries_changed(v4, stream(V4.vocab_size, 17), 0)  # layer 0: HCA, blocks of 5
    rate = V4.rate(0)
    want = torch.zeros_like(changed)
    for p in range(17 // rate * rate):
        want[p, p // rate] = True
    assert torch.equal(changed, want)


def test_transformers_paths_part_on_ties_and_agree_with_the_earlier_winning(indexed):
    hf = to_v32(indexed).to(torch.float64)
    ids = stream(TWO.vocab_size)
    assert max(path_gaps(hf, ids).values()) > 1e-3
    with earliest_ties():
        assert max(path_gaps(hf, ids).values()) < 1e-10


def test_the_figures_draw_what_they_are_given(v4, indexed):
    reads = indexed_trace(indexed, stream(TWO.vocab_size)).reads[0, 0]
    fig = draw_selection(reads, "layer 0")
    assert fig.axes[0].get_title() == "layer 0"
    r = compressed_reads(v4, stream(V4.vocab_size))
    fig = draw_compressed(r[1], [9, 23])
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["entries", "buffer", "window"] * 2
    with pytest.raises(IndexError):
        draw_compressed(r[1], [T])  # no such query
