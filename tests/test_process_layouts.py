"""The decode layouts verify runs across processes reach the branches a configuration picks,
and the broken layouts written for those branches are caught there and nowhere else: a window
under CP, biases under TP, K/V heads replicated over more TP ranks than there are heads."""

from __future__ import annotations

import pytest

from kvdoc.parallel.comparison import MODELS, Job, build_model, run_jobs
from kvdoc.parallel.tensor import head_shard
from kvdoc.proofs.broken.parallel import BROKEN
from kvdoc.proofs.verify import LAYOUTS, NEW, PROMPT, THOROUGH_LAYOUTS, process_layouts

pytestmark = pytest.mark.usefixtures("one_thread")


def _reaches(layouts) -> set[str]:
    """The branches each layout's configuration takes across its ranks."""
    found = set()
    for _, name, tp, cp, *_ in layouts:
        config = MODELS[name]
        if tp > 1 and (config.qkv_bias or config.bias):
            found.add("biases under TP")
        if cp > 1 and config.sliding_window is not None:
            found.add("window under CP")
        shard = head_shard(config, tp, 0)
        if shard.replicas > 1:
            found.add("replication" + (", several K/V heads" if config.n_kv_head > 1 else ""))
    return found


def test_the_default_reaches_biases_and_windows_and_thorough_replication_of_several_heads():
    assert _reaches(LAYOUTS) == {"biases under TP", "window under CP"}
    assert _reaches(LAYOUTS + THOROUGH_LAYOUTS) == {
        "biases under TP", "window under CP", "replication", "replication, several K/V heads"}
    # every broken layout runs on a model whose configuration takes the branch it breaks
    assert {name for name, *_ in process_layouts(thorough=True)} >= set(BROKEN)
    assert "parallel-replica-tiled" not in {n for n, *_ in process_layouts(thorough=False)}


def _job(name: str, model: str, tp: int, cp: int, parts=None) -> Job:
    return Job(name, build_model(model), PROMPT, NEW, tp, cp, *(() if parts is None else (parts,)))


def test_new_broken_layouts_pass_on_the_old_model_and_fail_where_their_branch_runs():
    jobs = []
    for name in ("parallel-cp-no-window", "parallel-bias-first-rows"):
        b = BROKEN[name]
        jobs += [_job(f"{name} on llama", "llama", b.tp, b.cp, b.parts),
                 _job(f"{name} on {b.model}", b.model, b.tp, b.cp, b.parts),
                 _job(f"{b.model} {b.tp}x{b.cp}", b.model, b.tp, b.cp)]
    # replication of one K/V head (MQA over 2 ranks): tiling and grouping agree
    tiled = BROKEN["parallel-replica-tiled"].parts
    jobs.append(_job("parallel-replica-tiled on mqa", "mqa", 2, 1, tiled))
    ok = {c.name: c.ok for c in run_jobs(jobs)}
    assert ok == {"parallel-cp-no-window on llama": True, "parallel-cp-no-window on mistral": False,
                  "mistral 1x2": True, "parallel-bias-first-rows on llama": True,
                  "parallel-bias-first-rows on qwen2": False, "qwen2 2x1": True,
                  "parallel-replica-tiled on mqa": True}


def test_replication_of_two_heads_over_four_ranks_equals_one_process_and_catches_tiling():
    b = BROKEN["parallel-replica-tiled"]
    done = {c.name: c for c in run_jobs([_job("llama 4x1", "llama", 4, 1),
                                         _job("tiled", b.model, b.tp, b.cp, b.parts)])}
    assert done["llama 4x1"].ok, done["llama 4x1"].lines()
    assert [h for h, _ in done["llama 4x1"].held] == [(0,), (0,), (1,), (1,)]
    assert not done["tiled"].ok and not done["tiled"].kv_close
