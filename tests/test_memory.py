from __future__ import annotations

import ast
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdoc import Decoder, GPTConfig, generate
from kvdoc.__main__ import main as cli
from kvdoc.core.feed import feed
from kvdoc.measure.dispatch import CopyMeter
from kvdoc.measure.kv_bytes import (
    DTYPES as DTYPE_NAMES,
)
from kvdoc.measure.kv_bytes import (
    binary_size,
    decimal_size,
    dtype_name,
    element_size,
    kv_bytes,
    kv_bytes_for_config,
    kv_bytes_per_layer,
    measured_bytes,
)
from kvdoc.measure.model_caches import MODELS, model_cache, read_config

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def random_configs(n: int, seed: int) -> list[GPTConfig]:
    rng = random.Random(seed)
    configs = []
    for _ in range(n):
        kv = rng.choice([1, 2, 3])
        heads = kv * rng.choice([1, 2, 4])  # MHA, GQA and MQA all occur
        configs.append(GPTConfig(vocab_size=11, n_positions=64, n_layer=rng.randint(1, 3),
                                 n_head=heads, n_embd=heads * rng.choice([2, 4, 8]), n_inner=16,
                                 n_kv_head=kv))
    return configs


def brute_force_bytes(B: int, L: int, T: int, H: int, D: int, dtype: torch.dtype) -> int:
    """Allocate the tensors a cache would hold and count their bytes."""
    return sum(torch.empty(B, H, T, D, dtype=dtype).nbytes for _ in range(2 * L))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_formula_equals_measured_cache_random_configs(dtype: torch.dtype, kind: str) -> None:
    rng = random.Random(10 * DTYPES.index(dtype) + ["dynamic", "static"].index(kind))
    for config in random_configs(4, seed=rng.randint(0, 10**6)):
        torch.manual_seed(0)
        model = Decoder(config).to(dtype)
        B, T = rng.randint(1, 3), rng.randint(1, 9)
        ids = torch.randint(0, config.vocab_size, (B, T))
        _, cache = model(ids, model.new_cache(B, kind, capacity=T))
        assert cache.layer(0)[0].shape == (B, config.n_kv_head, T, config.head_dim)
        expected = kv_bytes_for_config(config, B, T, dtype)
        assert measured_bytes(cache) == expected == cache.nbytes()
        assert expected == (2 * B * config.n_layer * T * config.n_kv_head * config.head_dim
                            * dtype.itemsize)
        if config.n_kv_head != config.n_head:  # GQA/MQA: the query head count would overstate it
            wrong = kv_bytes(B, config.n_layer, T, config.n_head, config.head_dim, dtype)
            assert wrong > measured_bytes(cache)


def test_formula_against_allocated_tensors() -> None:
    rng = random.Random(7)
    for _ in range(20):
        B, L, T, H, D = (rng.randint(1, 4) for _ in range(5))
        dtype = rng.choice(DTYPES + [torch.float8_e4m3fn, torch.int8])
        assert kv_bytes(B, L, T, H, D, dtype) == brute_force_bytes(B, L, T, H, D, dtype)


def test_linear_in_each_size() -> None:
    base = dict(batch=2, layers=3, seq_len=5, kv_heads=2, head_dim=8, dtype="bf16")
    b0 = kv_bytes(**base)
    for name in ("batch", "layers", "seq_len", "kv_heads", "head_dim"):
        assert kv_bytes(**{**base, name: base[name] * 2}) == 2 * b0


def test_the_512_mib_example() -> None:
    n = kv_bytes(1, 32, 4096, 8, 128, "float16")
    assert n == 512 * 2**20
    assert binary_size(n) == "512 MiB"
    assert decimal_size(n) == f"{n / 1e6:.3f} MB"


def test_sliding_window_caps_each_layer() -> None:
    full = kv_bytes(1, 4, 100, 2, 8, "float32")
    assert kv_bytes(1, 4, 100, 2, 8, "float32", window=200) == full
    assert kv_bytes(1, 4, 100, 2, 8, "float32", window=25) == full // 4
    per_layer = kv_bytes_per_layer(1, 100, 2, 8, "float32", [None, 10, None, 50])
    assert per_layer[1] * 10 == per_layer[0] and per_layer[3] * 2 == per_layer[2]


def test_units() -> None:
    assert binary_size(1023) == "1,023 bytes" and decimal_size(999) == "999 bytes"
    assert binary_size(1024) == "1 KiB" and decimal_size(1000) == "1 kB"
    assert binary_size(3 * 2**30 // 2) == "1.5 GiB"
    assert decimal_size(2 * 10**9) == "2 GB"


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="layers"):
        kv_bytes(1, 0, 4, 1, 1, "float32")
    with pytest.raises(ValueError, match="batch"):
        kv_bytes(-1, 1, 4, 1, 1, "float32")
    with pytest.raises(ValueError, match="seq_len"):
        kv_bytes(1, 1, -4, 1, 1, "float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        element_size("float13")
    with pytest.raises(ValueError, match="unknown model"):
        model_cache("gpt-5")
    with pytest.raises(ValueError, match="not divisible"):
        dataclasses.replace(model_cache("llama-3-8b"), heads=12)


def test_presets_are_consistent() -> None:
    for p in MODELS.values():
        assert p.heads is None or p.heads % p.kv_heads == 0
        assert p.source and p.kv_bytes(1000, windows=False) == (1000 * p.bytes_per_token()
                                                                + p.fixed_bytes())
    assert model_cache("falcon-7b").attention == "MQA"
    assert model_cache("llama-2-7b").attention == "MHA"


def test_copy_meter_dynamic_copies_old_rows_static_none(model: Decoder) -> None:
    prompt, new = 5, 6
    ids = torch.randint(0, model.config.vocab_size, (2, prompt + new),
                        generator=torch.Generator().manual_seed(3))
    copied = {}
    for kind in ("dynamic", "static"):
        meter = CopyMeter()
        cache = meter.watch(model.new_cache(2, kind, capacity=prompt + new))
        cache = feed(model, ids, cache, [prompt] + [1] * new).cache  # prompt, then steps
        assert cache.seq_len == prompt + new
        assert len(meter.records) == model.config.n_layer * (1 + new)
        copied[kind] = meter.old_bytes_copied()
        for P, written, old in meter.per_step():
            assert written - old == kv_bytes_for_config(model.config, 2, 1 if P else prompt)
    per_token = kv_bytes_for_config(model.config, 2, 1)
    assert copied["static"] == 0
    assert copied["dynamic"] == per_token * sum(range(prompt, prompt + new))


def test_copy_meter_leaves_results_unchanged(model: Decoder) -> None:
    prompt = torch.tensor([[1, 2, 3]])
    plain = generate(model, prompt, 4)
    meter = CopyMeter()
    cache = meter.watch(model.new_cache(1))
    logits, cache = model(prompt, cache, last_only=True)
    out = [prompt]
    for _ in range(4):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        logits, cache = model(token, cache)
    assert torch.equal(torch.cat(out, 1), plain)


def test_cli_512_mib(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["memory", "--batch", "1", "--layers", "32", "--seq-len", "4096", "--kv-heads", "8",
              "--head-dim", "128", "--dtype", "float16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "536,870,912 bytes" in out and "512 MiB" in out and "536.871 MB" in out


def test_cli_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["memory", "--model", "Llama-3-8B", "--seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert f"{kv_bytes(1, 32, 8192, 8, 128, 'float16'):,} bytes" in out and "Llama-3-8B" in out


@pytest.mark.parametrize("argv", [
    ["--model", "nope", "--seq-len", "8"],
    ["--layers", "2", "--seq-len", "8", "--kv-heads", "1", "--head-dim", "4", "--dtype", "float13"],
    ["--layers", "0", "--seq-len", "8", "--kv-heads", "1", "--head-dim", "4"],
    ["--layers", "2", "--seq-len", "-8", "--kv-heads", "1", "--head-dim", "4"],
    ["--layers", "2", "--seq-len", "8"],
    ["--model", "falcon-7b", "--seq-len", "8", "--layers", "3"],
    ["--layers", "2", "--kv-heads", "1", "--head-dim", "4"],  # no --seq-len, no model to take it
    ["--model", "falcon-7b", "--seq-len", str(10**20)],
    ["--model", "falcon-7b", "--seq-len", str(2**31)],
    ["--model", "mistral-7b-v0.1", "--window", str(10**20)],
])
def test_cli_bad_input_exits_2_quietly(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = cli(["memory", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "" and "error" in captured.err


def test_element_bytes_are_torchs() -> None:
    # the table the command line uses without importing torch, against torch itself
    for name, canonical in DTYPE_NAMES.items():
        dtype = getattr(torch, canonical)
        assert element_size(name) == torch.empty((), dtype=dtype).element_size(), name
        assert element_size(dtype) == element_size(name) and dtype_name(dtype) == canonical


def test_cli_model_alone_takes_its_context(capsys: pytest.CaptureFixture[str]) -> None:
    llama = model_cache("Llama-3-8B")
    assert cli(["memory", "--model", "Llama-3-8B"]) == 0
    captured = capsys.readouterr()
    assert f"{llama.kv_bytes(llama.max_positions):,} bytes" in captured.out
    assert f"T = {llama.max_positions:,}, the model's context" in captured.out
    assert captured.err == ""


def test_cli_past_the_context_warns(capsys: pytest.CaptureFixture[str]) -> None:
    llama = model_cache("Llama-3-8B")
    T = 4 * llama.max_positions
    assert cli(["memory", "--model", "Llama-3-8B", "--seq-len", str(T)]) == 0
    captured = capsys.readouterr()
    assert f"{llama.kv_bytes(T):,} bytes" in captured.out  # computed for the stretched model
    assert "warning" in captured.err
    assert f"context of {llama.max_positions:,} tokens" in captured.err
    assert cli(["memory", "--model", "Llama-3-8B", "--seq-len", str(llama.max_positions)]) == 0
    assert capsys.readouterr().err == ""  # the context itself is no warning


def test_cli_as_module() -> None:
    run = subprocess.run([sys.executable, "-m", "kvdoc", "memory", "--model", "nope",
                          "--seq-len", "1"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == "" and "unknown model" in run.stderr


def test_cli_window(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["memory", "--model", "Mistral-7B-v0.1", "--seq-len", "32768"]) == 0
    out = capsys.readouterr().out
    mistral = model_cache("mistral-7b-v0.1")
    capped = mistral.kv_bytes(32768)
    assert capped == mistral.kv_bytes(4096, windows=False)
    assert f"bytes      {capped:,} bytes" in out
    assert f"all full   {mistral.kv_bytes(32768, windows=False):,} bytes" in out
    assert "(one more position inside every window, per sequence)" in out
    assert cli(["memory", "--model", "Llama-3-8B"]) == 0  # no window: neither line speaks of one
    out = capsys.readouterr().out
    assert "(one more position, per sequence)" in out and "window" not in out
    assert cli(["memory", "--layers", "2", "--seq-len", "100", "--kv-heads", "1", "--head-dim", "4",
                "--dtype", "float32", "--window", "10"]) == 0
    out = capsys.readouterr().out  # typed sizes: the same lines as a model's
    assert f"all full   {kv_bytes(1, 2, 100, 1, 4, 'float32'):,} bytes" in out
    assert f"bytes      {kv_bytes(1, 2, 10, 1, 4, 'float32'):,} bytes" in out


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
@pytest.mark.parametrize("config", random_configs(4, seed=7),
                         ids=lambda c: f"L{c.n_layer}H{c.n_kv_head}")
def test_fp8_scale_bytes_count_a_real_fp8_cache(config: GPTConfig, granularity: str) -> None:
    # the torch-free count against the scale tensors a filled FP8 cache really holds
    from kvdoc.measure.kv_bytes import fp8_scale_bytes
    from kvdoc.measure.model_caches import config_cache
    from kvdoc.serving.fp8 import GRANULARITIES, new_fp8_cache

    assert GRANULARITIES == ("per-tensor", "per-head")
    model = Decoder(config).eval()
    with torch.no_grad():
        empty = new_fp8_cache(model, 2, granularity=granularity)
        _, cache = model(torch.randint(0, 11, (2, 5)), empty)
    held = sum(s.numel() * s.element_size() for layer in cache.layers for s in layer.scales)
    assert config_cache(config).fp8_scale_bytes(granularity) == held
    assert fp8_scale_bytes([config.n_kv_head] * config.n_layer, granularity) == held
    assert cache.nbytes() == kv_bytes_for_config(config, 2, 5, "float8_e4m3fn") + held


def test_cli_fp8_scales(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["memory", "--layers", "32", "--seq-len", "4096", "--kv-heads", "8", "--head-dim",
            "128", "--dtype", "fp8"]
    assert cli([*argv, "--fp8-scales", "per-head"]) == 0
    per_head = capsys.readouterr().out
    assert cli([*argv, "--fp8-scales", "per-tensor"]) == 0
    per_tensor = capsys.readouterr().out
    assert "2,048 bytes of FP32 scales" in per_head and "256 bytes of FP32" in per_tensor
    payload = kv_bytes(1, 32, 4096, 8, 128, "float8_e4m3fn")
    assert f"{payload + 32 * 2 * 8 * 4:,} bytes" in per_head
    assert cli(["memory", "--model", "Llama-3-8B", "--dtype", "fp8", "--fp8-scales",
                "per-head"]) == 0
    assert "2,048 bytes of FP32 scales" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--model", "Llama-3-8B", "--fp8-scales", "per-head"],  # float16 keeps no scales
    ["--model", "DeepSeek-V3", "--dtype", "fp8", "--fp8-scales", "per-head"],  # a latent
    ["--model", "Llama-3-8B", "--dtype", "fp8", "--fp8-scales", "per-row"],
])
def test_cli_fp8_scales_refuses(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = cli(["memory", *argv])
    except SystemExit as exc:
        rc = exc.code
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "" and "--fp8-scales" in captured.err


def _printed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert cli(["memory", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def _arithmetic(text: str) -> int:
    """The value of a numbers line: integers, ``+``, ``x`` and parentheses, nothing else."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"not a sum of products: {text!r}")
    return value(ast.parse(text.replace(" x ", " * "), mode="eval").body)


@pytest.mark.parametrize("name", [m.name for m in MODELS.values()])
def test_cli_formula_line_multiplies_out_to_the_bytes(name: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # every factor is printed: the product of the numbers line, redone here, is the bytes line
    for T, B, dtype in ((1, 1, "float16"), (1000, 3, "float8_e4m3fn"), (200000, 2, "float32")):
        lines = _printed(["--model", name, "--seq-len", str(T), "--batch", str(B), "--dtype",
                          dtype], capsys)
        numbers = next(line for line in lines if line.startswith("           = "))
        total = _arithmetic(numbers[13:].replace(",", "").replace(f" ({dtype})", ""))
        assert f"bytes      {total:,} bytes" in lines
        assert total == model_cache(name).kv_bytes(T, B, dtype)
        values = [line[11:] for line in lines if line[11:].strip()]
        assert len(values) == len(set(values)) or B > 1  # at batch 1 no line repeats
        assert any(line.startswith("sequence ") for line in lines) == (B > 1)


def test_cli_head_counts_and_past_window_rate(capsys: pytest.CaptureFixture[str]) -> None:
    gemma = model_cache("Gemma-3-27B")
    lines = _printed(["--model", "Gemma-3-27B", "--dtype", "bfloat16"], capsys)
    assert "layers     52 x attention: 4,096 elements a position (2 x H_kv x D = 2 x 16 x 128), " \
        "the last 1,024 positions" in lines
    past = gemma.bytes_per_token("bfloat16", past_windows=True)
    assert past == 10 * 2 * 16 * 128 * 2  # only the 10 full layers grow past W
    assert any(line.startswith(f"past W     {past:,} bytes") and "T > 1,024" in line
               and "only the 10 full layers" in line for line in lines)
    T = gemma.max_positions
    # the two rates explain the total: 1,024 positions at the first, the rest at the second
    assert gemma.kv_bytes(T, 1, "bfloat16") == (gemma.bytes_per_token("bfloat16") * 1024
                                                + past * (T - 1024))
    lines = _printed(["--model", "Mistral-7B-v0.1"], capsys)
    assert any(line.startswith("past W     0 bytes") and "no layer grows" in line
               for line in lines)


def test_cli_sequences_that_fit_after_the_weights(capsys: pytest.CaptureFixture[str]) -> None:
    llama = model_cache("Llama-3.1-8B")
    one = llama.kv_bytes(8192, 1, "bfloat16")
    lines = _printed(["--model", "Llama-3.1-8B", "--seq-len", "8192", "--dtype", "bfloat16",
                      "--memory", "80"], capsys)
    fit = (80 * 2**30 - 2 * llama.parameters) // one
    assert (f"fits       {fit:,} sequences of 8,192 positions in 80 GiB, after "
            f"{binary_size(2 * llama.parameters)} of weights (8,030,261,248 parameters in "
            "bfloat16)") in lines
    lines = _printed(["--model", "Llama-3.1-8B", "--seq-len", "8192", "--dtype", "bfloat16",
                      "--memory", "80", "--weights", "20"], capsys)
    assert any(line.startswith(f"fits       {60 * 2**30 // one:,} sequences") for line in lines)
    for argv, match in ((["--memory", "10"], "leave nothing of --memory 10 GiB"),
                        (["--memory", "80", "--weights", "80"], "leave nothing"),
                        (["--weights", "10"], "--weights is subtracted from --memory")):
        assert cli(["memory", "--model", "Llama-3.1-8B", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and match in captured.err


def test_cli_typed_sizes_print_a_models_lines(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _printed(["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-len",
                      "4096", "--batch", "2", "--memory", "8"], capsys)
    one = kv_bytes(1, 32, 4096, 8, 128, "float16")
    assert "           = 2 x 2 (float16) x 32 x 2 x 8 x 128 x 4,096" in lines
    assert f"fits       {8 * 2**30 // one:,} sequences of 4,096 positions in 8 GiB (weights " \
        "not counted: give --weights)" in lines


@pytest.mark.parametrize("name", [m.name for m in MODELS.values() if m.kind != "plain"])
def test_cli_shows_each_term_apart_and_all_attention_beside(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    model = model_cache(name)
    lines = _printed(["--model", name, "--seq-len", "5000", "--batch", "3", "--dtype",
                      "bfloat16"], capsys)
    parts = {line[11:].split(": ")[0]: int(line.split(": ")[1].split(" bytes")[0].replace(",", ""))
             for line in lines if line.startswith("part ")}
    assert parts == model.parts(5000, 3, "bfloat16")
    assert sum(parts.values()) == model.kv_bytes(5000, 3, "bfloat16")
    (full,) = [line for line in lines if line.startswith("all attn ")]
    bytes_full = model.all_attention().kv_bytes(5000, 3, "bfloat16")
    assert full[11:].startswith(f"{bytes_full:,} bytes")
    if model.kind == "linear-hybrid":  # a state stands where K/V of every position would
        assert bytes_full > model.kv_bytes(5000, 3, "bfloat16") > model.fixed_bytes() > 0
    at = [line for line in lines if line.startswith("at T ")]
    assert [int(line[11:].split(":")[0].replace(",", "")) for line in at] == [
        4096, 32768, 131072]
    for line, T in zip(at, (4096, 32768, 131072), strict=True):
        assert f": {binary_size(model.kv_bytes(T, 1, 'bfloat16'))} a sequence" in line
        assert f"all attention {binary_size(model.all_attention().kv_bytes(T, 1, 'bfloat16'))}" \
            in line


def test_cli_deepseek_v4_config_formula_multiplies_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A V4 config.json (compress_ratios as the release's; sizes the test's own): every T around
    the block boundaries, the numbers line redone is the bytes line."""
    config = {"model_type": "deepseek_v4", "num_hidden_layers": 4, "head_dim": 96,
              "index_head_dim": 24, "sliding_window": 16, "max_position_embeddings": 4096,
              "num_attention_heads": 8, "hidden_size": 64, "compress_ratios": [0, 4, 128, 4, 0]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = read_config(tmp_path)
    for T in (1, 3, 4, 5, 127, 128, 129, 1000):
        lines = _printed(["--config", str(tmp_path), "--seq-len", str(T), "--dtype",
                          "bfloat16"], capsys)
        numbers = next(line for line in lines if line.startswith("           = "))
        total = _arithmetic(numbers[13:].replace(",", "").replace(" (bfloat16)", ""))
        assert f"bytes      {total:,} bytes" in lines and total == model.kv_bytes(T, 1, "bfloat16")
