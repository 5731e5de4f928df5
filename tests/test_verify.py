"""The equivalence grid and the verification suite: they pass on the real decoder, and every
check can fail."""

from __future__ import annotations

import math
import re

import pytest
import torch

import kvdoc.core.model
from kvdoc.__main__ import main as cli
from kvdoc.core import cache as kvcache
from kvdoc.core.cache import StaticLayer
from kvdoc.interop.hf_config import transformers_model
from kvdoc.proofs import grid, verify
from kvdoc.proofs.broken.decoders import PositionsRestartDecoder, copy_as, stale_prefix
from kvdoc.proofs.compare import (
    TOLERANCE,
    chunk_lengths,
    default_model,
    default_stream,
    max_abs,
    run_cached,
)
from kvdoc.proofs.suite import CHECKS, SCENARIOS, run_suite
from kvdoc.proofs.sweep import sweep_passes, sweep_variants, variants_table, worker_map
from kvdoc.proofs.traits import traits
from kvdoc.proofs.variants import BUG_CLASSES, VARIANTS
from kvdoc.proofs.verify import run_passes, verify_passes
from kvdoc.teach.crosscheck import match_transformers
from kvdoc.teach.split_calls import split_error

SMALL = dict(batches=(2,), chunks=(1, 2), dtypes=(torch.float32,))
FP32 = dict(dtypes=(torch.float32,))


def equivalence_grid(variant=None, **axes):
    """The equivalence grid of the site's model on the default stream, as the page runs it."""
    ids = default_stream(length=grid.STREAM_LENGTH)
    return run_suite(variant, **{**grid.GRID, "model": default_model(), "ids": ids, **axes})


pytestmark = pytest.mark.usefixtures("one_thread")


# --- the equivalence grid -----------------------------------------------------------------------

def test_real_implementation_passes_the_equivalence_grid():
    report = equivalence_grid()
    assert report.passed, report.failures_table()
    stream = ("logits", "kv", "kv_shape", "causality", "lifecycle")
    assert {r.check for r in report.results} == set(stream)
    combos = {(k, b, c, d) for k in ("dynamic", "static") for b in (1, 2) for c in (1, 2, 5, 13)
              for d in ("FP32", "FP64")}  # 2 caches x 2 batches x 4 chunk sizes x 2 dtypes
    for check in stream:
        found = [(r.kind, r.batch, r.chunk, r.dtype) for r in report.select(check)]
        assert len(found) == len(combos) == 32 and set(found) == combos
    for r in report.select("logits"):
        assert r.error <= TOLERANCE[{"FP32": torch.float32, "FP64": torch.float64}[r.dtype]]
    assert all(r.error == 0.0 for r in report.select("lifecycle"))  # exact by construction


@pytest.mark.parametrize("name", [  # fp32-cache shows in FP64 only: see test_each_axis_is_needed
    n for n, v in VARIANTS.items()
    if v.bug_class in ("mask and positions", "cache storage") and n != "fp32-cache"
    and set(v.needs) <= traits(default_model().config)])  # the site's model hosts it
def test_the_grid_catches_the_mask_and_storage_variants(name):
    report = equivalence_grid(name, **SMALL)
    assert not report.passed, report.failures_table()
    assert report.max_error() > 1e-2  # far above any rounding error


def test_each_grid_check_can_fail_on_its_own_bug():
    cross = equivalence_grid("cross-layer-cache", **SMALL)
    assert cross.failed_checks() == ["logits"]  # the stored K/V are right; only the logits show it
    nbo = equivalence_grid("new-before-old", batches=(2,), chunks=(1,), dtypes=(torch.float32,),
                           kinds=("dynamic",))
    # one key at a time: order is invisible to the logits, not to the K/V check
    assert nbo.failed_checks() == ["kv"]
    nbo_static = equivalence_grid("new-before-old", batches=(1,), chunks=(2,),
                                  dtypes=(torch.float32,), kinds=("static",))
    assert "lifecycle" in nbo_static.failed_checks()  # rows below the write position were rewritten
    for name in ("no-mask", "off-by-one-mask"):
        assert "causality" in equivalence_grid(name, **SMALL).failed_checks()


def test_lifecycle_check_sees_a_mutated_dynamic_cache():
    model = default_model()

    def mutating(idx, cache=None):
        if cache is not None and cache.seq_len:
            cache.layer(0)[0].add_(1.0)  # writes into the cache it was given
        return model(idx, cache)

    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    assert run_cached(mutating, ids, 2, cache=model.new_cache(1)).lifecycle_error >= 1.0


def test_source_experiment_four_cached_two_new():
    model = default_model()
    ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
    assert split_error(model, ids, 4) < TOLERANCE[torch.float32]
    assert split_error(model, ids, 4, "positions-restart") > 1e-1
    assert split_error(model, ids, 4, "top-left-mask") > 1e-2


def test_transformers_cross_check_fp32_and_fp64():
    ids = torch.randint(0, 97, (1, grid.STREAM_LENGTH), generator=torch.Generator().manual_seed(5))
    for dtype, tol in TOLERANCE.items():
        result = match_transformers(transformers_model("gpt2", dtype=dtype), ids, chunks=(5,),
                                    kinds=("static",))
        assert result.n_parameters == (145_280, 145_280)
        assert max(result.full, result.hf_cached, *result.cached.values()) < tol


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        equivalence_grid("no-such-variant")
    with pytest.raises(ValueError, match="sum to 6"):
        chunk_lengths(6, [4, 1])
    with pytest.raises(ValueError, match="positive"):
        chunk_lengths(6, 0)
    with pytest.raises(ValueError, match="rows of ids"):
        equivalence_grid(batches=(3,))
    with pytest.raises(ValueError, match="cached must be"):
        split_error(default_model(), torch.tensor([[1, 2]]), 2)
    with pytest.raises(ValueError, match="non-empty"):
        stale_prefix(torch.tensor([1, 2]), 97)
    for kwargs, match in (({"models": ("nope",)}, "unknown model"),
                          ({"kinds": ("nope",)}, "unknown cache kind"),
                          ({"variant": "nope"}, "unknown variant"),
                          ({"length": 10}, ">= 24 tokens"),
                          ({"dtypes": (torch.float16,)}, "float32 or float64")):
        with pytest.raises(ValueError, match=match):
            run_suite(**kwargs)


def test_errors_are_infinite_on_nan_or_shape_mismatch():
    assert max_abs(torch.tensor([float("nan")]), torch.tensor([0.0])) == math.inf
    assert max_abs(torch.zeros(2), torch.zeros(3)) == math.inf


# --- the suite ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_default_verify_catches_every_variant(name):
    outcome, = sweep_passes(verify_passes(), [name])  # as `python -m kvdoc verify` sweeps it
    assert outcome.caught and outcome.first is not None
    assert outcome.bug_class in BUG_CLASSES
    # caught by a comparison, not by the variant's own code failing to run (say, a stale signature)
    assert not outcome.first.detail.startswith("raised "), outcome.first.detail


def test_each_axis_is_needed():
    """Drop an axis value and a variant escapes. The broken-variants page asserts the rest from
    its sweep (GQA bugs need a GQA model, long-stream bugs a long stream, FP32 bugs FP64, and the
    variants that fail only one kind of check). Not there: a RoPE base ignored passes on a model
    whose base is the default (Mistral's) and fails on one whose base is not (the Llama's); the
    page's only RoPE model is the Llama."""
    assert run_suite("rope-default-base", models=("mistral",), kinds=("dynamic",), **FP32).passed
    assert not run_suite("rope-default-base", models=("llama",), kinds=("dynamic",), **FP32).passed
    # 24 positions fit 32 slots
    assert run_suite("window-32", length=24, models=("mha",), **FP32).passed
    assert not run_suite("window-32", length=40, models=("mha",), **FP32).passed


def test_variants_table_names_every_variant():
    outcomes = sweep_variants(["position-counter", "static-early-length"], models=("mha",), **FP32)
    table = variants_table(outcomes)
    assert table.count("| yes |") == 2 and "`position-counter`" in table


def test_the_default_verify_passes_and_says_what_it_ran(capsys, monkeypatch):
    """`python -m kvdoc verify` on the implementation (its suite, once: the report it prints is
    the one checked here), then on a variant."""
    reports = []
    monkeypatch.setattr(verify, "run_passes",
                        lambda *a, **k: reports.append(run_passes(*a, **k)) or reports[-1])
    assert cli(["verify", "--no-variants"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "VERDICT: PASS"
    report, = reports
    assert report.passed, report.failures_table()
    served = sum(len(grid.served(m.build(0).config, impls=m.impls)) for m in grid.MODELS.values())
    # every served combination in FP32 and FP64; the bf16 scenario adds its BF16 and FP16 runs
    for dtype in ("FP32", "FP64"):
        assert len([c for c in report.combinations if c[3] == dtype]) == served, dtype
    assert {c[3] for c in report.combinations} == {"FP32", "FP64", "BF16", "FP16"}
    assert {r.check for r in report.results} == set(CHECKS)
    assert all(r.passed is not False for r in report.results)
    # each skips kinds, impls or models it cannot take
    not_everywhere = ("generate", "crop", "speculative", "int8", "fp8", "edges", "padded",
                      "bf16", "fp16", "bf16-reference", "fp16-reference", "counted",
                      "invariant", "invariant_bits", "imported", "evicted")
    assert all(r.passed is not None for r in report.results if r.check not in not_everywhere)
    # it says what it ran: every registered model, cache kind, implementation and scenario
    lines = {line.strip().split(":")[0]: line.split(":", 1)[1].strip()
             for line in out.splitlines() if line.startswith("  ") and ":" in line}
    for axis, names in (("models", grid.MODELS), ("cache kinds", grid.CACHES),
                        ("implementations", grid.IMPLEMENTATIONS), ("scenarios", SCENARIOS)):
        assert sorted(lines[axis].split(", ")) == sorted(names), axis
    # every transformers family matched, full and cached
    for family in ("GPT-2", "Llama", "Mistral"):
        assert re.search(rf"\| transformers {family}, same weights "
                         r"\| FP(32|64) \| (\d+) of \2 \|", out), family
    # a variant of one model and cache kind: the verdict's wording is what is checked here
    assert cli(["verify", "--variant", "prefix-late-copy"]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith(
        "VERDICT: FAIL: broken variant 'prefix-late-copy' caught by ")


def test_thorough_grid_runs():
    (axes,) = verify_passes(thorough=True)
    report = run_suite(**axes | dict(models=("mqa",), kinds=("static",), impls=("model",),
                       dtypes=(torch.float64,), scenarios=("stream", "failure")))
    # every batch and chunk size
    runs = len(grid.THOROUGH["batches"]) * len(grid.THOROUGH["chunks"])
    # one seed: 5 stream checks per run, the failure checks in and after the layers
    assert report.passed and len(report.results) == 5 * runs + 2
    # the default run draws seed 0's weights, the thorough one the next seed's
    assert verify_passes()[0]["seeds"] == (0,) and axes["seeds"] == (1,)


@pytest.mark.parametrize("name", sorted(grid.MODELS))
def test_every_implementation_builds_on_what_it_serves(name):
    """``--thorough`` runs every implementation on every model it serves (ModelSpec.impls does
    not narrow it there): each pair the grid says it serves must build and make a cache."""
    model = grid.MODELS[name].build(0)
    pairs = grid.served(model.config, impls=tuple(grid.IMPLEMENTATIONS))
    assert pairs and {impl for _, impl in pairs} <= set(grid.IMPLEMENTATIONS)
    for kind, impl in pairs:
        call = grid.IMPLEMENTATIONS[impl](model)
        cache = grid.CACHES[kind].new(model, 2, 16)
        ids = torch.zeros(2, 3, dtype=torch.long)
        assert call(ids, cache).logits.shape[:2] == (2, 3), (kind, impl)


# --- held-out-like bugs: patch kvdoc's own classes, as an outside test would ---------------------

def _fails(**axes) -> list[str]:
    """The checks that fail; each failure must be a comparison, not the patched code raising."""
    report = run_suite(**{"dtypes": (torch.float32,), "impls": ("model",), **axes})
    assert not report.passed
    raised = [r.detail for r in report.failures if r.detail.startswith("raised ")]
    assert not raised, raised
    return report.failed_checks()


def test_patched_dynamic_cache_window_is_caught(monkeypatch):
    real = kvcache.DynamicCache.update

    def newest_32(self, layer_idx, k, v, start):
        pk, pv = real(self, layer_idx, k, v, start)
        return pk[:, :, -32:], pv[:, :, -32:]  # attends over the newest 32 positions only

    monkeypatch.setattr(kvcache.DynamicCache, "update", newest_32)
    assert "logits" in _fails(models=("mha",), kinds=("dynamic",))


def test_patched_static_layer_modulo_slots_is_caught(monkeypatch):
    def modulo(self, k, v, start):
        end = start + k.shape[2]
        slots = torch.arange(start, end) % 32
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    monkeypatch.setattr(StaticLayer, "write", modulo)
    assert "logits" in _fails(models=("mqa",), kinds=("static",))


def test_patched_static_cache_that_advances_early_is_caught(monkeypatch):
    def update(self, layer_idx, k, v, start):
        kv = self.layers[layer_idx].write(k, v, start)
        self.finish(start + k.shape[2])  # before the later layers ran
        return kv

    monkeypatch.setattr(kvcache.StaticCache, "update", update)
    assert _fails(models=("mha",), kinds=("static",)) == ["failure", "failure_after"]


def test_patched_gqa_sharing_in_both_paths_is_caught(monkeypatch):
    real = kvdoc.core.model.F.scaled_dot_product_attention

    def tiled(q, k, v, attn_mask=None, enable_gqa=False, **kw):
        if k.shape[1] != q.shape[1]:  # share K/V heads by tiling instead of by group
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(kvdoc.core.model.F, "scaled_dot_product_attention", tiled)
    assert _fails(models=("gqa",), kinds=("static",)) == ["reference"]


def test_patched_attention_gqa_in_cached_path_is_caught(monkeypatch):
    real = kvdoc.core.model.CausalSelfAttention.attend

    def attend(self, q, k, v, start, attn_mask=None):
        if start > 0 and k.shape[1] != q.shape[1]:  # a cached call tiles K/V heads (h % H_kv)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        return real(self, q, k, v, start, attn_mask)

    monkeypatch.setattr(kvdoc.core.model.CausalSelfAttention, "attend", attend)
    assert "logits" in _fails(models=("gqa",), kinds=("dynamic",))
    monkeypatch.undo()
    assert run_suite(models=("gqa",), kinds=("dynamic",), impls=("model",), **FP32).passed


def test_patched_last_only_is_caught(monkeypatch):
    """The generate check failing on its own is the ``last-only-first-row`` variant's test above."""
    real = kvdoc.core.model.Decoder.forward
    monkeypatch.setattr(kvdoc.core.model.Decoder, "forward",
                        lambda self, idx, cache=None, *, last_only=False, **kw:
                        real(self, idx, cache, **kw))
    assert "last_only" in _fails(models=("mqa",), kinds=("static",))


def test_a_model_passed_in_is_the_one_verified():
    right = default_model()
    restart = copy_as(right, PositionsRestartDecoder)  # same weights, positions restart at 0
    assert "logits" in _fails(model=restart, kinds=("dynamic",))
    # same weights
    assert run_suite(model=right, kinds=("dynamic",), impls=("model",), **FP32).passed


def test_the_verifier_never_crashes_on_code_that_raises(monkeypatch, capsys):
    def broken_init(self, config=None):
        raise RuntimeError("init exploded")

    monkeypatch.setattr(kvdoc.core.model.Decoder, "__init__", broken_init)
    # the models built on Decoder only: the others (MLA, Gemma, the hybrids) would run their
    # whole suite here and show nothing more (a minute of the test's time)
    monkeypatch.setattr(grid, "MODELS", {n: m for n, m in grid.MODELS.items()
                                         if n in ("mha", "llama")})
    # one process: a patch made here does not reach spawned workers
    assert cli(["verify", "--no-variants", "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "init exploded" in out and out.rstrip().splitlines()[-1].startswith("VERDICT: FAIL")
    assert "| build | llama |" in out  # the suite reported the failure, case by case
    monkeypatch.undo()

    def bad_update(self, layer_idx, k, v, start):
        raise TypeError("expected dtype Half")

    monkeypatch.setattr(kvcache.DynamicCache, "update", bad_update)
    report = run_suite(models=("mha",), kinds=("dynamic",), **FP32)
    assert not report.passed and any("expected dtype Half" in r.detail for r in report.failures)


def test_a_new_implementation_plugs_in_with_one_entry(monkeypatch):
    class Wrapper:
        def __init__(self, model, skip_last_only=False):
            self.model, self.skip = model, skip_last_only

        def __call__(self, idx, cache=None, last_only=False, **padding):
            return self.model(idx, cache, last_only=last_only and not self.skip, **padding)

    monkeypatch.setitem(grid.IMPLEMENTATIONS, "wrapper", Wrapper)
    report = run_suite(impls=("wrapper",), models=("gqa",), kinds=("static",), **FP32)
    # generate() and speculative decoding take the model itself; int8, fp8 and the BF16/FP16
    # bounds run on the dynamic kind, edges' branches on a cache not written in place, counted
    # on caches whose tensors hold exactly their positions; the mode, the import and eviction
    # once per model, on the dynamic kind and the model itself, or on the paged kind
    skipped = {r.check for r in report.results if r.passed is None}
    assert report.passed and skipped == {"generate", "speculative", "int8", "fp8",
                                         "edges", "bf16", "fp16", "bf16-reference",
                                         "fp16-reference", "counted", "invariant",
                                         "imported", "evicted"}
    monkeypatch.setitem(grid.IMPLEMENTATIONS, "wrapper", lambda m: Wrapper(m, skip_last_only=True))
    assert "last_only" in _fails(impls=("wrapper",), models=("gqa",), kinds=("static",))


def test_worker_processes_give_the_same_results_in_the_same_order():
    passes = [dict(models=("mha", "llama"), kinds=("dynamic", "paged"), impls=("model",),
                   scenarios=("stream", "bytes"), dtypes=(torch.float32,), chunks=(3,)),
              dict(models=("gqa",), kinds=("static",), impls=("model",), scenarios=("stream",),
                   dtypes=(torch.float64,), chunks=(3,))]

    def verdicts(report):  # floats may differ in the last bits with the thread count
        return [(r.check, r.model, r.kind, r.impl, r.dtype, r.passed) for r in report.results]

    alone = run_passes(passes)
    with worker_map(2) as map_:
        shared = run_passes(passes, map_=map_)
    assert verdicts(shared) == verdicts(alone) and len(alone.results) > 10
    one_call = [run_suite(**axes) for axes in passes]  # the order one call per pass visits
    assert verdicts(alone) == [v for report in one_call for v in verdicts(report)]
