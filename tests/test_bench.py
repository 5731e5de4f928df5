"""kvdoc.measure.bench_run (with costs, timing, decode_paths, bench, and
the bench command) on tiny settings.

No speed is asserted.
"""

import json
import math
import re

import pytest
import torch

from kvdoc import Decoder, GPTConfig
from kvdoc.__main__ import main as cli
from kvdoc.core.fast import FastDecoder
from kvdoc.measure.bench import (
    ABLATION_LABELS,
    ablation_table,
    compiled_table,
    counts_table,
    flops_table,
    growth_figure,
    roofline_table,
    timings_figure,
    timings_table,
)
from kvdoc.measure.bench_run import TARGETS, VARIANTS, BenchSettings, run_bench
from kvdoc.measure.costs import (
    RowCounter,
    projected_positions_full,
    run_flops,
    step_bytes,
    step_flops,
)
from kvdoc.measure.decode_paths import (
    ABLATION,
    LeanStep,
    UncheckedFast,
    UnguardedFast,
    UnwatchedFast,
)
from kvdoc.measure.dispatch import count_ops
from kvdoc.measure.timing import percentile, time_paths

TINY_ROOF = GPTConfig(vocab_size=101, n_positions=64, n_layer=2, n_head=2, n_embd=32, n_inner=64)
PREFIXES = (3, 8)
G = 4


def tiny(**kw) -> BenchSettings:
    base = dict(prefix_lens=PREFIXES, new_tokens=G, samples=3, warmup=1, growth_lengths=(4, 8, 16),
                growth_samples=2, roofline_model=TINY_ROOF, roofline_context=8, roofline_steps=2,
                roofline_samples=2, bandwidth_mib=8)
    base.update(kw)
    return BenchSettings(**base)


@pytest.fixture(scope="module")
def result():
    return run_bench(tiny())


def test_ratios_present_and_positive(result):
    for key in ("cached_vs_transformers", "cached_vs_full_all_positions", "bandwidth_fraction",
                "bandwidth_fraction_transformers", "cached_vs_full_last_position", *TARGETS):
        value = result.ratios[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, key


@pytest.mark.parametrize("kw", [{}, *ABLATION.values()], ids=["lean", *ABLATION])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_lean_step_and_its_variants_compute_the_models_function(kw, n_kv_head):
    torch.manual_seed(0)
    model = Decoder(GPTConfig(n_kv_head=n_kv_head)).eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    lean = LeanStep(model, capacity=9, **kw)
    with torch.inference_mode():
        lean.start(model(ids[:, :5], model.new_cache(2, "static", capacity=5)).cache)
        logits = torch.cat([lean(ids[:, j:j + 1]) for j in range(5, 9)], 1)
        torch.testing.assert_close(logits, model(ids).logits[:, 5:], atol=1e-5, rtol=0)


def test_lean_step_refuses_other_architectures():
    from kvdoc.core.model import llama_config

    with pytest.raises(ValueError, match="GPT-2's architecture"):
        LeanStep(Decoder(llama_config()), capacity=4)


def test_ratios_follow_from_samples(result):
    P = max(PREFIXES)
    best = min(result.p50(P, "dynamic"), result.p50(P, "static"))
    ratios = result.ratios
    assert ratios["cached_vs_full_all_positions"] == pytest.approx(result.p50(P, "full_all") / best)
    assert ratios["cached_vs_transformers"] == pytest.approx(result.p50(P, "transformers") / best)
    fast = result.p50(P, "fast")
    assert ratios["fast_vs_transformers"] == pytest.approx(result.p50(P, "transformers") / fast)
    assert ratios["fast_vs_full_all_positions"] == pytest.approx(result.p50(P, "full_all") / fast)
    per_token = result.roofline["p50_ms_per_token"]
    assert ratios["fast_vs_transformers_124m"] == pytest.approx(
        per_token["transformers"] / per_token["fast"])
    assert result.ratios["bandwidth_fraction_fast"] == result.roofline["fraction"]["fast"]
    assert result.ratios["fast_vs_lean"] == pytest.approx(result.p50(P, "lean") / fast)


def test_raw_samples_and_summary(result):
    data = json.loads(json.dumps(result.to_json()))  # JSON round trip: plain types only
    assert set(data) >= {"ratios", "config", "environment", "timestamp", "samples_ms", "summary",
                         "counts", "flops", "growth", "roofline", "final_kv_kib",
                         "max_abs_logit_diff", "aten_ops_per_step", "ablation", "targets"}
    for key, target in TARGETS.items():
        verdict = data["targets"][key]
        assert verdict["target"] == target and verdict["met"] == (verdict["measured"] >= target)
    assert set(data["environment"]) >= {"cpu", "python", "torch", "transformers", "threads"}
    assert data["environment"]["threads"] == 1
    assert data["config"]["samples"] == 3 and data["config"]["prefix_lens"] == list(PREFIXES)
    for P in PREFIXES:
        samples = data["samples_ms"][str(P)]
        assert set(samples) == {"prefill", "full_all", "full_last", "dynamic", "static", "fast",
                                "lean", "compiled", "transformers"}
        for path, values in samples.items():
            assert len(values) == 3 and all(v > 0 for v in values), path
            s = data["summary"][str(P)][path]
            assert min(values) <= s["p50_ms"] <= s["p95_ms"] <= max(values)


def test_thread_count_restored():
    before = torch.get_num_threads()
    run_bench(tiny(prefix_lens=(2,), samples=1, warmup=0, transformers=False, roofline=False,
                   growth_lengths=(4, 8), growth_samples=1, threads=1, ablation=False))
    assert torch.get_num_threads() == before


def test_every_path_computes_the_same_logits(result):
    for P in PREFIXES:
        for path, diff in result.max_abs_diff[P].items():
            assert diff < 1e-4, (P, path, diff)


def test_counted_rows_match_closed_forms(result):
    for P in PREFIXES:
        c = result.counts[P]
        full = G * P + G * (G + 1) // 2
        assert c["formula_full"] == full == projected_positions_full(P, G)
        assert c["full_all_c_attn"] == c["full_last_c_attn"] == c["full_all_lm_head"] == full
        assert c["full_last_lm_head"] == G
        for kind in ("dynamic", "static"):
            assert c[f"{kind}_c_attn"] == c[f"{kind}_lm_head"] == G


def test_ops_per_step(result):
    ops = result.ops
    assert set(ops) == {"full_all", "dynamic", "static", "fast", "lean", "transformers"}
    assert all(isinstance(n, int) and n > 0 for n in ops.values())
    assert count_ops(lambda: torch.ones(3).sum() * 2) == {
        "aten.ones.default": 1, "aten.sum.default": 1, "aten.mul.Tensor": 1}


def test_issue_example_count():
    assert projected_positions_full(256, 16) == 4232


def test_row_counter_counts_batch_rows_and_detaches():
    torch.manual_seed(0)
    model = Decoder(GPTConfig()).eval()
    ids = torch.randint(0, 97, (2, 5))
    with RowCounter(model) as rows:
        model(ids, last_only=True)
    assert rows.counts == {"c_attn": 10, "lm_head": 2}
    model(ids)
    assert rows.counts == {"c_attn": 10, "lm_head": 2}  # hooks removed on exit


def test_kv_kib_matches_formula(result):
    cfg = GPTConfig()
    for P in PREFIXES:
        T = P + G
        assert result.kv_kib[P] == 2 * cfg.n_layer * T * cfg.kv_dim * 4 / 1024


def test_flop_model_scaling():
    cfg = GPTConfig()
    one, two = step_flops(cfg, 0, 100), step_flops(cfg, 0, 200)
    assert two["linear"] == 2 * one["linear"]  # ~ T d^2
    assert two["attention"] == 4 * one["attention"]  # ~ T^2 d
    c1, c2 = step_flops(cfg, 99, 1), step_flops(cfg, 199, 1)
    assert c1["linear"] == c2["linear"]  # ~ d^2, independent of T
    assert c2["attention"] == 2 * c1["attention"]  # ~ T d
    f = run_flops(cfg, 10, 3)
    assert f["cached"] < f["full_last"] < f["full_all"]
    assert f["full_all"] == pytest.approx(
        sum(step_flops(cfg, 0, 10 + j)["total"] for j in (1, 2, 3)))


def test_step_bytes_tied_and_untied():
    cfg = TINY_ROOF
    torch.manual_seed(0)
    model = Decoder(cfg)
    untied = step_bytes(model, 9)
    model.lm_head.weight = model.wte.weight
    assert step_bytes(model, 9) == untied  # the head matrix is read either way
    kv = 2 * cfg.n_layer * 10 * cfg.kv_dim * 4
    weights = sum(p.numel() for n, p in Decoder(cfg).named_parameters()
                  if n not in ("wte.weight", "wpe.weight"))
    assert untied == (weights + 2 * cfg.n_embd) * 4 + kv


def test_roofline_structure(result):
    r = result.roofline
    assert r["floor_ms_per_token"] > 0 and r["bandwidth"]["gb_per_s"] > 0
    assert set(r["fraction"]) == {"dynamic", "static", "fast", "lean", "compiled", "transformers"}
    assert result.ratios["bandwidth_fraction"] == max(r["fraction"]["dynamic"],
                                                      r["fraction"]["static"])


def test_growth_structure(result):
    g = result.growth
    assert g["lengths"] == [4, 8, 16]
    for path in ("full_all", "dynamic", "static", "fast"):
        assert len(g["p50_ms"][path]) == 3 and math.isfinite(g["slopes"][path])


def test_tables_and_figures(result):
    paths = 1 + 9   # header rule; prefill and the eight decode paths
    for stat in ("p50", "p95"):
        table = timings_table(result, stat)
        assert table.count("\n") == paths and "fast step" in table and f"({stat})" in table
        assert all(f"P = {P} (ms)" in table for P in PREFIXES)
    with pytest.raises(ValueError, match="p50"):
        timings_table(result, "mean")
    counts = counts_table(result)
    assert counts.count("\n") == 1 + 3 * len(PREFIXES) and "MFLOP" in flops_table(result)
    roof = roofline_table(result)
    assert "GB/s" in roof and roof.count("\n") == 1 + 6  # header rule and six decode paths
    for ablation in (result.ablation, result.roofline["ablation"]):
        table, _, note = ablation_table(ablation).partition("\n\n")
        assert "µs" in table and (not note or note.startswith("Not resolved"))
        # each step a row of the table or named in the note, once
        assert len(ablation["p50_us_per_step"]) == 3 + len(VARIANTS)
        named = [name for name in ablation["p50_us_per_step"]
                 if ABLATION_LABELS[name] in note.replace("\n", " ")]
        assert table.count("\n") - 1 + len(named) == len(ablation["p50_us_per_step"])
        assert all((table + note.replace("\n", " ")).count(ABLATION_LABELS[name]) == 1
                   for name in ablation["p50_us_per_step"])
    import matplotlib.pyplot as plt

    for fig in (growth_figure(result), timings_figure(result)):
        assert fig.axes[0].get_xlabel() and fig.axes[0].get_ylabel()
        plt.close(fig)


def test_time_paths_rotates_order():
    order = []
    paths = {name: (lambda n=name: (lambda: order.append(n))) for name in "abc"}
    time_paths(paths, samples=3, warmup=0)
    assert order == list("abc") + list("bca") + list("cab")


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)


def test_ablation_structure(result):
    a = result.ablation
    assert a["prefix_len"] == max(PREFIXES) and a["steps"] == G
    assert set(a["p50_us_per_step"]) == {"reference", "fast", "lean", *VARIANTS}
    assert a["p50_us_per_step"]["reference"] == (
        percentile(a["samples_ms"]["reference"], 50) / G * 1e3)
    # the rows were timed in the prefix's own rotation: reference and fast are its samples
    P = max(PREFIXES)
    assert a["samples_ms"]["reference"] == result.timings[P]["static"]
    assert a["samples_ms"]["fast"] == result.timings[P]["fast"]
    assert not set(VARIANTS) & set(result.timings[P])
    assert not set(VARIANTS) & set(result.max_abs_diff[P])
    for name, diff in a["max_abs_logit_diff"].items():  # every variant computes the same function
        assert diff < 1e-4, (name, diff)
    roofline = result.roofline
    assert set(roofline["ablation"]["p50_us_per_step"]) == {"reference", "fast", "lean", *VARIANTS}
    assert set(roofline["samples_ms"]) == {"dynamic", "static", "fast", "lean", "compiled",
                                           "transformers"}


@pytest.mark.parametrize("kw, message", [
    (dict(samples=0), "samples must be a positive integer, got 0"),
    (dict(prefix_lens=(510,)), "prefix length 510 + 16 new tokens does not fit 1 .. 512 positions"),
    (dict(prefix_lens=()), "prefix_lens is empty"),
    (dict(growth_lengths=(1,)), "growth length 1 must lie in 2 .. 512"),
    (dict(warmup=-1), "warmup must be a non-negative integer, got -1"),
])
def test_bad_settings_raise(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BenchSettings(**kw)


def test_cli_writes_json_and_prints_ratios(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc = cli(["bench", "--json", str(path), "--prefix-lens", "2,4", "--new-tokens", "2",
              "--samples", "1", "--warmup", "0", "--growth-lengths", "4,8", "--no-roofline",
              "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "fast_vs_transformers" in out and "cached_vs_full_all_positions" in out
    assert "target >= 4.5" in out
    assert "compiled / lean" in out and "compiled_vs_lean" in out
    data = json.loads(path.read_text())
    assert data["config"]["prefix_lens"] == [2, 4] and data["ratios"]["cached_vs_transformers"] > 0


def test_cli_rejects_bad_settings(capsys):
    assert cli(["bench", "--samples", "0", "--no-progress"]) == 2
    assert "samples" in capsys.readouterr().err


def test_the_guarantee_variants_take_one_guarantee_away_each():
    model = Decoder(GPTConfig()).eval()
    _, cache = model(torch.tensor([[1, 2, 3]]), model.new_cache(1, "static", capacity=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        UnwatchedFast(model)(torch.tensor([[97]]), cache)  # it still checks its input
    unchecked = UncheckedFast(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    before = unchecked(torch.tensor([[4]]), cache).logits
    cache.crop(3)
    assert torch.allclose(before, model(torch.tensor([[4]]), cache).logits, atol=1e-5)  # watched
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    cache.crop(3)
    stale = UnwatchedFast(model)  # its copies are taken now; the next edit goes unseen
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert not torch.allclose(stale(torch.tensor([[4]]), cache).logits,
                              model(torch.tensor([[4]]), cache.crop(3)).logits)


def test_the_unguarded_fast_step_neither_checks_nor_watches():
    model = Decoder(GPTConfig()).eval()
    _, cache = model(torch.tensor([[1, 2, 3]]), model.new_cache(1, "static", capacity=8))
    short = torch.tensor([[4]], dtype=torch.int16)
    with pytest.raises(ValueError, match="int64 or int32"):
        FastDecoder(model)(short, cache)
    unguarded = UnguardedFast(model)
    with pytest.raises(RuntimeError, match="ShortTensor"):  # torch's error, not the check's
        unguarded(short, cache)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert not torch.allclose(unguarded(torch.tensor([[4]]), cache).logits,
                              model(torch.tensor([[4]]), cache.crop(3)).logits)


def test_compiled_step_rows(result):
    # one row per rotation: every prefix length and the roofline model, each compiled untimed
    assert set(result.compiled) == {*map(str, PREFIXES), "roofline"}
    for where, info in result.compiled.items():
        assert set(info) == {"first_run_s", "graphs"}, where
        assert info["first_run_s"] > 0 and isinstance(info["graphs"], int) and info["graphs"] >= 0
    assert result.compiled[str(PREFIXES[0])]["graphs"] >= 1  # the first call compiles
    P = max(PREFIXES)
    assert len(result.timings[P]["compiled"]) == 3  # samples only: the compiling run is apart
    assert result.ratios["compiled_vs_lean"] == pytest.approx(
        result.p50(P, "lean") / result.p50(P, "compiled"))
    assert result.ratios["compiled_vs_fast"] == pytest.approx(
        result.p50(P, "fast") / result.p50(P, "compiled"))
    per_token = result.roofline["p50_ms_per_token"]
    assert result.ratios["compiled_vs_lean_124m"] == pytest.approx(
        per_token["lean"] / per_token["compiled"])
    table = compiled_table(result)
    assert table.count("\n") == 1 + len(PREFIXES) + 1 and "compiled / lean" in table
    assert "roofline model" in table and "failed" not in table
    assert json.loads(json.dumps(result.to_json()))["compiled"] == result.compiled


def test_a_compiler_failure_is_the_rows_answer(monkeypatch):
    def refusing(model, **kw):
        def call(*args, **kwargs):
            raise RuntimeError("no C compiler here\nsecond line")
        return call

    monkeypatch.setattr(torch, "compile", refusing)
    r = run_bench(tiny(prefix_lens=(4,), samples=1, warmup=0, transformers=False,
                       growth_lengths=(4, 8), growth_samples=1, roofline=False, ablation=False))
    assert r.compiled == {"4": {"error": "RuntimeError: no C compiler here"}}
    assert "compiled" not in r.timings[4] and "compiled_vs_lean" not in r.ratios
    assert "torch.compile failed: RuntimeError: no C compiler here" in compiled_table(r)
    quiet = run_bench(tiny(prefix_lens=(4,), samples=1, warmup=0, transformers=False,
                           growth_lengths=(4, 8), growth_samples=1, roofline=False,
                           ablation=False, compiled=False))
    assert quiet.compiled is None
    with pytest.raises(ValueError, match="no compiled step"):
        compiled_table(quiet)


def test_the_compiled_forward_keeps_the_models_guarantees():
    # what FastDecoder guarantees, asked of torch.compile(model): fresh weights, and the
    # model's own error before any write
    torch.manual_seed(0)
    model = Decoder(GPTConfig()).eval()
    step = torch.compile(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.inference_mode():
        cache = model(ids[:, :8], model.new_cache(1, "static", capacity=12))[1]
        for j in range(8, 10):  # the first length, then a symbolic one
            assert torch.allclose(step(ids[:, j:j + 1], cache)[0],
                                  model(ids[:, :j + 1]).logits[:, -1:], atol=1e-5)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    with torch.inference_mode():
        cache.crop(9)
        want = model(ids[:, :10]).logits[:, -1:]
        assert torch.allclose(step(ids[:, 9:10], cache)[0], want, atol=1e-5)
        with pytest.raises(ValueError, match="static cache over capacity"):
            step(ids[:, :3].repeat(1, 4), cache)  # 12 more positions past a capacity of 12
        assert cache.seq_len == 10
