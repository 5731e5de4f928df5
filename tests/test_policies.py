"""Policies against their specification (kvdoc.teach.schedule_spec), the radix cache against an
LRU oracle (kvdoc.teach.prefix_cache) and sampling against its distribution (kvdoc.teach.scheduling,
tests/test_speculative.py); every request of the scheduler and of the radix tree against its solo
run (kvdoc.teach.scheduling, kvdoc.teach.prefix_cache): on every model the verification grid
serves on a paged cache, and each broken variant (beside the check in its module) caught.

These were checks of ``python -m kvdoc verify`` on each such model's paged kind; they never
depended on the cache kind, so they are tests here, on the same models.
"""

import pytest
import torch
from test_speculative import speculative_sampling_exact

from kvdoc.proofs import grid
from kvdoc.proofs.compare import default_model
from kvdoc.proofs.variants import VARIANTS
from kvdoc.serving.prefix_workload import few_shot_workload
from kvdoc.serving.radix import RadixCache
from kvdoc.serving.requests import Request
from kvdoc.serving.scheduler import Scheduler
from kvdoc.serving.speculative import speculative_generate, truncated_draft
from kvdoc.teach.broken_shown import (
    EvictLocked,
    ForkWithoutCopy,
    ReserveFinalToken,
    ResumeWithoutRecompute,
    ShareLastBlock,
    WholeBlockMatch,
)
from kvdoc.teach.prefix_cache import (
    LastTokenFromTree,
    LRUOracle,
    check_admission,
    check_eviction,
    check_full_match,
    check_locked_eviction,
    compare_workload,
    most_recent_first,
)
from kvdoc.teach.schedule_spec import (
    BudgetPlusOne,
    PreemptOldest,
    PrefillBeforeDecode,
    check_schedule,
    expected_steps,
    first_difference,
)
from kvdoc.teach.scheduling import (
    RestartStream,
    check_forks,
    check_policies,
    check_preemption,
    check_sampled_preemption,
)


@pytest.fixture(scope="module")
def model():
    return default_model()


PAGED = [name for name, spec in grid.MODELS.items()
         if spec.scenarios is None and (spec.impls is None or "model" in spec.impls)
         and grid.served(spec.build(0).config, ["paged"], ["model"])]
"""The grid's models served on the paged kind, every scenario on them (where ``verify`` ran
these checks)."""


@pytest.mark.parametrize("name", PAGED)
def test_every_paged_model_schedules_evicts_and_samples_as_specified(name):
    model = grid.MODELS[name].build(0).eval()
    with torch.no_grad():
        schedules = check_schedule(model)
        assert all(c.passed for c in schedules), [c.difference for c in schedules]
        for check in (check_eviction(model), check_eviction(model, evict="block"),
                      check_full_match(model)):
            assert check.passed, check.detail
        assert speculative_sampling_exact(model)
        assert check_sampled_preemption(model).passed
        # formerly verify's `scheduling` and `prefix-cache` scenarios, FP32
        assert _served_as_alone(model) and _equal_to_alone(model, RadixCache)


def _served_as_alone(model, scheduler=Scheduler):
    """Static, continuous and chunked-prefill runs, preemption by recompute and seeded forks:
    every request equal to its solo run, the block invariants held."""
    return (all(c.passed for c in check_policies(model, scheduler=scheduler))
            and check_preemption(model, scheduler).passed
            and check_forks(model, scheduler).passed)


# verify's variants preempt-without-recompute and fork-without-copy (the scheduler), and
# radix-whole-block-match, -evict-locked, -reserve-final-token, -share-last-block (the tree)
@pytest.mark.parametrize("broken", [ResumeWithoutRecompute, ForkWithoutCopy])
def test_broken_schedulers_are_not_served_as_alone(model, broken):
    assert not _served_as_alone(model, broken)


@pytest.mark.parametrize("tree", [WholeBlockMatch, EvictLocked, ReserveFinalToken,
                                  ShareLastBlock])
def test_broken_radix_trees_are_not_equal_to_alone(model, tree):
    assert not _equal_to_alone(model, tree)


def test_spec_by_hand_budget():
    # 0: 5-token prompt, 3 tokens; 1 arrives at step 1, 3-token prompt, 2 tokens; budget 4
    trace = [Request(0, (1,) * 5, 3, 0), Request(1, (2,) * 3, 2, 1)]
    steps = expected_steps(trace, num_blocks=8, token_budget=4)
    assert [s.rows for s in steps] == [
        ((0, 4, "prefill"),), ((0, 1, "prefill"), (1, 3, "prefill")),
        ((0, 1, "decode"), (1, 1, "decode")), ((0, 1, "decode"),)]
    # blocks of 4: 4 positions; 5 + 3; 6 + 4 then 1 retires; 7 then 0 retires
    assert [s.blocks_held for s in steps] == [1, 3, 2, 0]


def test_spec_by_hand_preemption():
    # two 4-token prompts, 6 tokens each, on 3 blocks of 4: at step 1 request 0 takes the
    # last block for position 4, and request 1, the newest, is preempted (4 positions)
    trace = [Request(0, (1,) * 4, 6, 0), Request(1, (2,) * 4, 6, 0)]
    steps = expected_steps(trace, num_blocks=3, preempt=True)
    assert steps[1].rows == ((0, 1, "decode"),) and steps[1].preempted == ((1, 4),)
    assert steps[1].waiting == (1,)
    # 0 finishes at step 5 (positions 4..8 decoded); 1 recomputes prompt + 1 token at step 6
    assert steps[6].rows == ((1, 5, "recompute"),)
    assert len(steps) == 11
    run = Scheduler(default_model(), 3, 4, preempt=True).run(trace)
    assert first_difference(run, steps) is None


def test_spec_refuses_forks():
    with pytest.raises(ValueError, match="forks"):
        expected_steps([Request(0, (1, 2), 2, 0, samples=2, seed=0)], num_blocks=8)


def test_scheduler_follows_its_specification(model):
    checks = check_schedule(model)
    assert all(c.passed for c in checks), [c.difference for c in checks]
    assert sum(c.preemptions for c in checks) > 0  # the preempting runs do preempt


@pytest.mark.parametrize("cls", [PrefillBeforeDecode, BudgetPlusOne,
                                 PreemptOldest])
def test_broken_schedulers_caught_by_the_specification_only(model, cls):
    assert not all(c.passed for c in check_schedule(model, cls))
    # every request still equals its solo run: the equality checks cannot see it
    assert all(c.passed for c in check_policies(model, scheduler=cls))
    assert check_preemption(model, cls).passed


def test_lru_oracle_by_hand():
    oracle = LRUOracle(block_size=2)
    oracle.used = {(1, 2): 0, (1, 2, 3, 4): 1, (5, 6): 2}
    assert sorted(oracle.leaves()) == [(1, 2, 3, 4), (5, 6)]
    assert oracle.match((1, 2, 3, 9)) == 3 and oracle.match((1, 2, 3, 4)) == 3  # last token
    assert oracle.read((1, 2, 3, 9), 3) == {(1, 2), (1, 2, 3, 4)}
    assert "request 1's is older" in oracle.evicted((5, 6), 1, set())
    assert "not an unread leaf" in oracle.evicted((1, 2), 1, set())  # a parent first
    assert "not an unread leaf" in oracle.evicted((1, 2, 3, 4), 1, {(1, 2, 3, 4)})  # read
    assert oracle.evicted((1, 2, 3, 4), 2, set()) is None  # the leaf and its parent
    assert oracle.used == {(5, 6): 2}


def _equal_to_alone(model, tree):
    turns = few_shot_workload(requests=3, vocab=model.config.vocab_size)
    return (all(compare_workload(model, turns, 32, granularity=g, tree_cls=tree).passed
                for g in ("token", "block"))
            and check_locked_eviction(model, tree).passed and check_admission(model, tree).passed)


def test_eviction_follows_lru_and_most_recent_first_is_caught(model):
    ok = check_eviction(model)
    assert ok.passed and ok.evictions > 0, ok.detail  # the pool is small enough to evict
    tree = most_recent_first()
    assert not check_eviction(model, tree).passed
    assert check_full_match(model, tree).passed and _equal_to_alone(model, tree)


@pytest.mark.parametrize("name", ["position-counter", "last-only-first-row"])
def test_broken_decoders_fail_the_full_match_too(name):
    # a decoder bug shows through the radix tree as well; the sampled stream and the scheduler
    # see the second
    model = VARIANTS[name].build(grid.MODELS["mha"].build(0).eval())
    with torch.no_grad():
        assert not check_full_match(model).passed
        assert not _equal_to_alone(model, RadixCache)
        assert check_sampled_preemption(model).passed == (name == "position-counter")
        assert _served_as_alone(model) == (name == "position-counter")


class WholeLeafAlways(RadixCache):
    """BROKEN: asked to evict one block at a time (``evict="block"``), it evicts whole leaves;
    each eviction is still the least recently used leaf."""

    def __init__(self, pool, granularity="token", policy=None, evict="leaf"):
        super().__init__(pool, granularity, policy, evict)
        self.unit = "leaf"  # BUG: the evict argument is checked, then ignored


def test_block_eviction_takes_one_block_and_whole_leaves_are_caught(model):
    ok = check_eviction(model, evict="block")
    assert ok.passed and ok.evictions > 0, ok.detail
    tree = WholeLeafAlways
    assert not check_eviction(model, tree, evict="block").passed
    # whole leaves are what the default policy evicts: only the block-by-block check sees it
    assert check_eviction(model, tree).passed and _equal_to_alone(model, tree)


def test_full_match_recomputes_the_last_token(model):
    ok = check_full_match(model)
    assert ok.passed and ok.hits == 7 + 5, ok.detail  # 8 and 6 tokens held, the last computed
    tree = LastTokenFromTree
    assert not check_full_match(model, tree).passed
    assert check_eviction(model, tree).passed and _equal_to_alone(model, tree)


def test_speculative_generate_takes_its_rule(model):
    def always_three(p, q):  # reject every proposal, redraw token 3
        return torch.zeros_like(p), torch.nn.functional.one_hot(torch.tensor(3), len(p)).to(p)

    run = speculative_generate(model, truncated_draft(model, 1), torch.tensor([[5, 6, 7]]), 6,
                               k=2, generator=torch.Generator().manual_seed(0),
                               rule=always_three)
    # each round rejects its first proposal and emits the redraw; the last round, with one
    # token to go, proposes nothing and the target draws it
    assert run.tokens[0, 3:-1].tolist() == [3] * 5 and sum(run.accepted) == 0


def test_preempted_sampled_request_continues_its_stream(model):
    ok = check_sampled_preemption(model)
    assert ok.passed and ok.interrupted > 0
    assert not check_sampled_preemption(model, RestartStream).passed
    # greedy requests and forks never see the restart
    assert check_preemption(model, RestartStream).passed
    assert check_forks(model, RestartStream).passed


@pytest.mark.parametrize("budget", [5, 6, 8])
def test_with_room_the_scheduler_schedules_as_vllm_v1s_rule(model, budget):
    from kvdoc.serving.requests import arrival_trace
    from kvdoc.teach.schedule_spec import SCHEDULED, vllm_v1_steps
    from kvdoc.teach.scheduling import POLICY_TRACE, PREEMPTION_TRACE

    for args in (POLICY_TRACE, PREEMPTION_TRACE):
        trace = arrival_trace(**args)
        run = Scheduler(model, 32, 4, token_budget=budget, preempt=True).run(trace)
        assert first_difference(run, vllm_v1_steps(trace, 32, budget), SCHEDULED) is None
    # on 8 blocks vLLM admits a prompt whose chunk fits, kvdoc waits for its whole prompt
    trace = arrival_trace(**POLICY_TRACE)
    run = Scheduler(model, 8, 4, token_budget=8, preempt=True).run(trace)
    departure = first_difference(run, vllm_v1_steps(trace, 8, 8), SCHEDULED, "vLLM's rule")
    assert departure is not None and "prefill" in departure.split("vLLM's rule")[1]
