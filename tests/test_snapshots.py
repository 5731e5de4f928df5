"""A radix tree serving a hybrid model (``kvdoc.serving.snapshots``): the hits its saved states
give equal the placement model's (``state_prefix_report``), every request equals its run
alone, and a state never outlives the rows before it."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder
from kvdoc.core.state import StateSpec, read_state, restore, snapshot
from kvdoc.measure.prefix_report import state_prefix_report
from kvdoc.proofs.compare import TOLERANCE, close
from kvdoc.proofs.grid import MODELS
from kvdoc.serving.paged import BlockPool, new_paged_cache
from kvdoc.serving.radix import RadixCache, serve_prompt
from kvdoc.serving.scheduler import Scheduler
from kvdoc.serving.snapshots import WHERE, SnapshotStore


def chat(vocab: int, seed: int = 0) -> list[list[int]]:
    """A system prompt, conversations that grow by a turn, and a retried prompt."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    system = words(13)
    prompts, live = [], []
    for _ in range(9):
        if live and rng.random() < 0.5:  # a conversation's next turn
            i = rng.randrange(len(live))
            live[i] = live[i] + words(rng.randrange(2, 9))
            prompts.append(live[i])
        else:
            live.append(system + words(rng.randrange(1, 11)))
            prompts.append(live[-1])
    return prompts + [prompts[3]]


def model(seed: int = 0) -> DeltaNetDecoder:
    torch.manual_seed(seed)
    return DeltaNetDecoder(DeltaNetConfig()).eval()


@pytest.mark.parametrize("branch", [False, True])
@pytest.mark.parametrize("where", WHERE)
def test_hits_are_the_placement_models(where: str, branch: bool) -> None:
    """With room for everything and no generated token kept (``max_new=1``), the tree holds the
    prompts' rows and the states its prefills saved: what ``state_prefix_report`` counts. The
    prompt's ``"end"`` needs the rows of its partly filled last block, which a tree of whole
    blocks drops: that rule is compared at a block of one position."""
    m = model()
    prompts = chat(m.config.vocab_size)
    block = 1 if where == "end" else 4
    tree = RadixCache(BlockPool(m.config, num_blocks=400, block_size=block),
                      states=SnapshotStore(where, block, branch))
    served = [serve_prompt(m, tree, p, max_new=1) for p in prompts]
    report = state_prefix_report(prompts, where, block, branch)
    assert [s.matched for s in served] == report.hits
    assert sum(report.hits) > 0 and not tree.evicted_blocks
    assert len(tree.states.saved) == report.snapshots


@pytest.mark.parametrize("name", ["deltanet", "bamba"])
def test_each_request_equals_its_run_alone_under_evictions(name: str) -> None:
    """A pool too small for the workload: leaves go, their states with them, and each request's
    logits still equal one full forward of its tokens; no saved state outlives its rows."""
    m = MODELS[name].build(0)
    prompts = chat(m.config.vocab_size, seed=1)
    tree = RadixCache(BlockPool(m.config, num_blocks=14, block_size=4), states="every")
    for prompt in prompts:
        s = serve_prompt(m, tree, prompt, max_new=3)
        full = m(torch.tensor([s.tokens[:-1]]))[0][:, s.matched:]
        assert close(s.logits, full, TOLERANCE[torch.float32])
        assert all(tree.match(key)[0] >= len(key) for key in tree.states.saved)
    assert tree.evicted_blocks > 0 and any(s > 0 for s in state_prefix_report(prompts).hits)


def test_a_saved_state_goes_with_its_rows() -> None:
    """Evicting a leaf drops the states saved inside it; without the prune one would remain."""
    m = model()
    tree = RadixCache(BlockPool(m.config, num_blocks=8, block_size=4), evict="block",
                      states="every")
    serve_prompt(m, tree, list(range(1, 15)), max_new=2)  # 3 whole blocks; states at 4, 8, 12
    assert sorted(map(len, tree.states.saved)) == [4, 8, 12]
    tree.evict(1)  # the last block, positions 8..11: the state after 12 cannot be resumed
    assert sorted(map(len, tree.states.saved)) == [4, 8]
    per_state = 4 * sum(math.prod(shape) for spec in m.config.cache_layout
                        if isinstance(spec, StateSpec) for _, shape in spec.shapes)
    assert tree.states.nbytes() == 2 * per_state  # FP32: the same bytes at every position


def test_refusals_leave_everything_as_it_was() -> None:
    m = model()
    with pytest.raises(ValueError, match="only a pool with recurrent state layers"):
        RadixCache(BlockPool(MODELS["llama"].build(0).config, 4, 4), states="every")
    with pytest.raises(ValueError, match="where must be one of"):
        SnapshotStore("middle")
    cache = new_paged_cache(m, batch=1, capacity=16, block_size=4)
    _, cache = m(torch.tensor([list(range(1, 10))]), cache)
    tables, free = [list(t) for t in cache.tables], cache.pool.num_free
    with pytest.raises(ValueError, match="cannot go back"):
        cache.crop(4)  # a recurrent state folds every position: no way back without a snapshot
    assert (cache.seq_len, cache.tables, cache.pool.num_free) == (9, tables, free)


def test_a_paged_hybrid_cache_restores_a_snapshot_and_fails_cleanly() -> None:
    m, ids = model(), torch.tensor([list(range(3, 19))])
    cache = new_paged_cache(m, batch=1, capacity=16, block_size=4)
    _, cache = m(ids[:, :8], cache)
    snap, states = snapshot(cache), read_state(cache, 0)

    def boom(*args, **kwargs):
        raise RuntimeError("a layer fails midway")
    m.h[-1].forward = boom  # after the first layer replaced its state
    with pytest.raises(RuntimeError):
        m(ids[:, 8:12], cache)
    del m.h[-1].forward
    assert all(torch.equal(states[n], t) for n, t in read_state(cache, 0).items())
    _, cache = m(ids[:, 8:], cache)
    restore(cache, snap)  # back to 8: states from the snapshot, rows by the block tables
    logits, cache = m(ids[:, 8:], cache)
    assert close(logits, m(ids)[0][:, 8:], TOLERANCE[torch.float32]) and cache.seq_len == 16


class PreemptKeepsStates(Scheduler):
    """BROKEN: preemption forgets a hybrid's positions but not its states, so the recompute
    folds the sequence into the state it had already folded."""

    def preempt(self, live):
        states = live.states
        discarded = super().preempt(live)
        live.states = states  # BUG: a recompute starts from zeros
        return discarded


class StatesNotCarried(Scheduler):
    """BROKEN: a hybrid's row starts every step from zeros, not from the states it left."""

    def _logits(self, rows):
        for x, _ in rows:
            x.states = {}  # BUG: what the row's last step left is dropped
        return super()._logits(rows)


@pytest.mark.parametrize("name", ["deltanet", "bamba"])
def test_the_scheduler_serves_a_hybrid_model(name) -> None:
    # static, continuous, chunked prefill, preemption by recompute, seeded forks: every request
    # equals its run alone; a broken scheduler that drops or keeps a state wrongly is caught
    from kvdoc.teach.scheduling import check_forks, check_policies, check_preemption

    m = MODELS[name].build(0).eval()
    with torch.no_grad():
        assert all(c.passed for c in check_policies(m))
        preemption = check_preemption(m)
        assert preemption.passed and all(run.preemptions for run in preemption.tight)
        assert check_forks(m).passed
        assert not check_preemption(m, PreemptKeepsStates).requests_equal
        assert not any(c.requests_equal for c in check_policies(m, scheduler=StatesNotCarried))
