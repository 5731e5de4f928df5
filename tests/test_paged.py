"""The paged cache and the shared-prefix cache against the dynamic cache, and their refusals."""

import gc

import pytest
import torch

from kvdoc import Decoder, GPTConfig
from kvdoc.proofs.compare import TOLERANCE, Snapshot, run_cached
from kvdoc.serving.paged import (
    BlockPool,
    PagedCache,
    new_paged_cache,
    new_shared_prefix_cache,
)
from kvdoc.serving.workload import measure_mix, request_mix
from kvdoc.teach.serving_checks import compare_mix_with_alone

FACTORIES = {"paged": new_paged_cache, "shared-prefix": new_shared_prefix_cache}


def gqa_model(n_kv_head: int) -> Decoder:
    torch.manual_seed(0)
    return Decoder(GPTConfig(n_kv_head=n_kv_head)).eval()


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize("chunk", [1, 3, 24])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_equals_dynamic_cache(stream, kind, n_kv_head, chunk, block_size):
    model = gqa_model(n_kv_head)
    T = stream.shape[1]
    paged_cache = FACTORIES[kind](model, 2, T, block_size=block_size)
    paged = run_cached(model, stream, chunk, cache=paged_cache, in_place=kind == "paged")
    ref = run_cached(model, stream, chunk)
    got, paged_cache, dynamic = paged.logits, paged.cache, ref.cache
    # no call changed a row already held (nor, shared, the length)
    assert paged.lifecycle_error == 0.0
    ref = ref.logits
    tol = TOLERANCE[torch.float32]
    assert torch.allclose(got, ref, atol=tol, rtol=tol)
    assert paged_cache.seq_len == T
    for i in range(model.config.n_layer):
        for a, b in zip(paged_cache.layer(i), dynamic.layer(i), strict=True):
            assert a.shape == b.shape == (2, n_kv_head, T, 16)  # [B, H_kv, T, D_h]
            assert torch.allclose(a, b, atol=tol, rtol=tol)
    assert len(paged_cache.tables[0]) == -(-T // block_size)  # streams cross many blocks


def test_float64_and_rows_use_separate_blocks(stream):
    model = gqa_model(2).double()
    cache = FACTORIES["paged"](model, 2, 24, block_size=5)
    run = run_cached(model, stream, 5, cache=cache)
    got, cache = run.logits, run.cache
    tol = TOLERANCE[torch.float64]
    assert torch.allclose(got, model(stream).logits, atol=tol, rtol=tol)
    assert not set(cache.tables[0]) & set(cache.tables[1])


def test_out_of_blocks_is_refused_and_changes_nothing(model, stream):
    cache = FACTORIES["paged"](model, 2, 8, block_size=4)  # 4 blocks: 8 positions per row
    _, cache = model(stream[:, :6], cache)
    before, tables, free = Snapshot.of(cache), [list(t) for t in cache.tables], cache.pool.num_free
    with pytest.raises(ValueError, match="out of blocks"):
        model(stream[:, 6:9], cache)
    assert cache.seq_len == 6 and cache.tables == tables and cache.pool.num_free == free
    assert before.changed(cache) == 0.0
    model(stream[:, 6:8], cache)  # what fits is still accepted
    assert cache.seq_len == 8


def test_bad_writes_are_refused(model):
    cache = FACTORIES["paged"](model, 1, 8)
    k = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="write starts at 3"):
        cache.update(0, k, k, start=3)
    with pytest.raises(ValueError, match=r"\[B, H, C, width\]"):
        cache.update(0, k[:, :2], k[:, :2], start=0)
    with pytest.raises(ValueError, match=r"must be torch\.float32"):
        cache.update(0, k.double(), k.double(), start=0)
    with pytest.raises(ValueError, match="batch size"):
        model(torch.zeros(2, 1, dtype=torch.long), cache)
    assert cache.seq_len == 0 and cache.pool.num_free == cache.pool.num_blocks
    with pytest.raises(ValueError, match="fork rows"):
        cache.fork([1])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(GPTConfig(), num_blocks=0, block_size=4)


def test_fork_shares_prefix_and_copies_on_write(model, stream):
    pool = BlockPool(model.config, num_blocks=16, block_size=4)
    prefix = PagedCache(pool, 1)
    model(stream[:1, :6], prefix)  # one full block, one half-filled block
    kept = Snapshot.of(prefix)
    a, b = prefix.fork(), prefix.fork()
    assert pool.refs(prefix.tables[0][0]) == 3 and pool.num_used == 2
    logits_a = model(stream[:1, 6:20], a).logits
    logits_b = model(stream[1:, 6:20], b).logits
    # The full block stays shared; the half-filled one was copied by each fork when it wrote.
    assert a.tables[0][0] == b.tables[0][0] == prefix.tables[0][0]
    assert len({a.tables[0][1], b.tables[0][1], prefix.tables[0][1]}) == 3
    assert kept.changed(prefix) == 0.0 and prefix.seq_len == 6
    tol = TOLERANCE[torch.float32]
    row_b = torch.cat((stream[:1, :6], stream[1:, 6:]), 1)
    for row, logits in ((stream[:1], logits_a), (row_b, logits_b)):
        alone = model(row[:, :20]).logits[:, 6:]  # each request equals itself run alone
        assert torch.allclose(logits, alone, atol=tol, rtol=tol)
    used = pool.num_used
    b.release()
    assert pool.num_used == used - 4  # b's four own blocks; the shared one stays with a and prefix
    del a
    gc.collect()
    prefix.release()
    assert pool.num_free == pool.num_blocks


def test_shared_prefix_cache_leaves_the_cache_passed_in_unchanged(model, stream):
    prefix = new_shared_prefix_cache(model, 2, 24, block_size=4)
    _, prefix = model(stream[:, :10], prefix)
    kept, tables = Snapshot.of(prefix), [list(t) for t in prefix.tables]
    _, longer = model(stream[:, 10:], prefix)
    assert longer.shared and longer.seq_len == 24 and prefix.seq_len == 10
    assert prefix.tables == tables and kept.changed(prefix) == 0.0
    # two full blocks shared per row
    assert [t[:2] for t in longer.tables] == [t[:2] for t in tables]


def test_shared_prefix_out_of_blocks_refused_before_the_forward(model, stream):
    prefix = new_shared_prefix_cache(model, 1, 4, block_size=4)  # 1 block + 1 spare
    _, prefix = model(stream[:1, :2], prefix)
    with pytest.raises(ValueError, match="out of blocks"):
        model(stream[:1, 2:7], prefix)  # a copy of the half block and a new one: 2 > 1 free
    assert prefix.pool.num_used == 1 and prefix.seq_len == 2


def test_request_mix_memory(model):
    mix = request_mix(n=6, prefix_len=10, user_lens=(3, 20), output_lens=(1, 20))
    m = measure_mix(model, mix, block_size=4)
    contiguous, paged, shared = m.strategies
    assert compare_mix_with_alone(model, mix, m)[1]  # each request as if alone
    other = request_mix(n=6, prefix_len=10, user_lens=(3, 20), output_lens=(1, 20), seed=1)
    assert not compare_mix_with_alone(model, other, m)[1]  # the check can fail
    assert m.positions == sum(mix.lengths())
    assert contiguous.filled_bytes == paged.filled_bytes == m.positions * m.position_bytes
    blocks = sum(-(-n // 4) for n in mix.lengths())
    assert paged.reserved_bytes == blocks * 4 * m.position_bytes
    # Sharing stores the two full prefix blocks once instead of six times; the prefix keeps its own
    # half-filled third block, which every request copied before writing into it.
    assert m.saved_by_sharing == ((6 - 1) * 2 - 1) * 4 * m.position_bytes
    assert all(0 <= s.unused_bytes for s in m.strategies)
    assert paged.unused_bytes < 6 * 4 * m.position_bytes  # less than one block per request


# --- every decoder of the grid: RoPE, a window, Gemma's hybrid layers, MLA's latent -----------

GRID_MODELS = ["llama", "mistral", "mla", "mla-absorbed", "gemma3"]


@pytest.fixture(scope="module")
def grid_models():
    from kvdoc.proofs.grid import MODELS
    return {name: MODELS[name].build(0) for name in GRID_MODELS}


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize("name", GRID_MODELS)
def test_every_layout_equals_the_full_forward(grid_models, name, kind):
    model = grid_models[name]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=g)  # past the window, 16
    cache = FACTORIES[kind](model, 2, ids.shape[1], block_size=3)
    run = run_cached(model, ids, 5, cache=cache, in_place=kind == "paged")
    full = model(ids).logits
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(run.logits, full, atol=tol, rtol=tol)
    assert run.lifecycle_error == 0.0


def test_an_mla_pool_stores_two_widths(grid_models):
    model = grid_models["mla"]
    c = model.config
    cache = new_paged_cache(model, batch=1, capacity=8, block_size=4)
    assert [tuple(t.shape) for t in (cache.pool.k[0], cache.pool.v[0])] == [
        (2, 1, 4, c.kv_lora_rank), (2, 1, 4, c.qk_rope_head_dim)]
    assert cache.pool.block_nbytes == c.n_layer * 4 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert cache.pool.nbytes() == sum(t.numel() * t.element_size() for t in cache.tensors())


def test_a_layout_mismatch_is_refused_by_what_is_cached(grid_models):
    mla, llama = grid_models["mla"], grid_models["llama"]
    ids = torch.tensor([[1, 2, 3]])
    latent, kv = (m.config.cache_layout[0] for m in (mla, llama))
    with pytest.raises(ValueError, match=rf"holds \(heads, widths\) = \({kv.heads}, "):
        mla(ids, new_paged_cache(llama, batch=1, capacity=8))
    with pytest.raises(ValueError, match=rf"holds \(heads, widths\) = \({latent.heads}, "):
        llama(ids, new_paged_cache(mla, batch=1, capacity=8))
