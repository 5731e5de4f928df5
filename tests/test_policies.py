"""Policies against their specification (kvdoc.proofs.schedule_spec and the checks of
kvdoc.proofs.policies), each with the broken variant only it catches."""

import pytest
import torch

from kvdoc.proofs.broken import policies as broken
from kvdoc.proofs.compare import default_model
from kvdoc.proofs.prefix_cache import check_admission, check_locked_eviction, compare_workload
from kvdoc.proofs.radix_policy import LRUOracle, check_eviction, check_full_match
from kvdoc.proofs.schedule_spec import check_schedule, expected_steps, first_difference
from kvdoc.proofs.scheduling import check_policies, check_preemption
from kvdoc.proofs.suite import run_suite
from kvdoc.serving.prefix_workload import few_shot_workload
from kvdoc.serving.requests import Request
from kvdoc.serving.scheduler import Scheduler


@pytest.fixture(scope="module")
def model():
    return default_model()


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


@pytest.mark.parametrize("cls", [broken.PrefillBeforeDecode, broken.BudgetPlusOne,
                                 broken.PreemptOldest])
def test_broken_schedulers_caught_by_the_specification_only(model, cls):
    assert not all(c.passed for c in check_schedule(model, cls))
    # every request still equals its solo run: the equality checks cannot see it
    assert all(c.passed for c in check_policies(model, scheduler=cls))
    assert check_preemption(model, cls).passed


CAUGHT_BY = {"prefill-before-decode": "schedule", "budget-plus-one": "schedule",
             "preempt-oldest": "schedule", "radix-most-recent-first": "eviction",
             "radix-last-token-from-tree": "full-match"}


@pytest.mark.parametrize("name", sorted(CAUGHT_BY))
def test_policy_variants_fail_the_suite_at_their_check_only(name):
    report = run_suite(name, dtypes=(torch.float32,),
                       scenarios=["scheduling", "prefix-cache", "schedule", "radix-policy"])
    assert report.failed_checks() == [CAUGHT_BY[name]]


def test_schedule_scenario_passes_on_the_implementation():
    report = run_suite(models=("gqa",), kinds=("paged",), impls=("model",),
                       dtypes=(torch.float32,), scenarios=["schedule"])
    assert report.passed and len(report.select("schedule")) == 1


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
    tree = broken.most_recent_first()
    assert not check_eviction(model, tree).passed
    assert check_full_match(model, tree).passed and _equal_to_alone(model, tree)


def test_full_match_recomputes_the_last_token(model):
    ok = check_full_match(model)
    assert ok.passed and ok.hits == 7 + 5, ok.detail  # 8 and 6 tokens held, the last computed
    tree = broken.LastTokenFromTree
    assert not check_full_match(model, tree).passed
    assert check_eviction(model, tree).passed and _equal_to_alone(model, tree)
