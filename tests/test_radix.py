"""The radix-tree prefix cache: matching, copy-on-write of a partly matched block, locks, LRU
eviction, bookkeeping, and each request against itself alone."""

import pytest
import torch

from kvdoc.proofs.compare import default_model
from kvdoc.serving.paged import BlockPool
from kvdoc.serving.prefix_workload import Turn
from kvdoc.serving.radix import RadixCache, serve_prompt
from kvdoc.teach.broken_shown import (
    EvictLocked,
    ReserveFinalToken,
    ShareLastBlock,
    WholeBlockMatch,
)
from kvdoc.teach.prefix_cache import (
    check_admission,
    check_locked_eviction,
    compare_workload,
    invariant_errors,
)


@pytest.fixture(scope="module")
def model():
    return default_model()


def tree_for(model, blocks=16, granularity="token", evict="leaf"):
    return RadixCache(BlockPool(model.config, blocks, 4), granularity, evict=evict)


A = list(range(1, 11))  # 10 tokens: two whole blocks and a half
TURNS = [Turn(tuple(A), 3, "a"), Turn(tuple(A[:6]) + (50, 51, 52), 2, "b"),
         Turn((60, 61, 62), 2, "c", after=0), Turn(tuple(A[:9]), 2, "d")]


def test_token_match_shares_the_partial_block_and_copies_it_on_write(model):
    tree = tree_for(model)
    serve_prompt(model, tree, A, max_new=3)  # 12 positions held: blocks 0, 1, 2 kept
    assert tree.match(A[:6] + [50])[:2] == (6, [0, 1])
    kept = [t[1].clone() for t in (*tree.pool.k, *tree.pool.v)]
    request = tree.admit(A[:6] + [50, 51], max_new=1)
    assert (request.matched, request.cache.tables, tree.pool.refs(1)) == (6, [[0, 1]], 2)
    assert invariant_errors(tree) == []
    model(torch.tensor([[50, 51]]), request.cache)
    assert request.cache.tables[0][0] == 0 and request.cache.tables[0][1] != 1  # copied
    assert all(torch.equal(t[1], k) for t, k in zip((*tree.pool.k, *tree.pool.v), kept,
                                                     strict=True))
    assert tree.pool.refs(1) == 1 and invariant_errors(tree) == []


def test_block_granularity_keeps_whole_blocks_and_a_whole_prompt_keeps_its_last_token(model):
    tree = tree_for(model, granularity="block")
    serve_prompt(model, tree, A, max_new=3)
    assert tree.match(A[:6] + [50])[:2] == (4, [0])
    # found whole, ending on a block boundary: its last block is recomputed, nothing copied
    assert tree.admit(A[:8], max_new=1).matched == 4


def test_admission_reserves_what_a_request_writes_and_block_mode_copies_nothing(model):
    assert check_admission(model).passed
    tree = tree_for(model, blocks=3)
    served = serve_prompt(model, tree, A[:8], max_new=5)  # 12 positions written: 3 blocks
    assert len(served.tokens) == 13 and tree.blocks_held() == 3


def test_broken_admissions_are_caught(model):
    reserve = check_admission(model, ReserveFinalToken)
    assert not reserve.passed and "refused" in reserve.detail
    share = check_admission(model, ShareLastBlock)
    assert not share.passed and "matched 7" in share.detail


def test_every_request_equals_itself_alone_fp32_and_fp64(model):
    for m in (model, default_model().double()):
        for granularity in ("token", "block"):
            check = compare_workload(m, TURNS, num_blocks=16, granularity=granularity)
            assert check.passed, check.requests
            assert [r.matched for r in check.requests] == (
                [0, 6, 12, 8] if granularity == "token" else [0, 4, 12, 8])


def test_a_shared_block_has_one_reference_per_holder(model):
    tree = tree_for(model)
    serve_prompt(model, tree, A, max_new=3)
    one, two = tree.admit(A[:9], 1), tree.admit(A[:8] + [70], 1)
    assert tree.pool.refs(0) == 3 and tree.pool.refs(1) == 3  # the tree and both requests
    assert invariant_errors(tree) == []
    with pytest.raises(ValueError, match="still running"):
        tree.clear()
    tree.retire(one, A[:8])  # neither was fed: each holds its 8 matched positions
    tree.retire(two, A[:8])
    assert invariant_errors(tree) == []
    tree.clear()
    assert tree.pool.num_free == tree.pool.num_blocks and invariant_errors(tree) == []


def test_lru_evicts_the_least_recently_used_unlocked_leaf(model):
    tree = tree_for(model, blocks=7)
    serve_prompt(model, tree, [1, 2, 3, 4, 5], max_new=4)  # 8 positions: 2 blocks
    serve_prompt(model, tree, [9, 8, 7, 6, 5], max_new=4)
    serve_prompt(model, tree, [1, 2, 3, 4, 5], max_new=4)  # the first again: the second is older
    request = tree.admit(list(range(30, 39)), max_new=7)  # 4 new blocks, 3 free
    assert (request.matched, tree.evicted_nodes, tree.evicted_blocks) == (0, 1, 2)
    assert tree.match([9, 8, 7, 6])[0] == 0 and tree.match([1, 2, 3, 4])[0] == 4
    assert invariant_errors(tree) == []


def test_block_eviction_takes_the_oldest_leafs_last_block_only(model):
    tree = tree_for(model, blocks=7, evict="block")
    serve_prompt(model, tree, [1, 2, 3, 4, 5], max_new=4)  # 8 positions: 2 blocks
    serve_prompt(model, tree, [9, 8, 7, 6, 5], max_new=4)
    serve_prompt(model, tree, [1, 2, 3, 4, 5], max_new=4)  # the first again: the second is older
    request = tree.admit(list(range(30, 39)), max_new=7)  # 4 new blocks, 3 free: 1 evicted
    assert (request.matched, tree.evicted_nodes, tree.evicted_blocks) == (0, 0, 1)
    old = (9, 8, 7, 6, 5) + tuple(tree.evictions[0][0][5:])
    assert tree.evictions == [(old, 1)]  # the second request's tail, its first block kept
    assert tree.match([9, 8, 7, 6, 5])[0] == 4 and tree.match([1, 2, 3, 4, 5])[0] == 5
    assert invariant_errors(tree) == []
    with pytest.raises(ValueError, match="evict must be 'leaf' or 'block', got 'tail'"):
        tree_for(model, blocks=7, evict="tail")


def test_broken_trees_are_caught(model):
    assert not compare_workload(model, TURNS, 16, tree_cls=WholeBlockMatch).passed
    assert check_locked_eviction(model).passed
    caught = check_locked_eviction(model, EvictLocked)
    assert not caught.passed and "free list is held" in caught.detail


def test_bad_input_leaves_the_tree_as_it_was(model):
    with pytest.raises(ValueError, match="granularity must be"):
        tree_for(model, granularity="page")
    tree = tree_for(model, blocks=4)
    serve_prompt(model, tree, A, max_new=3)
    before = tree.render()
    with pytest.raises(ValueError, match="non-empty prompt"):
        tree.admit([], 1)
    with pytest.raises(ValueError, match="out of blocks"):
        tree.admit(A + list(range(20, 30)), max_new=1)
    assert tree.render() == before and tree.running == [] and invariant_errors(tree) == []
    request = tree.admit(A[:5], 1)
    with pytest.raises(ValueError, match="tokens must be"):
        tree.retire(request, A[:3])


# --- every decoder of the grid: RoPE, a window, Gemma's hybrid layers, MLA's latent -----------

@pytest.mark.parametrize("name", ["llama", "mistral", "mla", "mla-absorbed", "gemma3"])
@pytest.mark.parametrize("granularity", ["token", "block"])
def test_every_model_through_the_tree_equals_each_request_alone(name, granularity):
    from kvdoc.proofs.grid import MODELS
    from kvdoc.serving.prefix_workload import few_shot_workload

    model = MODELS[name].build(0)
    turns = few_shot_workload(requests=3, vocab=model.config.vocab_size)  # prompts past 16
    check = compare_workload(model, turns, num_blocks=32, granularity=granularity)
    assert check.passed, check.requests
    assert sum(r.matched for r in check.requests) > 0  # the tree did share a prefix
    assert check_locked_eviction(model).passed
