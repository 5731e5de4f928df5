"""Prefix caching of a recurrent state: a hybrid model's hit is the deepest snapshot inside the
shared prefix, for each place snapshots are taken; and vLLM's hybrid block size."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdoc.measure.layer_caches import attention_layer, gated_delta_layer, mamba2_layer
from kvdoc.measure.prefix_report import (
    prefix_report,
    read_prompts,
    state_prefix_report,
    vllm_hybrid_block,
    vllm_state_bytes,
)
from kvdoc.serving.prefix_workload import chat_prompts
from kvdoc.serving.snapshots import WHERE

SAMPLE = Path(__file__).resolve().parent.parent / "docs" / "_static" / "chat-prompts.txt"
SYSTEM = list(range(1000, 1040))  # 40 tokens every prompt starts with


def test_kv_hits_are_the_token_rule_of_the_prefix_report():
    for prompts in (read_prompts(SAMPLE), chat_prompts(conversations=3, turns=3)):
        report = state_prefix_report(prompts)
        assert report.kv_hits == [r.hits["SGLang"] for r in prefix_report(prompts).requests]


def test_snapshots_at_every_token_find_what_kv_finds():
    prompts = read_prompts(SAMPLE)
    report = state_prefix_report(prompts, "every", 1)
    assert report.hits == report.kv_hits and report.hit_rate() == report.kv_hit_rate()


def test_every_block_is_the_block_rule_and_never_beats_kv():
    prompts = chat_prompts(conversations=4, turns=3)
    blocks = [r.hits["vLLM"] for r in prefix_report(prompts, block_size=16).requests]
    assert state_prefix_report(prompts, "every", 16).hits == blocks
    for where in WHERE:
        for branch in (False, True):
            r = state_prefix_report(prompts, where, 16, branch)
            assert all(h <= k for h, k in zip(r.hits, r.kv_hits, strict=True))


def test_last_block_only_a_new_turn_finds_it():
    first = SYSTEM + [1] * 30  # 70 tokens: the last boundary before its last token is 64
    turn = first + [2] * 10  # extends it: finds 64
    other = SYSTEM + [3] * 30  # shares the system prompt: no snapshot there
    retry = list(first)  # the same prompt: 64 again (not 69: no state at 69)
    report = state_prefix_report([first, turn, other, retry], "last", 16)
    assert report.hits == [0, 64, 0, 64]
    assert report.kv_hits == [0, 70, 40, 69]
    # first and other each save one at 64; the turn's last boundary before its last token
    # (79) is 64, the one it found
    assert report.snapshots == 2


def test_prompt_end_only_misses_a_retry_and_branching_rescues_siblings():
    first, other, third = SYSTEM + [1] * 30, SYSTEM + [3] * 30, SYSTEM + [4] * 30
    assert state_prefix_report([first, first + [5]], "end").hits == [0, 70]
    assert state_prefix_report([first, list(first)], "end").hits == [0, 0]  # nothing at 69
    plain = state_prefix_report([first, other, third], "end")
    branched = state_prefix_report([first, other, third], "end", 16, branch=True)
    assert plain.hits == [0, 0, 0] and branched.hits == [0, 0, 32]
    assert branched.snapshots == plain.snapshots + 1


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="where must be one of"):
        state_prefix_report([[1, 2]], "middle")
    with pytest.raises(ValueError, match="block must be a positive integer"):
        state_prefix_report([[1, 2]], "last", 0)
    with pytest.raises(ValueError, match="no empty prompt"):
        state_prefix_report([[1], []])


def test_vllm_block_holds_one_state_in_one_layers_kv_page():
    block = vllm_hybrid_block(1000, 3)  # 334 tokens of 3 bytes hold 1000: 336 after aligning
    assert block == 336 and (block - 16) * 3 < 1000 <= block * 3
    assert vllm_hybrid_block(16 * 3, 3) == 16 and vllm_hybrid_block(1, 3, alignment=1) == 1


def test_vllm_state_keeps_k_minus_1_taps_in_the_models_dtype():
    conv_dim = 2 * 16 * 128 + 32 * 128  # Qwen3-Next: Q, K and V channels
    assert vllm_state_bytes(gated_delta_layer(16, 32, 128, 128, 4), 4) == 2 * (
        conv_dim * 3 + 32 * 128 * 128)
    bamba = mamba2_layer(128, 64, 1, 128, 4)  # conv_dim = H x P + 2 x G x N
    assert vllm_state_bytes(bamba, 4, 4) == 4 * ((128 * 64 + 2 * 128) * 3 + 128 * 64 * 128)
    with pytest.raises(ValueError, match="recurrent layer"):
        vllm_state_bytes(attention_layer(2, 256), 4)
    with pytest.raises(ValueError, match="3 taps"):
        vllm_state_bytes(gated_delta_layer(16, 32, 128, 128, 4), 3)
