"""Every preset kind through one lookup; config.json files of each family read into the same
caches; the memory command on them; no torch at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kvdoc.__main__ import main as cli
from kvdoc.core import frame
from kvdoc.interop.hf_deepseek import published_config
from kvdoc.measure.kv_bytes import kv_bytes, kv_bytes_per_layer
from kvdoc.measure.layer_caches import KINDS, ModelCache, every_nth_full
from kvdoc.measure.model_caches import (
    MODELS,
    cache_from_config,
    config_cache,
    model_cache,
    read_config,
)

NAMES = ["Llama-3-70B", "Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B", "Qwen3-8B",
         "Qwen3-32B", "Mistral-7B-v0.1", "Gemma-2-9B", "Gemma-3-27B", "DeepSeek-V3",
         "gpt-oss-20b", "gpt-oss-120b", "Qwen3-Next-80B-A3B"]


def test_at_least_20_models_of_every_kind_one_lookup() -> None:
    assert len(MODELS) >= 20
    # DeepSeek-V4's compressed layers: read from a config.json only (no release sizes verified)
    assert {m.kind for m in MODELS.values()} == set(KINDS) - {"compressed"}
    for name in NAMES:
        m = model_cache(name.upper())
        assert m.name == name and "config.json" in m.source
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'; known models:.*Qwen3-Next"):
        model_cache("gpt-5")
    for typed, near in (("Llama-3.1-8B-Instruct", "Llama-3.1-8B, "), ("gemma3-27b", "Gemma-3-27B"),
                        ("Qwen/Qwen3-8B", "Qwen3-8B")):
        with pytest.raises(ValueError, match=rf"'{typed}'; did you mean {near}") as err:
            model_cache(typed)
        assert "known models" not in str(err.value)


def llama_family_parameters(preset: ModelCache) -> tuple[int, int]:
    """``(every parameter, the input embedding's)`` of a Llama-family preset, untied head,
    counted on transformers' model built on the meta device (no memory, no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    family = (MistralConfig, MistralForCausalLM) if preset.sliding_window else (
        LlamaConfig, LlamaForCausalLM)
    config = family[0](hidden_size=preset.hidden, intermediate_size=preset.intermediate,
                       vocab_size=preset.vocab, num_hidden_layers=len(preset.layers),
                       num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
                       head_dim=preset.head_dim, tie_word_embeddings=False)
    with torch.device("meta"):
        model = family[1](config)
    return sum(p.numel() for p in model.parameters()), model.get_input_embeddings().weight.numel()


@pytest.mark.parametrize("preset", [p for p in MODELS.values() if p.vocab is not None],
                         ids=lambda p: p.name)
def test_meta_count_equals_the_closed_form(preset: ModelCache) -> None:
    d, ff, V, L = preset.hidden, preset.intermediate, preset.vocab, len(preset.layers)
    kv = preset.kv_heads * preset.head_dim
    per_layer = d * preset.heads * preset.head_dim * 2 + 2 * d * kv + 3 * d * ff + 2 * d
    assert llama_family_parameters(preset) == (2 * V * d + d + L * per_layer, V * d)


def test_parameters_are_transformers_count_of_the_same_sizes() -> None:
    counted = [m for m in MODELS.values() if m.parameters is not None]
    assert len(counted) == 8  # the Llama-family presets that record hidden, intermediate, vocab
    for m in counted:
        assert m.parameters == llama_family_parameters(m)[0], m.name
    # the counts their checkpoints carry (llama.cpp GGUF files, general.parameter_count)
    assert model_cache("Llama-2-7B").parameters == 6_738_415_616
    assert model_cache("Mistral-7B-v0.1").parameters == 7_241_732_096


@pytest.mark.parametrize("T", [1, 127, 128, 1000, 4096, 5000, 131072])
def test_plain_and_hybrid_presets_match_the_kv_formula(T: int) -> None:
    for m in MODELS.values():
        if m.kind in ("plain", "windowed"):  # the closed form, every layer alike
            assert m.kv_bytes(T, 3, "bf16") == kv_bytes(3, len(m.layers), T, m.kv_heads,
                                                         m.head_dim, "bf16",
                                                         window=m.sliding_window)
        elif m.kind == "hybrid":  # the per-layer form over its windows
            windows = [layer.window for layer in m.layers]
            assert m.kv_bytes(T, 1, "bfloat16") == sum(kv_bytes_per_layer(
                1, T, m.kv_heads, m.head_dim, "bfloat16", windows))
            pattern = windows.index(None) + 1  # every pattern-th layer global, as Gemma's
            assert every_nth_full(len(windows), pattern) == list(
                frame.every_nth_full(len(windows), pattern))


def test_mla_preset_is_the_interop_config() -> None:
    cfg = published_config("DeepSeek-V3")
    m = model_cache("DeepSeek-V3")
    assert len(m.layers) == cfg.n_layer and m.max_positions == cfg.n_positions
    assert m.bytes_per_token("bfloat16") == config_cache(cfg).bytes_per_token(torch.bfloat16)
    # a latent a position, far below what K and V of 128 heads would take
    assert m.kv_bytes(10) == 10 * m.bytes_per_token()


def test_linear_hybrid_counts_a_fixed_state_and_12_attention_layers() -> None:
    m = model_cache("Qwen3-Next-80B-A3B")
    grows = m.kv_bytes(2000) - m.kv_bytes(1000)
    assert grows == 1000 * 12 * 2 * 2 * 256 * 2  # 12 layers, 2 K/V heads of 256, float16
    # the conv state in float16, the recurrent state in FP32 (transformers 5.24.0's dtypes)
    assert m.kv_bytes(0) == m.fixed_bytes() == 36 * (4 * 32 * 128 * 128 + 2 * 8192 * 4)


def test_gpt_oss_windows_stop_half_its_layers() -> None:
    m = model_cache("gpt-oss-120b")
    full_only = kv_bytes_per_layer(1, 10**5, 8, 64, "float16", [128, None] * 18)
    assert m.kv_bytes(10**5) == sum(full_only)
    assert [layer.window for layer in m.layers[:4]] == [128, None, 128, None]


# one config.json per family, written as the Hub publishes them (the fields kvdoc reads)
CONFIGS = {
    "Llama-3.1-8B": {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072},
    "Qwen3-32B": {"model_type": "qwen3", "num_hidden_layers": 64, "hidden_size": 5120,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                  "sliding_window": None, "use_sliding_window": False,
                  "max_position_embeddings": 40960},
    "GPT-2-small": {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768,
                    "n_positions": 1024},
    "Falcon-7B": {"model_type": "falcon", "num_hidden_layers": 32, "num_attention_heads": 71,
                  "hidden_size": 4544, "multi_query": True, "max_position_embeddings": 2048},
    "Mistral-7B-v0.1": {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
                        "num_attention_heads": 32, "num_key_value_heads": 8,
                        "sliding_window": 4096, "max_position_embeddings": 32768},
    "Gemma-2-9B": {"model_type": "gemma2", "num_hidden_layers": 42, "hidden_size": 3584,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                   "sliding_window": 4096, "max_position_embeddings": 8192},
    "Gemma-3-27B": {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
        "sliding_window": 1024, "sliding_window_pattern": 6,
        "max_position_embeddings": 131072}},
    "gpt-oss-20b": {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                    "sliding_window": 128, "max_position_embeddings": 131072,
                    "layer_types": ["sliding_attention", "full_attention"] * 12},
    "DeepSeek-V3": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
                    "num_attention_heads": 128, "num_key_value_heads": 128,
                    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128, "max_position_embeddings": 163840},
    "Qwen3-Next-80B-A3B": {"model_type": "qwen3_next", "num_hidden_layers": 48,
                           "hidden_size": 2048, "num_attention_heads": 16,
                           "num_key_value_heads": 2, "head_dim": 256,
                           "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                           "max_position_embeddings": 262144},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_json_of_each_family_reads_as_its_preset(name: str, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    read, known = read_config(path), model_cache(name)
    assert read.kind == known.kind and read.max_positions == known.max_positions
    for T, B, dtype in ((1, 1, "float16"), (1000, 2, "bf16"), (5000, 3, "float32"),
                        (known.max_positions, 1, "fp8")):
        assert read.kv_bytes(T, B, dtype) == known.kv_bytes(T, B, dtype), (T, B, dtype)


def test_gemma_3_text_config_takes_the_class_defaults_it_leaves_out() -> None:
    # gemma-3-4b-pt's config.json gives no head counts, head size or context in text_config
    sparse = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34,
        "sliding_window": 1024}}
    read, known = cache_from_config(sparse), model_cache("Gemma-3-4B")
    assert read.kind == "hybrid" and read.max_positions == known.max_positions
    assert all(read.kv_bytes(T) == known.kv_bytes(T) for T in (1, 1024, 1025, 131072))


def test_linear_layers_without_sizes_count_only_attention() -> None:
    c = {k: v for k, v in CONFIGS["Qwen3-Next-80B-A3B"].items() if not k.startswith("linear")}
    m = cache_from_config(c)
    assert m.fixed_bytes() == 0 and "only the 12 attention layers" in m.note
    assert m.kv_bytes(100) == model_cache("Qwen3-Next-80B-A3B").kv_bytes(100) - model_cache(
        "Qwen3-Next-80B-A3B").fixed_bytes()


@pytest.mark.parametrize("config, match", [
    ({"model_type": "mamba", "num_hidden_layers": 2}, "state-space"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 8}, "max_position"),
    ({**CONFIGS["Llama-3.1-8B"], "num_hidden_layers": 0}, "num_hidden_layers"),
    ({**CONFIGS["Llama-3.1-8B"], "num_key_value_heads": "8"}, "num_key_value_heads"),
    ({**CONFIGS["gpt-oss-20b"], "layer_types": ["full_attention"]}, "24 entries"),
    ({**CONFIGS["gpt-oss-20b"], "layer_types": ["chunked_attention"] * 24}, "unknown layer"),
    ([1, 2], "JSON object"),
])
def test_config_json_refuses_what_it_cannot_read(config: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cache_from_config(config)  # type: ignore[arg-type]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = cli(["memory", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = int(exc.code or 0)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("name", NAMES)
def test_cli_model_alone_takes_its_context(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    m = model_cache(name)
    rc, out, err = _run(["--model", name], capsys)
    assert rc == 0 and err == ""
    assert f"bytes      {m.kv_bytes(m.max_positions):,} bytes" in out
    rc, out, err = _run(["--model", name, "--seq-len", str(m.max_positions + 1)], capsys)
    assert rc == 0 and "warning" in err and f"{m.kv_bytes(m.max_positions + 1):,}" in out


@pytest.mark.parametrize("name", CONFIGS)
def test_cli_config(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    for given in (path, tmp_path):  # the file, or the checkpoint folder holding it
        rc, out, err = _run(["--config", str(given), "--seq-len", "1000", "--batch", "2"], capsys)
        assert rc == 0 and err == ""
        assert f"bytes      {model_cache(name).kv_bytes(1000, 2):,} bytes" in out


@pytest.mark.parametrize("length", ["0", "-5", str(10**20), "1.5", "1e3", "lots"])
def test_cli_nonsense_lengths_exit_2(length: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["--model", "Qwen3-8B", "--seq-len", length], capsys)
    assert rc == 2 and out == "" and "error" in err


def test_cli_memory_counts_sequences_that_fit(capsys: pytest.CaptureFixture[str]) -> None:
    m = model_cache("gpt-oss-20b")
    rc, out, _ = _run(["--model", "gpt-oss-20b", "--seq-len", "50000", "--memory", "24"], capsys)
    fit = 24 * 2**30 // m.kv_bytes(50000)
    assert rc == 0 and f"fits       {fit:,} sequences of 50,000 positions in 24 GiB" in out
    for bad in (["--model", "gpt-oss-20b", "--memory", "-1"],
                ["--model", "gpt-oss-20b", "--memory", "inf"],
                ["--layers", "2", "--kv-heads", "1", "--head-dim", "4", "--seq-len", "8",
                 "--memory", "1", "--weights", "1"]):
        rc, out, err = _run(bad, capsys)
        assert rc == 2 and out == "" and "error" in err


def test_cli_config_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    (tmp_path / "empty").mkdir()
    for argv, match in ((["--config", str(bad)], "not JSON"),
                        (["--config", str(tmp_path / "none.json")], "cannot read"),
                        (["--config", str(tmp_path / "empty")], "folder without a config.json"),
                        (["--config", str(bad), "--model", "Qwen3-8B"], "error")):
        rc, out, err = _run(argv, capsys)
        assert rc == 2 and out == "" and match in err


def test_memory_command_starts_without_torch() -> None:
    code = ("import sys; from kvdoc.cli import main; "
            "rc = main(['memory', '--model', 'DeepSeek-V3']); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr


# transformers documents each of these config classes' defaults as "a similar configuration to
# that of" the checkpoint; for these three the cache's sizes agree with it (its context does not:
# its defaults say 131,072 where Mistral's and Mixtral's model cards say 32,768). Its Qwen3 and
# gpt-oss defaults are other sizes (32 layers of 32 K/V heads; 36 layers), so not a second source.
@pytest.mark.parametrize("config_class, name", [("FalconConfig", "Falcon-7B"),
                                                ("MistralConfig", "Mistral-7B-v0.1"),
                                                ("MixtralConfig", "Mixtral-8x7B-v0.1")])
def test_presets_agree_with_transformers_documented_defaults(config_class: str, name: str) -> None:
    theirs = cache_from_config(getattr(transformers, config_class)().to_dict())
    assert theirs.groups() == model_cache(name).groups()
