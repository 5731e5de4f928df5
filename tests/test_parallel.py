"""Tensor- and context-parallel decoding on two spawned ranks, against one process.

Spawning ranks costs seconds, so one launch (a module fixture) runs every job of the file:
each model under TP = 2 and CP = 2, and each broken variant on the layout it breaks.
"""

from __future__ import annotations

import pytest
import torch

from kvdoc.cli import main
from kvdoc.core.mla import MLAConfig, MLADecoder
from kvdoc.core.model import Decoder, GPTConfig, llama_config
from kvdoc.interop.hf_config import transformers_model
from kvdoc.interop.hf_weights import from_transformers
from kvdoc.parallel.comparison import MODELS, Job, build_model, run_jobs
from kvdoc.parallel.decode import (
    collectives_per_call,
    parallel_generate,
    rank_kv_bytes,
    who_holds,
)
from kvdoc.parallel.launch import choose_backend, launch
from kvdoc.parallel.tensor import head_shard
from kvdoc.proofs.broken.parallel import BROKEN
from kvdoc.serving.splitk import split_k_decoder

PROMPT = torch.tensor([[11, 3, 57, 20, 8, 91, 42]])
NEW = 5
GOOD = [(name, tp, cp) for name in MODELS for tp, cp in ((2, 1), (1, 2))]
EXTRA = {"llama from transformers 2x1": (2, 1), "gpt2 fp64 1x2": (1, 2),
         "llama batch 2 1x2": (1, 2)}
"""A decoder kvdoc loads from transformers (random weights, offline), one in FP64, and a
batch of two prompts."""
TWO_RANKS = [name for name, b in BROKEN.items() if b.tp * b.cp == 2]
"""The broken layouts of 2 ranks (tests/test_process_layouts.py runs the one of 4)."""


@pytest.fixture(scope="module")
def results():
    jobs = [Job(f"{name} {tp}x{cp}", build_model(name), PROMPT, NEW, tp, cp)
            for name, tp, cp in GOOD]
    jobs += [Job(name, build_model(BROKEN[name].model), PROMPT, NEW, BROKEN[name].tp,
                 BROKEN[name].cp, BROKEN[name].parts) for name in TWO_RANKS]
    extra = [(from_transformers(transformers_model("llama")), PROMPT),
             (build_model("gpt2").double(), PROMPT),
             (build_model("llama"), torch.cat((PROMPT, PROMPT.flip(1))))]
    jobs += [Job(name, model, prompt, NEW, *layout)
             for (name, layout), (model, prompt) in zip(EXTRA.items(), extra, strict=True)]
    return {c.name: c for c in run_jobs(jobs)}


@pytest.mark.parametrize(("name", "tp", "cp"), GOOD)
def test_parallel_decode_equals_one_process(results, name, tp, cp):
    c = results[f"{name} {tp}x{cp}"]
    assert c.tokens_equal and c.logits_close and c.kv_close, c.lines()
    assert [m for m, _ in c.bytes] == [f for _, f in c.bytes]
    assert c.collectives_ok and c.collectives == collectives_per_call(MODELS[name], tp, cp, True)
    assert c.ok
    layout = who_holds(MODELS[name], tp, cp, PROMPT.shape[1] + NEW - 1)
    assert c.held == [(tuple(h.kv_heads), tuple(h.positions)) for h in layout]


@pytest.mark.parametrize("name", list(EXTRA))
def test_a_transformers_decoder_fp64_and_a_batch_equal_one_process(results, name):
    c = results[name]
    assert c.ok, c.lines()
    assert c.tolerance == (1e-10 if "fp64" in name else 1e-5)


@pytest.mark.parametrize("name", TWO_RANKS)
def test_each_broken_variant_is_caught(results, name):
    c = results[name]
    assert c.tokens_equal is False or c.logits_close is False
    assert not c.kv_close  # the wrong part corrupts what later layers cache, too
    assert not c.ok


def test_bytes_per_rank_follow_the_heads_and_positions():
    mqa = MODELS["mqa"]  # one K/V head: under TP both ranks hold it whole
    assert head_shard(mqa, 2, 0).kv_heads == head_shard(mqa, 2, 1).kv_heads == range(1)
    full = rank_kv_bytes(mqa, 1, 1, 0, batch=1, seq_len=11)
    assert rank_kv_bytes(mqa, 2, 1, 1, batch=1, seq_len=11) == full  # replicated, not split
    llama = MODELS["llama"]  # two K/V heads: split
    assert 2 * rank_kv_bytes(llama, 2, 1, 0, 1, 11) == rank_kv_bytes(llama, 1, 1, 0, 1, 11)
    # 11 positions over 2 CP ranks: 6 on rank 0 (0, 2, ..., 10), 5 on rank 1
    assert [rank_kv_bytes(llama, 1, 2, r, 1, 11) for r in (0, 1)] == [
        rank_kv_bytes(llama, 1, 1, 0, 1, n) for n in (6, 5)]


def test_one_rank_runs_here_and_equals_generate():
    model = build_model("gpt2")
    run = parallel_generate(model, PROMPT, NEW)
    assert len(run.ranks) == 1 and run.ranks[0].collectives == [{}] * NEW
    assert run.logits.shape == (1, NEW, model.config.vocab_size)


@pytest.mark.parametrize(("model", "tp", "cp", "fragment"), [
    (Decoder(GPTConfig()), 3, 1, "tp=3 does not divide n_head=4"),
    (Decoder(GPTConfig()), 8, 1, "tp=8 does not divide n_head=4"),
    (Decoder(GPTConfig(n_embd=96, n_head=6, n_kv_head=3, n_inner=96)), 2, 1,
     "3 K/V heads cannot be split evenly over 2 devices"),
    (Decoder(llama_config(n_inner=130)), 4, 1, "does not divide the MLP width n_inner=130"),
    (Decoder(GPTConfig()), 1, 0, "cp must be a positive integer"),
    (Decoder(GPTConfig()), True, 1, "tp must be a positive integer"),
    (MLADecoder(MLAConfig()), 1, 2, "takes a kvdoc Decoder of standard attention blocks"),
    (split_k_decoder(Decoder(GPTConfig()), 3), 2, 1, "standard attention blocks"),
    # before any rank starts, not in each rank's ShardedAttention
    (Decoder(llama_config(qk_norm=True, head_size=20)), 2, 1, "q/k norms.*Qwen3-style"),
])
def test_bad_layouts_are_refused_before_any_rank_starts(model, tp, cp, fragment):
    with pytest.raises(ValueError, match=fragment):
        parallel_generate(model, PROMPT, 3, tp=tp, cp=cp)


def test_bad_prompts_are_refused():
    model = build_model("llama")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        parallel_generate(model, torch.tensor([[1, 500]]), 3, tp=2)  # refused before launching
    with pytest.raises(ValueError, match="positions, model has 512"):
        parallel_generate(model, PROMPT, 510, tp=2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        parallel_generate(model, PROMPT, 0, cp=2)


def test_launch_refuses_a_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        launch(print, 0)


def test_the_backend_is_gloo_without_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert choose_backend(2) == "gloo" and choose_backend(2, "gloo") == "gloo"
    with pytest.raises(ValueError, match="nccl backend needs one CUDA GPU per rank: 2 ranks, "
                                         "0 GPU"):
        choose_backend(2, "nccl")
    with pytest.raises(ValueError, match="nccl backend needs"):
        launch(print, 2, backend="nccl")  # refused before any rank starts
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        choose_backend(2, "mpi")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the choice, not a GPU run
    assert choose_backend(2) == "nccl" and choose_backend(3) == "gloo"
    assert choose_backend(2, "gloo") == "gloo"


def test_the_command_hands_over_by_pull_and_runs_the_latent(capsys):
    argv = ["parallel", "--models", "llama", "--handover", "pull", "--have", "1",
            "--new-tokens", "3", "--latent"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(gloo)" in out and "hand-over (pull)" in out and "FAILED" not in out
    assert "llama (pull, logits)" in out and "llama (pull, recompute)" in out
    assert "MLA latent, tp on 2 ranks" in out and "MLA latent, dp on 2 ranks" in out


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--have", "1"], "--have needs --handover pull"),
    (["--latent", "--cp", "2"], "--latent runs on --tp ranks alone"),
    (["--handover", "pull", "--have", "5"], "gpt2, hand-over (logits): the decode rank can hold"),
    (["--tp", "3"], "gpt2: tp=3 does not divide n_head=4"),
    (["--tp", "4", "--cp", "8"], "32 processes; at most 16"),
    (["--models", "gpt5"], "unknown model(s) ['gpt5']"),
])
def test_the_command_refuses_bad_arguments_with_exit_2(capsys, argv, fragment):
    assert main(["parallel", *argv]) == 2
    assert fragment in capsys.readouterr().err
