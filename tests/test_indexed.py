"""Indexed sparse attention (DeepSeek-V3.2): the tie rule, the composed cache, and transformers.

The models here have every size off :class:`IndexedConfig`'s default, three layers (so a layer
selects from rows another layer's selection made) and ``index_topk=7`` on streams of 30 tokens,
so the selection matters. With one indexer head, half the keys of a row score an exact 0 (the
ReLU), so ties at the 7th place are common: the tests count them before relying on them.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch

from kvdoc.core.indexed import (
    IndexedAttention,
    IndexedConfig,
    IndexedDecoder,
    IndexedLayer,
    select,
)
from kvdoc.core.mla import MLADecoder
from kvdoc.interop.hf_config import random_model
from kvdoc.interop.hf_deepseek_v32 import (
    config_from_v32,
    earliest_ties,
    from_v32,
    to_v32,
    v32_config,
)
from kvdoc.proofs.broken.decoders import copy_as
from kvdoc.proofs.broken.sparse import NewRowsTopkDecoder, TopkTiesDecoder
from kvdoc.proofs.compare import TOLERANCE, Snapshot, close, max_abs, run_cached
from kvdoc.proofs.grid import MLA
from kvdoc.teach.crosscheck import lifted_logits

TIES = IndexedConfig(**{**dataclasses.asdict(MLA), "n_layer": 3}, index_n_heads=1,
                     index_head_dim=10, index_topk=7)
"""One indexer head: ties at the k-th place in many rows."""
NO_TIES = dataclasses.replace(TIES, index_n_heads=8)
"""Eight heads: a key scores 0 only if all eight reject it, so no ties on these streams."""
DTYPES = list(TOLERANCE)
LENGTH = 30
CHUNKS = [9, 1, 1, 5, 1, 13]  # a prefill, one-token steps and chunks: 30 positions


def stream(length: int = LENGTH, batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, MLA.vocab_size, (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def model(config: IndexedConfig, dtype: torch.dtype, seed: int = 0) -> IndexedDecoder:
    torch.manual_seed(seed)
    return IndexedDecoder(config).to(dtype).eval()


@contextmanager
def recorded_scores(m: IndexedDecoder):
    """Every layer's indexer scores ``[B, C, T]`` of the calls inside, in call order."""
    seen: list[torch.Tensor] = []
    for block in m.h:
        original = block.attn.indexer.scores

        def spy(*args, original=original, **kwargs):
            seen.append(original(*args, **kwargs))
            return seen[-1]
        block.attn.indexer.scores = spy
    try:
        yield seen
    finally:
        for block in m.h:
            del block.attn.indexer.scores


def tied_rows(scores: torch.Tensor, k: int) -> int:
    """Rows of a full forward's ``[B, T, T]`` scores whose k-th and (k+1)-th best keys at or
    before the query tie."""
    T = scores.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ranked = scores.masked_fill(~causal, float("-inf")).sort(dim=-1, descending=True).values
    return int(((ranked[..., k - 1] == ranked[..., k]) & ranked[..., k].isfinite()).sum())


def ties_in_full_forward(m: IndexedDecoder, ids: torch.Tensor) -> int:
    with torch.no_grad(), recorded_scores(m) as seen:
        m(ids)
    return sum(tied_rows(s, m.config.index_topk) for s in seen)


# --- the rule ------------------------------------------------------------------------------

def test_select_is_the_earlier_wins_top_k_whatever_the_row_length():
    """Against the rule written out (sort by score, then by position), on scores of three values
    (ties everywhere), for the full row and every shorter one."""
    g = torch.Generator().manual_seed(0)
    T, k = 23, 5
    scores = torch.randint(0, 3, (2, T, T), generator=g).double()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    chosen = select(scores, causal, k)
    for b in range(2):
        for i in range(T):
            by_rule = sorted(range(i + 1), key=lambda j: (-scores[b, i, j].item(), j))[:k]
            assert chosen[b, i].nonzero().flatten().tolist() == sorted(by_rule), (b, i)
            alone = select(scores[b:b + 1, i:i + 1, :i + 1], causal[i:i + 1, :i + 1], k)
            assert torch.equal(alone[0, 0], chosen[b, i, :i + 1])


def test_negative_zero_ties_with_zero():
    scores = torch.tensor([[[-0.0, 0.0, -0.0, 1.0]]])
    assert select(scores, torch.ones(1, 4, dtype=torch.bool), 2).int().tolist() == [[[1, 0, 0, 1]]]


def test_when_every_score_ties_each_query_reads_the_first_k_keys():
    m = model(TIES, torch.float64)
    with torch.no_grad():
        for block in m.h:
            block.attn.indexer.wq_b.weight.zero_()  # every score is relu(0) = 0
    masks = []
    for block in m.h:
        original = block.attn.choose
        block.attn.choose = lambda s, a, original=original: masks.append(original(s, a)) or \
            masks[-1]
    with torch.no_grad():
        m(stream())
    k, T = TIES.index_topk, LENGTH
    want = torch.ones(T, T, dtype=torch.bool).tril() & (torch.arange(T) < k)
    assert len(masks) == TIES.n_layer and all(torch.equal(mask[0], want) for mask in masks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_on_ties_the_cached_path_is_the_full_forward(dtype, kind):
    m, ids = model(TIES, dtype), stream()
    assert ties_in_full_forward(m, ids) >= 10  # the inputs do tie at the k-th place
    with torch.no_grad():
        full = m(ids).logits
    for chunks in (1, 4, CHUNKS):
        run = run_cached(m, ids, chunks, kind)
        assert close(run.logits, full, TOLERANCE[dtype]), (chunks, max_abs(run.logits, full))
        assert run.lifecycle_error == 0.0


def test_the_absorbed_path_selects_the_same_keys():
    """Cached calls attend over the latent itself (``absorb``), the full forward up-projects."""
    m, ids = model(dataclasses.replace(TIES, absorb=True), torch.float64), stream()
    with torch.no_grad():
        full = m(ids).logits
    assert close(run_cached(m, ids, CHUNKS).logits, full, TOLERANCE[torch.float64])


@pytest.mark.parametrize("dtype", DTYPES)
def test_on_ties_row_i_never_depends_on_later_tokens(dtype):
    m, ids = model(TIES, dtype), stream(batch=1)
    with torch.no_grad():
        full = m(ids).logits
        alone = torch.stack([m(ids[:, :i + 1]).logits[0, -1] for i in range(LENGTH)])
    assert close(alone, full[0], TOLERANCE[dtype]), max_abs(alone, full[0])


def test_the_same_checks_catch_ties_broken_by_topk_and_top_k_over_new_rows():
    m, ids = model(TIES, torch.float64), stream()
    with torch.no_grad():
        full = m(ids).logits
    for cls in (TopkTiesDecoder, NewRowsTopkDecoder):
        broken = copy_as(m, cls)
        with torch.no_grad():
            own_full = broken(ids).logits
        cached = run_cached(broken, ids, CHUNKS).logits
        # the cached path departs from its own full forward, and from the right model's
        assert max_abs(cached, own_full) > 1e-3 and max_abs(cached, full) > 1e-3, cls.__name__
    with torch.no_grad():  # ties by topk: a row's keys depend on how many tokens follow it
        broken = copy_as(m, TopkTiesDecoder)
        own_full = broken(ids[:1]).logits[0]
        alone = torch.stack([broken(ids[:1, :i + 1]).logits[0, -1] for i in range(LENGTH)])
    assert max_abs(alone, own_full) > 1e-3


# --- the cache -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_the_indexer_keys_grow_with_the_latent_and_the_bytes_follow_the_formula(kind):
    m, ids, B = model(TIES, torch.float32), stream(), 2
    cache = m.new_cache(B, kind, capacity=40)
    for start, n in ((0, 9), (9, 1), (10, 5)):
        with torch.no_grad():
            _, cache = m(ids[:, start:start + n], cache)
        T = cache.seq_len
        for i, layer in enumerate(cache.layers):
            assert isinstance(layer, IndexedLayer)
            c_kv, k_rope = cache.layer(i)
            assert tuple(layer.read_keys(T).shape) == (B, 1, T, TIES.index_head_dim)
            assert c_kv.shape[2] == k_rope.shape[2] == T and layer.shape_problems(T) == []
        rows = T if kind == "dynamic" else 40
        assert cache.nbytes() == cache.expected_nbytes() == (
            B * rows * TIES.bytes_per_position(torch.float32))


def test_bad_calls_are_refused_and_leave_the_cache_as_it_was():
    m, ids = model(TIES, torch.float32), stream()
    latent_only = MLADecoder(dataclasses.replace(MLA, n_layer=3)).new_cache(2)  # no indexer keys
    with pytest.raises(ValueError, match="holds no indexer keys"):
        m(ids[:, :3], latent_only)
    for kind in ("dynamic", "static"):
        cache = m.new_cache(2, kind)
        with torch.no_grad():
            _, cache = m(ids[:, :5], cache)
        before = Snapshot.of(cache)
        bad = ids[:, 5:8].clone()
        bad[1, 2] = TIES.vocab_size  # outside the vocabulary
        with pytest.raises(ValueError, match="outside the vocabulary"):
            m(bad, cache)
        assert cache.seq_len == 5 and before.changed(cache) == 0.0
    with pytest.raises(ValueError, match="'dynamic' or 'static'"):
        m.new_cache(1, "paged")


def test_configs_are_checked_by_name():
    with pytest.raises(ValueError, match="q_lora_rank must be set"):
        IndexedConfig(q_lora_rank=None)
    with pytest.raises(ValueError, match="index_head_dim=8 must exceed"):
        IndexedConfig(index_head_dim=8)
    with pytest.raises(ValueError, match="index_topk"):
        IndexedConfig(index_topk=0)


# --- transformers ----------------------------------------------------------------------------

def test_configs_round_trip_and_the_moe_is_refused_by_name():
    from transformers import DeepseekV32Config

    assert config_from_v32(v32_config(TIES)) == TIES
    with pytest.raises(ValueError, match=r"layers \[1, 2\] are mixture-of-experts"):
        config_from_v32(DeepseekV32Config(num_hidden_layers=3, first_k_dense_replace=1))
    with pytest.raises(ValueError, match="rope_type"):
        config_from_v32(dataclasses.replace(v32_config(TIES), rope_parameters={
            "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_transformers_as_it_is_where_no_scores_tie(dtype):
    m, ids = model(NO_TIES, dtype), stream()
    assert ties_in_full_forward(m, ids) == 0
    hf = to_v32(m)
    with torch.no_grad():
        full = m(ids).logits
    tol = TOLERANCE[dtype]
    assert close(lifted_logits(hf, ids), full, tol), max_abs(lifted_logits(hf, ids), full)
    assert close(lifted_logits(hf, ids, CHUNKS), full, tol)
    assert close(run_cached(m, ids, CHUNKS).logits, full, tol)
    back = from_v32(hf)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                 m.state_dict().values(), strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_on_ties_matches_transformers_with_the_earlier_position_winning(dtype):
    """transformers loaded into kvdoc (``from_v32``): its full and cached forwards, ties broken
    earlier-first, against kvdoc's full and cached ones."""
    hf = random_model(v32_config(TIES), seed=1, dtype=dtype)
    m, ids, tol = from_v32(hf), stream(), TOLERANCE[dtype]
    assert ties_in_full_forward(m, ids) >= 10
    with torch.no_grad():
        full = m(ids).logits
    with earliest_ties():
        assert close(lifted_logits(hf, ids), full, tol), max_abs(lifted_logits(hf, ids), full)
        assert close(lifted_logits(hf, ids, CHUNKS), full, tol)
        assert close(lifted_logits(hf, ids, [1] * LENGTH), full, tol)
    assert close(run_cached(m, ids, CHUNKS).logits, full, tol)


def test_why_transformers_cached_and_full_paths_differ():
    """transformers 5.24.0, FP64, ties present: its one-token decode and its forwards of each
    prefix depart from its full forward by far more than rounding. The indexer's ranked row is
    masked causally (every key after the query is -inf before topk), the tied scores are bitwise
    equal zeros, and breaking ties earlier-first (nothing else changed) brings all three paths
    together to rounding: the departure is topk's order among ties, which follows the row's
    length (the full forward ranks row i among T keys, the others among i + 1)."""
    row = torch.zeros(41)
    row[0], row[5] = 1.0, 0.5
    assert row[:9].topk(4).indices.tolist() != row.topk(4).indices.tolist()  # ties by length

    hf, ids = random_model(v32_config(TIES), seed=1, dtype=torch.float64), stream(batch=1)
    ranked: list[torch.Tensor] = []
    original = torch.Tensor.topk

    def spy(self, *args, **kwargs):
        ranked.append(self.detach().clone())
        return original(self, *args, **kwargs)

    torch.Tensor.topk = spy
    try:
        full = lifted_logits(hf, ids)
    finally:
        torch.Tensor.topk = original
    decoded = lifted_logits(hf, ids, [1] * LENGTH)
    alone = torch.cat([lifted_logits(hf, ids[:, :i + 1])[:, -1:] for i in range(LENGTH)], dim=1)
    assert max_abs(decoded, full) > 1e-2 and max_abs(alone, full) > 1e-2

    future = ~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    assert len(ranked) == TIES.n_layer
    assert all(bool(r[0][future].isneginf().all()) for r in ranked)  # masked causally
    assert all(r.dtype == torch.float32 for r in ranked)  # scored in FP32 in an FP64 model
    assert sum(tied_rows(r, TIES.index_topk) for r in ranked) > 0  # exact ties at the k-th

    with earliest_ties():
        fixed = lifted_logits(hf, ids)
        fixed_decoded = lifted_logits(hf, ids, [1] * LENGTH)
        fixed_alone = torch.cat([lifted_logits(hf, ids[:, :i + 1])[:, -1:] for i in range(LENGTH)],
                                dim=1)
    tol = TOLERANCE[torch.float64]
    assert close(fixed_decoded, fixed, tol) and close(fixed_alone, fixed, tol)


def test_the_attention_subclass_is_what_runs():
    m = model(TIES, torch.float32)
    assert all(type(block.attn) is IndexedAttention for block in m.h)


def test_the_grid_model_runs_on_ties():
    """The grid's indexed model and stream tie at the k-th place (what its checks rely on)."""
    from kvdoc.proofs.grid import MODELS, STREAM_LENGTH

    m = MODELS["indexed"].build(0)
    ids = torch.randint(0, m.config.vocab_size, (2, STREAM_LENGTH),
                        generator=torch.Generator().manual_seed(1000))  # the suite's stream
    assert m.config.index_topk < STREAM_LENGTH and ties_in_full_forward(m, ids) > 0


def selection_margin(m: IndexedDecoder, ids: torch.Tensor) -> float:
    """The smallest change, relative to the row's largest per-head score ``q . k``, that could
    change a full forward's top-k at some query: the gap between the k-th and (k+1)-th scores,
    or where a score of 0 (every head's ReLU at zero) stands at the k-th place, how far its
    largest head's ``q . k`` is below 0."""
    k, margins = m.config.index_topk, []
    for block in m.h:
        ix = block.attn.indexer

        def spy(x, q_latent, keys, at, ix=ix, original=ix.scores):
            B, C, _ = x.shape
            q = ix.wq_b(q_latent).view(B, C, ix.config.index_n_heads, -1).transpose(1, 2)
            # [B, H_I, C, T], before the ReLU
            z = ix._rotate(q, at) @ keys.mT * ix.config.index_head_dim ** -0.5
            scores = original(x, q_latent, keys, at)
            margins.append((scores, z))
            return scores
        ix.scores = spy
    try:
        with torch.no_grad():
            m(ids)
    finally:
        for block in m.h:
            del block.attn.indexer.scores
    worst = float("inf")
    for scores, z in margins:
        for i in range(k, scores.shape[1]):  # queries with more than k keys to choose from
            row, zr = scores[:, i, :i + 1], z[:, :, i, :i + 1]
            ranked = row.sort(dim=-1, descending=True).values
            a, b = ranked[:, k - 1], ranked[:, k]
            gap = torch.where(a > b, a - b, torch.inf)
            below_zero = torch.where(row == 0, -zr.amax(dim=1), torch.inf).amin(dim=-1)
            gap = torch.where((a == 0) | (b == 0), torch.minimum(gap, below_zero), gap)
            worst = min(worst, float((gap / zr.abs().amax(dim=(1, 2))).min()))
    return worst


def test_the_grid_streams_decide_the_selection():
    """A near-tie at the k-th place is decided by rounding, so two paths whose matmuls differ in
    shape may read different keys there: measured here, the cached and full paths' FP32 scores
    differ by up to about 2.4e-7 of the scale, and a 150-token stream's smallest margin is
    often under 1e-6. The grid's indexed model is built from weights (``grid``'s seed offset)
    whose verify streams, default and ``--thorough``, keep every margin above 1e-5 (over 40
    times that), computed in FP64 so the figure does not depend on the machine."""
    from kvdoc.proofs.grid import BATCHES, MODELS, STREAM_LENGTH
    from kvdoc.proofs.suite import _streams
    from kvdoc.proofs.verify import verify_passes

    runs = {(seed, p.get("length", STREAM_LENGTH), max(p.get("batches", BATCHES)))
            for thorough in (False, True) for p in verify_passes(thorough)
            for seed in p["seeds"]}
    for seed, length, batch in sorted(runs):
        m = MODELS["indexed"].build(seed).double()
        for ids in _streams(seed, batch, length, m.config.vocab_size):  # and crop's, branch's
            assert selection_margin(m, ids) > 1e-5, (seed, length, batch)


def test_the_grid_invariants_see_the_indexer_keys():
    """``bytes``'s checks: a formula without the indexer keys, and indexer keys one row ahead of
    the latent, are both reported."""
    from kvdoc.proofs.cache_invariants import byte_problems

    m, ids = model(TIES, torch.float32), stream()
    with torch.no_grad():
        _, cache = m(ids[:, :6], m.new_cache(2))
    assert byte_problems(cache) == []
    layer = cache.layers[0]
    layer.expected_nbytes = layer.latent.expected_nbytes  # the latent's bytes alone
    assert any("the formula gives" in p for p in byte_problems(cache))
    del layer.expected_nbytes
    layer.write_keys(torch.zeros(2, 1, 1, TIES.index_head_dim), 6)  # keys ahead of the latent
    assert any("indexer keys" in p for p in byte_problems(cache))
