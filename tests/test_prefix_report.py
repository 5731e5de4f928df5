"""The prefix-cache hit-rate report: each engine's rule, each reason for a miss, routing, the
sample file the site ships, reading token ids and chat messages, and the command's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdoc.measure.prefix_report import BALANCE, Prefixes, prefix_report, read_prompts
from kvdoc.serving.prefix_workload import END, SYSTEM, USER, chat_prompts

SAMPLE = Path(__file__).resolve().parent.parent / "docs" / "_static" / "chat-prompts.txt"
A = list(range(100, 140))  # 40 tokens: two blocks of 16 and 8 more


def hits(report, rule):
    return [r.hits[rule] for r in report.requests]


def test_vllm_keeps_whole_blocks_sglang_every_token_both_recompute_the_last():
    b = A[:37] + [7, 8]  # shares 37 tokens with A: two blocks and 5 more
    report = prefix_report([A, b, A])
    assert hits(report, "vLLM") == [0, 32, 32]  # 37 and 39 rounded down to blocks of 16
    assert hits(report, "SGLang") == [0, 37, 39]  # A again: all but its last token
    assert [r.shared for r in report.requests] == [0, 37, 40]
    assert hits(prefix_report([A, b, A], block_size=4, page_size=4), "SGLang") == [0, 36, 36]
    assert report.hit_rate("SGLang") == pytest.approx(76 / 119)


def test_each_reason():
    clocked = [9] + A[1:]
    short = A[:10] + [1, 2, 3]  # 10 shared tokens: under one block
    turn = A + [5, 6]
    drifted = A[:30] + [4] + A[31:] + [5, 6, 7]
    report = prefix_report([A, clocked, short, A, turn, A[:20], drifted])
    reasons = [r.reason for r in report.requests]
    assert reasons == [
        "nothing cached", "differs at token 0", "parts from #0 at 10, under a block",
        "repeats #0", "extends #3", "inside #4", "parts from #4 at 30"]
    summary = report.summary()
    misses = {r.reason: r.tokens - r.hits["SGLang"] for r in report.requests}
    assert misses["repeats #0"] == 1 and misses["inside #4"] == 1
    assert summary.startswith("|  | vLLM (block 16) | SGLang (page 1) |")


def test_missed_tokens_add_up_by_reason():
    prompts = chat_prompts(conversations=3, turns=3, system=40, stamp=False, repeat=2)
    report = prefix_report(prompts)
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:]
            for line in report.summary().splitlines()[2:]}
    for column, rule in enumerate(("vLLM", "SGLang")):
        after, last, partial = (int(rows[f"missed: {why}"][column])
                                for why in ("after a difference", "last token", "partial block"))
        missed = sum(r.tokens - r.hits[rule] for r in report.requests)
        assert after + last + partial == missed and last == len(prompts) // 2


def test_routing_by_prefix_keeps_a_conversation_on_its_replica_and_the_load_even():
    one, two = [1, 2, 3, 4], [5, 6, 7, 8]
    prompts = [one, two, two + [9], one + [9]]  # two conversations of two turns
    robin = prefix_report(prompts, replicas=2)
    aware = prefix_report(prompts, replicas=2, route="prefix")
    assert [r.replica for r in robin.requests] == [0, 1, 0, 1]
    assert [r.replica for r in aware.requests] == [0, 1, 1, 0]
    assert hits(robin, "SGLang") == [0, 0, 0, 0] and hits(aware, "SGLang") == [0, 0, 4, 4]
    crowd = prefix_report([one] * 5, replicas=2, route="prefix")
    # two ahead: the fourth goes to replica 1; then both hold it, and the less used wins
    assert BALANCE == 2 and [r.replica for r in crowd.requests] == [0, 0, 0, 1, 1]


def test_the_report_matches_kvdocs_radix_tree():
    """Each rule is the tree of the page (checked against the engines' code by peer-check):
    SGLang's, the tree matching token by token over blocks of 1; vLLM's, whole blocks of 16."""
    from kvdoc import GPTConfig
    from kvdoc.serving.paged import BlockPool
    from kvdoc.serving.radix import RadixCache

    prompts = chat_prompts(conversations=3, turns=3, system=24, user=(4, 12), reply=(8, 20),
                           drift=5, vocab=97)
    report = prefix_report(prompts)
    tiny = GPTConfig(n_layer=1, n_head=1, n_embd=4, n_inner=4)
    for rule, size, granularity in (("SGLang", 1, "token"), ("vLLM", 16, "block")):
        tree = RadixCache(BlockPool(tiny, sum(map(len, prompts)), size), granularity)
        for prompt, request in zip(prompts, report.requests, strict=True):
            assert tree.reusable(prompt)[0] == request.hits[rule]
            whole = len(prompt) // size
            blocks = tree.pool.allocate(whole)
            tree.insert(prompt[:whole * size], blocks)
            tree.pool.release(blocks)


def test_the_sample_file_is_its_recipe_and_shows_every_reason():
    sections, prompts = [], read_prompts(SAMPLE)
    for line in SAMPLE.read_text().splitlines():
        if line.startswith("# ") and line.endswith("}"):
            args = json.loads(line[line.index("{"):])
            sections += chat_prompts(**{k: tuple(v) if isinstance(v, list) else v
                                        for k, v in args.items()})
    assert [tuple(p) for p in prompts] == sections and SAMPLE.stat().st_size < 50_000
    reasons = " ".join(r.reason for r in prefix_report(prompts).requests)
    for words in ("nothing cached", "at token 0", "under a block", "repeats", "extends",
                  "parts from"):
        assert words in reasons


def test_chat_prompts_carry_each_mistake():
    plain, stamped = chat_prompts(turns=2), chat_prompts(turns=2, stamp=True)
    assert plain[0][0] == SYSTEM and stamped[0][6] == SYSTEM
    assert len({p[:6] for p in stamped}) == len(stamped)  # a new clock every request
    assert chat_prompts(turns=1, repeat=3)[:3] == [chat_prompts(turns=1)[0]] * 3
    first, *rest = chat_prompts(conversations=1, turns=3, drift=7)
    assert rest[0][:len(first)] == first and rest[1][:len(rest[0])] != rest[0]
    assert rest[1].count(USER) == 3 and rest[1].count(END) == 1 + 3 + 2 - 1 + 1


def test_prefixes_finds_the_longest_added_prefix():
    p = Prefixes()
    p.add([1, 2, 3], 0)
    p.add([1, 2, 4, 5], 1)
    assert [p.longest(t)[0] for t in ([1, 2, 4, 6], [1, 2, 3], [2], [])] == [3, 3, 0, 0]


def test_bad_input_says_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        prefix_report([A], block_size=0)
    with pytest.raises(ValueError, match="route"):
        prefix_report([A], route="random")
    with pytest.raises(ValueError, match="no empty prompt"):
        prefix_report([A, []])
    bad = tmp_path / "p.txt"
    bad.write_text("# a comment\n1 2 3\n\n4 five 6\n")
    with pytest.raises(ValueError, match=r"p\.txt:4: expected token ids.*--tokenizer"):
        read_prompts(bad)


def test_text_and_chat_messages_through_a_local_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "system", "user", "assistant", "be", "brief", "hi", "how", "now"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")
    fast.save_pretrained(tmp_path / "tok")
    system = {"role": "system", "content": "be brief"}
    lines = [[system, {"role": "user", "content": "hi"}], "how now",
             [system, {"role": "user", "content": "how"}]]
    file = tmp_path / "p.jsonl"
    file.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    prompts = read_prompts(file, str(tmp_path / "tok"))
    assert prompts == [[1, 4, 5, 2, 6, 3], [7, 8], [1, 4, 5, 2, 7, 3]]
    file.write_text("not json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: expected a JSON"):
        read_prompts(file, str(tmp_path / "tok"))
