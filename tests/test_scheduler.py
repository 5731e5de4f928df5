"""The scheduler (kvdoc.serving.scheduler): every request equals its solo run, the blocks add up,
and the policies compose their steps as they say; broken schedulers are caught."""

import copy

import pytest
import torch

from kvdoc.core.config import llama_config
from kvdoc.core.model import Decoder
from kvdoc.proofs.scheduling import (
    LeakingScheduler,
    SharedStartScheduler,
    check_policies,
    compare_trace_with_alone,
)
from kvdoc.proofs.verify import default_model
from kvdoc.serving.scheduler import Request, Scheduler, arrival_trace, serve

TRACE = arrival_trace(6, prompt_lens=(2, 10), output_lens=(1, 6), max_gap=2, seed=1)


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_policy_equals_solo_runs(model, dtype):
    checks = check_policies(copy.deepcopy(model).to(dtype), TRACE)
    assert [(c.policy, c.token_budget) for c in checks] == [
        ("static", None), ("continuous", None), ("continuous", 6)]
    assert all(c.requests_equal for c in checks), checks
    assert all(c.invariants_hold for c in checks), checks


def test_broken_schedulers_are_caught(model):
    shared = SharedStartScheduler(model, num_blocks=16).run(TRACE)
    assert not all(c.passed for c in compare_trace_with_alone(model, TRACE, shared))
    assert shared.invariants_hold  # the blocks are right; the positions are not
    leaking = LeakingScheduler(model, num_blocks=40).run(TRACE)
    assert all(c.passed for c in compare_trace_with_alone(model, TRACE, leaking))
    assert not leaking.invariants_hold
    assert leaking.steps[-1].blocks_held > 0 == leaking.steps[-1].blocks_named


def test_blocks_follow_written_positions(model):
    run = serve(model, TRACE, num_blocks=16)
    assert run.steps[-1].blocks_held == 0 and run.steps[-1].blocks_free == 16
    assert max(run.memory_bytes()) <= 16 * run.block_nbytes
    assert all(len(run.tokens[r.rid]) == r.output_len for r in TRACE)
    assert all(run.emitted[r.rid][0] >= r.arrival for r in TRACE)


def test_prefill_first_stalls_decodes_and_the_budget_does_not(model):
    plain = serve(model, TRACE, num_blocks=16)
    chunked = serve(model, TRACE, num_blocks=16, token_budget=4, max_batch=4)
    # without a budget a step with admissions is prefill only: running decodes wait
    assert all(len({kind for _, _, kind in s.rows}) <= 1 for s in plain.steps)
    assert max(plain.decode_gaps()) > 1
    assert all(s.tokens <= 4 for s in chunked.steps)
    assert set(chunked.decode_gaps()) == {1}  # every decode gets its token every step


def test_static_batches_admit_only_when_the_batch_is_done(model):
    run = serve(model, TRACE, num_blocks=40, policy="static", max_batch=3)
    grid = run.composition(TRACE)  # 2: holding outside the forward, 3 prefill, 4 decode
    members = [frozenset(torch.nonzero(grid[:, t] >= 2).flatten().tolist())
               for t in range(grid.shape[1])]
    batches = [m for i, m in enumerate(members) if m and (i == 0 or m != members[i - 1])]
    assert sorted(r for b in batches for r in b) == list(range(len(TRACE)))  # each once


def test_refusals(model):
    with pytest.raises(ValueError, match="RoPE"):
        torch.manual_seed(0)
        Scheduler(Decoder(llama_config()).eval(), num_blocks=4)
    with pytest.raises(ValueError, match="needs 3 blocks, the pool has 2"):
        serve(model, [Request(0, (1,) * 9, 2, 0)], num_blocks=2)
    with pytest.raises(ValueError, match="policy='continuous'"):
        Scheduler(model, num_blocks=4, policy="static", token_budget=4)
    with pytest.raises(ValueError, match="token_budget must be a positive integer, got 0"):
        Scheduler(model, num_blocks=4, token_budget=0)
    with pytest.raises(ValueError, match="unknown policy"):
        Scheduler(model, num_blocks=4, policy="eager")


def test_scenario_runs_on_the_grid(monkeypatch):
    from kvdoc.proofs import scenarios, suite
    from kvdoc.proofs.scheduling import scheduling_scenario

    monkeypatch.setitem(scenarios.SCENARIOS, "scheduling", scheduling_scenario)
    monkeypatch.setitem(scenarios.CHECKS, "scheduling", "each served request vs its solo run")
    report = suite.run_suite(models=["mha", "llama"], kinds=["paged", "dynamic"],
                             impls=["model"], dtypes=(torch.float32,), scenarios=["scheduling"])
    verdicts = {(r.model, r.kind): r.passed for r in report.results}
    assert verdicts == {("mha", "paged"): True, ("mha", "dynamic"): None,
                        ("llama", "paged"): None, ("llama", "dynamic"): None}
