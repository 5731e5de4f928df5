"""The scheduler (kvdoc.serving.scheduler): every request equals its solo run, the blocks add up,
and the policies compose their steps as they say; broken schedulers are caught."""

import copy

import pytest
import torch

from kvdoc.core import model as core_model
from kvdoc.core.model import Decoder, generate, llama_config
from kvdoc.proofs.compare import default_model
from kvdoc.serving.requests import Request, arrival_trace
from kvdoc.serving.scheduler import LiveRequest, Scheduler, serve
from kvdoc.teach.broken_shown import (
    ForkWithoutCopy,
    ResumeWithoutRecompute,
    SharedStartScheduler,
)
from kvdoc.teach.scheduling import (
    PREEMPTION_TRACE,
    check_forks,
    check_policies,
    check_preemption,
    compare_trace_with_alone,
)


class LeakingScheduler(Scheduler):
    """BROKEN: retiring a request forgets its table but never gives its blocks back."""

    def retire(self, live: LiveRequest) -> None:
        live.table.clear()  # BUG: no self.pool.release(live.table) first


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
    with pytest.raises(ValueError, match="needs 3 blocks, the pool has 2"):
        serve(model, [Request(0, (1,) * 9, 2, 0)], num_blocks=2)
    with pytest.raises(ValueError, match="policy='continuous'"):
        Scheduler(model, num_blocks=4, policy="static", token_budget=4)
    with pytest.raises(ValueError, match="token_budget must be a positive integer, got 0"):
        Scheduler(model, num_blocks=4, token_budget=0)
    with pytest.raises(ValueError, match="unknown policy"):
        Scheduler(model, num_blocks=4, policy="eager")


# --- preemption by recompute and forks ----------------------------------------------------------

def test_preemption_by_recompute_equals_solo_runs(model):
    check = check_preemption(model)
    assert check.passed, check
    for tight, roomy in zip(check.tight, check.roomy, strict=True):
        assert tight.preemptions > 0 and tight.recomputed > 0
        assert roomy.preemptions == 0 == roomy.recomputed
        assert tight.blocks_peak <= 8 < roomy.blocks_peak
        assert len(tight.steps) > len(roomy.steps)  # recomputing costs steps
        kinds = {kind for s in tight.steps for _, _, kind in s.rows}
        assert "recompute" in kinds and 5 in tight.composition(arrival_trace(
            **PREEMPTION_TRACE)).unique().tolist()


def test_the_victim_is_the_most_recently_admitted(model):
    # two requests admitted in steps 0 and 1 fill 2 blocks of 3; both grow: the later one goes
    trace = [Request(0, (1,) * 4, 6, 0), Request(1, (2,) * 4, 6, 1)]
    run = serve(model, trace, num_blocks=3, preempt=True)
    first = next(s for s in run.steps if s.preempted)
    assert first.preempted == ((1, 4),)  # request 1, its 4 positions discarded
    assert run.tokens[0] == serve(model, trace[:1], num_blocks=3).tokens[0]
    assert run.invariants_hold


def test_broken_preemption_and_forks_are_caught(model):
    check = check_preemption(model, ResumeWithoutRecompute)
    assert not check.requests_equal and check.invariants_hold  # the blocks add up; K/V do not
    forks = check_forks(model, ForkWithoutCopy)
    assert not forks.samples_equal and forks.invariants_hold


def test_forks_share_the_prompt_and_equal_each_sample_alone(model):
    check = check_forks(model, samples=4, prompt_len=10, output_len=6)
    assert check.passed, check
    # 2 full prompt blocks shared; each fork owns a copy of the half-filled third and one more
    assert check.forked.blocks_peak == 2 + 4 * 2 == Request(
        0, (0,) * 10, 6, 0, samples=4, seed=0).blocks_needed(4)
    assert check.copies.blocks_peak == 4 * 4
    assert len(set(map(tuple, check.forked.samples.values()))) > 1  # the samples differ
    prefill_tokens = sum(n for s in check.forked.steps for _, n, k in s.rows if k == "prefill")
    assert prefill_tokens == 10  # the prompt once, not once per sample


def test_forks_of_a_block_aligned_prompt_copy_nothing(model):
    run = serve(model, [Request(0, (3,) * 8, 3, 0, samples=3, seed=1)], num_blocks=16)
    assert run.invariants_hold and run.blocks_peak == 2 + 3 * 1


def test_forks_are_preempted_and_recomputed_alone(model):
    trace = [Request(0, (1,) * 6, 8, 0, samples=3, seed=2), Request(1, (5,) * 5, 8, 0)]
    run = serve(model, trace, num_blocks=10, preempt=True)  # the request alone needs 10
    assert run.preemptions > 0 and run.invariants_hold
    assert all(c.passed for c in compare_trace_with_alone(model, trace, run))


def test_bad_preemption_and_fork_configurations(model):
    with pytest.raises(ValueError, match="request 0 needs 5 blocks, the pool has 4"):
        serve(model, [Request(0, (1,) * 10, 10, 0)], num_blocks=4, preempt=True)
    with pytest.raises(ValueError, match="needs 5 blocks, the pool has 4"):  # 1 + 4 * 1
        serve(model, [Request(0, (1,) * 6, 1, 0, samples=4, seed=0)], num_blocks=4)
    with pytest.raises(ValueError, match="need a seed"):
        serve(model, [Request(0, (1,) * 6, 2, 0, samples=2)], num_blocks=8)
    with pytest.raises(ValueError, match="preemption needs policy='continuous'"):
        Scheduler(model, num_blocks=4, policy="static", preempt=True)


# --- every decoder of the grid: RoPE, a window, Gemma's hybrid layers, MLA's latent -----------

GRID_MODELS = ["llama", "mistral", "mla", "mla-absorbed", "gemma3"]


@pytest.fixture(scope="module")
def grid_models():
    from kvdoc.proofs.grid import MODELS
    return {name: MODELS[name].build(0) for name in GRID_MODELS}


@pytest.mark.parametrize("name", GRID_MODELS)
def test_every_model_served_equals_its_solo_runs(grid_models, name):
    model = grid_models[name]
    checks = check_policies(model)
    assert all(c.passed for c in checks), checks
    assert check_preemption(model).passed
    assert check_forks(model).passed


def test_a_rope_model_served_equals_generate():
    torch.manual_seed(0)
    llama = Decoder(llama_config()).eval()
    run = serve(llama, TRACE, num_blocks=40, token_budget=5)
    for r in TRACE:
        alone = generate(llama, torch.tensor([r.prompt]), r.output_len)[0, len(r.prompt):]
        assert run.tokens[r.rid] == alone.tolist()


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_a_window_layer_reads_only_its_window_in_a_ragged_step(grid_models, name, monkeypatch):
    # the window reaches a ragged step only through the model's mask (Gemma's attention reads
    # it through CausalSelfAttention.visible too): without it, caught
    model = grid_models[name]
    assert all(c.passed for c in check_policies(model))
    monkeypatch.setattr(core_model, "last_keys", lambda mask, window: mask)
    assert not any(c.passed for c in check_policies(model))
