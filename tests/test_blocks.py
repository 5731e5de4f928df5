"""Blocks across processes (a TP = 2 prefill handing K/V to a TP = 1 decode rank) and offloaded
blocks in three tiers, each against one process.

Spawning ranks costs seconds, so one launch (a module fixture) runs every hand-over of the file,
the broken variant included.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvdoc.parallel import blocks
from kvdoc.parallel.blocks import (
    Handover,
    check_handover,
    destination,
    handover_jobs,
    handover_runs,
    messages,
    moved_bytes,
    pulled_blocks,
    request_bytes,
    senders,
)
from kvdoc.parallel.comparison import MODELS, build_model
from kvdoc.parallel.tensor import head_shard
from kvdoc.proofs import grid, verify
from kvdoc.proofs.broken.parallel import PULL_BROKEN, stale_ids, swapped_destination
from kvdoc.proofs.broken.serving import parentless_hash
from kvdoc.serving.offload import (
    ROW_LAYERS,
    Roofline,
    TieredStore,
    block_hashes,
    check_offload,
    hash_block,
    multi_turn,
    reload_or_recompute,
    serve,
)

PROMPT = torch.tensor([[11, 3, 57, 20, 8, 91, 42, 5, 9, 17]])
NEW = 4
GOOD = [("llama", "logits"), ("llama", "recompute"), ("gpt2", "logits"), ("mqa", "recompute"),
        ("mistral", "logits")]


@pytest.fixture(scope="module")
def handed():
    jobs = [(f"{name} {mode}", build_model(name), PROMPT, NEW, 4, mode) for name, mode in GOOD]
    jobs.append(("llama batch 2 block 3", build_model("llama"),
                 torch.cat((PROMPT, PROMPT.flip(1))), NEW, 3, "recompute"))
    jobs.append(("gpt2 fp64 block 1", build_model("gpt2").double(), PROMPT, NEW, 1, "logits"))
    jobs.append(("llama block 32", build_model("llama"), PROMPT, NEW, 32, "recompute"))
    jobs += [(f"{name} swapped", build_model(name), PROMPT, NEW, 4, "logits",
              swapped_destination) for name in ("gpt2", "llama")]
    jobs += [Handover(f"{name} pull {mode} have {have}", build_model(name), PROMPT, NEW, 4, mode,
                      transfer="pull", have=have) for name, mode, have in PULLED]
    jobs += [Handover(name, build_model("llama"), PROMPT[:, :9], NEW, 4, **fields)
             for name, fields in PULL_BROKEN.items()]
    jobs += [(f"verify: {name}", build_model(model), verify.PROMPT, verify.NEW,
              verify.BLOCK, mode) for name, model, tp, mode in VERIFIED if tp == 2]
    jobs += [(f"grid {name}", grid.MODELS[name].build(0).eval(), PROMPT % 89, NEW, 4,
              "logits") for name in GRID_SPLIT]
    return {c.name: c for c in handover_jobs(jobs)}


VERIFIED = verify.HANDOVERS + verify.THOROUGH_HANDOVERS
"""The hand-overs verify adds to llama's, by default and with ``--thorough``."""
GRID_SPLIT = ("mha", "gqa", "mqa", "llama", "qwen2", "mistral", "deep")
"""The grid's models of standard attention blocks: the ones a TP prefill splits."""
GRID_REFUSED = {"qwen3": "q/k norms", "split-k": "Block of SplitKAttention",
                "mla": "LatentAttention \\(a latent per position, not K/V heads",
                "bamba": "HybridBlock without attention",
                "gemma3": "GemmaBlock of GemmaAttention"}
"""What the refusal names for some of the rest (every other: its class)."""


PULLED = [("llama", "logits", 0), ("llama", "logits", 2), ("gpt2", "recompute", 1),
          ("mqa", "logits", 1)]
"""Pulls: of every block, and after the decode rank holds some (a partial last block left)."""

EXTRA = [("llama batch 2 block 3", "recompute"), ("gpt2 fp64 block 1", "logits"),
         ("llama block 32", "recompute")]
"""A batch of two prompts, FP64 with one position per block, one block longer than the
prompt."""


@pytest.mark.parametrize(("name", "mode"), [*GOOD, *EXTRA])
def test_the_handover_equals_one_process_and_moves_the_formula_bytes(handed, name, mode):
    c = handed[name if "block" in name else f"{name} {mode}"]
    assert c.tokens_equal and c.kv_close and c.logits_close, c.lines()
    assert c.sent_bytes == c.received_bytes == c.formula_bytes
    assert c.messages == c.formula_messages
    assert c.forwards == (mode == "recompute")
    assert c.ok


def test_block_size_sets_the_messages(handed):
    assert handed["gpt2 fp64 block 1"].messages == 2 * PROMPT.shape[1] + 1  # 2 ranks x 10 + 1
    assert handed["llama block 32"].messages == 2  # one partial block from each rank


def test_recompute_moves_one_position_and_the_logits_less(handed):
    logits, recompute = handed["llama logits"], handed["llama recompute"]
    config = MODELS["llama"]
    per_position = 2 * config.n_layer * config.n_kv_head * config.head_dim * 4
    assert logits.sent_bytes - recompute.sent_bytes == per_position + config.vocab_size * 4


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_heads_in_the_wrong_order_are_caught(handed, name):
    c = handed[f"{name} swapped"]
    assert c.sent_bytes == c.formula_bytes  # the bytes are right, their places are not
    assert not c.kv_close and not c.ok


def test_bytes_moved_do_not_depend_on_the_prefill_layout():
    mqa, gpt2 = MODELS["mqa"], MODELS["gpt2"]
    assert senders(mqa, 2) == [0] and senders(gpt2, 2) == [0, 1]  # a replica sends once
    assert destination(gpt2, 2, 1) == [2, 3] and swapped_destination(gpt2, 2, 1) == [0, 1]
    assert messages(gpt2, 2, 10, 4, "logits") == 3 * 2 + 1
    assert messages(mqa, 2, 10, 4, "recompute") == 3
    full = moved_bytes(gpt2, 1, 10, "recompute")
    assert full == 2 * gpt2.n_layer * 9 * gpt2.n_kv_head * gpt2.head_dim * 4


@pytest.mark.parametrize(("name", "mode", "have"), PULLED)
def test_a_pull_equals_one_process_and_moves_the_formula_bytes(handed, name, mode, have):
    c = handed[f"{name} pull {mode} have {have}"]
    assert c.tokens_equal and c.kv_close and c.logits_close, c.lines()
    assert c.sent_bytes == c.received_bytes == c.formula_bytes
    assert c.requests[0] == c.requests[1] == c.requests[2] > 0
    assert c.messages == c.formula_messages and c.ok
    push = handed[f"{name} {mode}"] if f"{name} {mode}" in handed else None
    if push is not None and have == 0:  # the same K/V crosses, plus the ids asked
        assert c.sent_bytes == push.sent_bytes


def test_a_pull_moves_only_the_blocks_it_lacks():
    llama = MODELS["llama"]
    per_position = 2 * llama.n_layer * llama.n_kv_head * llama.head_dim * 4
    assert pulled_blocks(10, 4, "logits", have=2) == range(2, 3)
    assert (moved_bytes(llama, 1, 10, "logits") - moved_bytes(llama, 1, 10, "logits", held=8)
            == 8 * per_position)
    assert request_bytes(llama, 2, 10, 4, "logits", have=2) == 2 * (1 + 1) * 8
    assert messages(llama, 2, 10, 4, "logits", "pull", have=2) == 2 * (1 + 2) + 1


def test_a_stale_block_id_is_caught(handed):
    c = handed["handover-stale-pull"]
    assert stale_ids(range(1, 3)) == [0, 1]
    assert c.sent_bytes == c.formula_bytes and c.messages == c.formula_messages
    assert not c.kv_close and not c.ok  # the right sizes, an old block in the slot


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"mode": "pull"}, "unknown hand-over mode 'pull'"),
    ({"transfer": "fetch"}, "unknown transfer 'fetch'"),
    ({"have": 1}, "have > 0 needs transfer='pull'"),
    ({"transfer": "pull", "have": 3}, "0 to 2 of the 3 blocks"),
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"tp": 3}, "tp=3 does not divide n_head=4"),
    ({"prompt": torch.tensor([[4]]), "mode": "recompute"}, "at least 2 tokens"),
    ({"prompt": torch.tensor([[4, 500]])}, "outside the vocabulary"),
])
def test_bad_handovers_are_refused_before_any_rank_starts(kwargs, fragment):
    job = {"prompt": PROMPT, "tp": 2, "block_size": 4, "mode": "logits", "transfer": "push",
           "have": 0, **kwargs}
    with pytest.raises(ValueError, match=fragment):
        check_handover(build_model("llama"), job["prompt"], 3, job["tp"], job["block_size"],
                       job["mode"], job["transfer"], job["have"])


@pytest.mark.parametrize("name", [n for n, _, tp, _ in VERIFIED if tp == 2])
def test_the_handovers_verify_adds_equal_one_process(handed, name):
    c = handed[f"verify: {name}"]
    assert c.ok, c.lines()


def test_the_handovers_verify_adds_on_four_prefill_ranks_equal_one_process():
    jobs = [(tp, Handover(name, build_model(model), verify.PROMPT, verify.NEW,
                          verify.BLOCK, mode)) for name, model, tp, mode in VERIFIED
            if tp == 4]
    checks = handover_runs(jobs)
    assert [c.name for c in checks] == [j.name for _, j in jobs] and len(checks) == 2
    for c in checks:
        assert c.ok, c.lines()
    # 2 K/V heads over 4 ranks: the first of each replica set sends 3 blocks; logits
    assert checks[0].messages == 2 * 3 + 1


def test_handover_runs_launches_once_per_prefill_tp_and_keeps_the_order(monkeypatch):
    launched = []

    def fake(jobs, tp):
        launched.append((tp, list(jobs)))
        return [f"{j} at {tp}" for j in jobs]
    monkeypatch.setattr(blocks, "handover_jobs", fake)
    runs = handover_runs([(2, "a"), (4, "b"), (2, "c")])
    assert runs == ["a at 2", "b at 4", "c at 2"]
    assert launched == [(2, ["a", "c"]), (4, ["b"])]


def _reaches(jobs) -> set[str]:
    """The branches of the hand-over each ``(name, model, tp, mode)`` takes."""
    found = set()
    for _, name, tp, _ in jobs:
        config, shard = MODELS[name], head_shard(MODELS[name], tp, 0)
        if shard.replicas > 1:
            several = ", several K/V heads" if config.n_kv_head > 1 else ""
            found.add(f"one sender a replica set{several}")
        if len(shard.kv_heads) > 1:
            found.add("several K/V heads a message")
        if config.qkv_bias or config.bias:
            found.add("biases")
        if (config.sliding_window or verify.PROMPT.shape[1]) < verify.PROMPT.shape[1]:
            found.add("a window shorter than the prompt")
    return found


def test_verify_hands_over_every_branch_by_default_or_thorough():
    default = {"one sender a replica set", "several K/V heads a message", "biases"}
    assert _reaches(verify.HANDOVERS) == default
    thorough = {"one sender a replica set, several K/V heads",
                "a window shorter than the prompt"}
    assert _reaches(VERIFIED) == default | thorough


@pytest.mark.parametrize("name", GRID_SPLIT)
def test_each_grid_model_of_standard_blocks_is_handed_over_as_one_process(handed, name):
    c = handed[f"grid {name}"]
    assert c.ok, c.lines()


@pytest.mark.parametrize("name", [n for n in grid.MODELS if n not in GRID_SPLIT])
def test_every_other_grid_model_is_refused_by_name_before_any_rank_starts(name):
    model = grid.MODELS[name].build(0).eval()
    fragment = GRID_REFUSED.get(name, type(model).__name__)
    with pytest.raises(ValueError, match=f"block hand-over sends .* got .*{fragment}"):
        check_handover(model, PROMPT % 89, NEW, 2, 4, "logits")


def test_chained_keys_name_the_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6], 3)
    b = block_hashes([9, 9, 9, 4, 5, 6], 3)
    assert len(a) == 2 and a[1] != b[1]  # same tokens in block 1, other prefix
    assert a[1] == hash_block(a[0], [4, 5, 6])
    assert parentless_hash(a[0], [4, 5, 6]) == parentless_hash(b[0], [4, 5, 6])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_offloaded_blocks_hit_every_tier_and_change_no_token(tmp_path, name):
    model = build_model(name)
    store = TieredStore(device_blocks=4, host_blocks=4, folder=str(tmp_path))
    served = multi_turn(model, store, block_size=4, max_new_tokens=3)
    c = check_offload(model, served, 3)
    assert c.ok, c
    assert all(c.blocks[tier] > 0 for tier in ("device", "host", "disk", "computed"))
    assert c.blocks["device"] + c.blocks["host"] + c.blocks["disk"] == sum(store.hits.values())
    files = sorted(os.listdir(tmp_path))
    assert len(files) == store.disk_writes > 0 and all(f.endswith(".pt") for f in files)
    assert served[-1].tiers[0] == "computed"  # repeated tokens at other positions: no hit


@pytest.mark.parametrize("name", list(grid.MODELS))
def test_offload_serves_every_grid_model_that_keeps_rows_and_refuses_the_rest(tmp_path, name):
    # MLA's two widths travel side by side in a block; a cache holding more than rows (a
    # recurrent state, indexer keys, compressed entries) is refused, the store and folder as
    # they were
    model = grid.MODELS[name].build(0).eval()
    store, turn = TieredStore(1, 1, str(tmp_path)), torch.arange(1, 10)
    prompts = [turn, torch.cat((turn, torch.tensor([3, 4]))), torch.cat((turn, turn))]
    kinds = {type(layer).__name__ for layer in model.new_cache(1).layers}
    if kinds <= set(ROW_LAYERS):
        c = check_offload(model, serve(model, prompts, 3, store, 4), 3)
        assert c.ok and c.blocks["computed"] > 0 and c.blocks["computed"] < sum(c.blocks.values())
    else:
        with pytest.raises(ValueError, match="offload reloads blocks of K/V rows; .* holds "
                           + ", ".join(sorted(kinds - set(ROW_LAYERS)))):
            serve(model, prompts, 3, store, 4)
        assert not store.device and not store.host and not os.listdir(tmp_path)


def test_a_key_that_ignores_the_parent_is_caught(tmp_path):
    model = build_model("llama")
    store = TieredStore(4, 4, str(tmp_path))
    served = multi_turn(model, store, block_size=4, max_new_tokens=3, hash_fn=parentless_hash)
    assert served[-1].tiers[0] != "computed"  # the collision: another prefix's K/V reloaded
    c = check_offload(model, served, 3)
    assert not c.logits_close and not c.ok


def test_bad_offload_input_is_refused_and_leaves_the_store_unchanged(tmp_path):
    with pytest.raises(ValueError, match="device_blocks must be a positive integer"):
        TieredStore(0, 4, str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        TieredStore(2, 2, str(tmp_path / "missing"))
    model, store = build_model("gpt2"), TieredStore(2, 2, str(tmp_path))
    good = torch.arange(1, 10)
    with pytest.raises(ValueError, match="non-empty 1-D tensor"):
        serve(model, [good, good[None]], 3, store, 4)
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        serve(model, [good, torch.ones(511, dtype=torch.long)], 3, store, 4)
    assert not store.device and not store.host and store.misses == 0


def test_the_roofline_break_even():
    roof = Roofline(peak_flops=1e15, hbm_bytes_per_s=4e12, link_bytes_per_s=5e10)
    shape = {"n_params": 8e9, "n_layer": 32, "n_head": 32, "n_kv_head": 8, "head_dim": 128,
             "bytes_per_element": 2}
    small = reload_or_recompute(**shape, tokens=16, offset=0, roof=roof)
    even = reload_or_recompute(**shape, tokens=16, offset=0,
                               roof=roof._replace(link_bytes_per_s=small.break_even_bytes_per_s))
    assert even.reload_s == pytest.approx(even.recompute_s)
    # many tokens per pass amortise the weights: recompute turns compute-bound, and reloading
    # over a slow link loses
    big = reload_or_recompute(**shape, tokens=4096, offset=0,
                              roof=roof._replace(link_bytes_per_s=1e9))
    assert big.recompute_s == pytest.approx((2 * 8e9 * 4096 + 4 * 32 * 32 * 128 * 4096 * 4097 / 2)
                                            / 1e15)
    assert not big.reload_wins
    with pytest.raises(ValueError, match="offset >= 0"):
        reload_or_recompute(**shape, tokens=16, offset=-1, roof=roof)
