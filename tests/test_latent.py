"""An MLA model's latent on two spawned ranks: replicated under TP, split by requests under
DP-attention, each against one process; the broken variants caught.

One launch (a module fixture) runs every job of the file: spawning ranks costs seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvdoc.core.model import Decoder, llama_config
from kvdoc.interop.hf_deepseek import published_config
from kvdoc.parallel.latent import (
    WIDE,
    LatentJob,
    RequestSplit,
    check_latent_job,
    latent_jobs,
    latent_model,
    latent_rank_bytes,
)
from kvdoc.proofs.broken.parallel import LATENT_BROKEN, query_at_lora_rank

PROMPTS = torch.randint(1, 97, (4, 6), generator=torch.Generator().manual_seed(3))
NEW = 4


@pytest.fixture(scope="module")
def results():
    model, wide = latent_model(), latent_model(config=WIDE)
    jobs = [LatentJob(mode, model, PROMPTS, NEW, mode) for mode in ("tp", "dp")]
    jobs.append(LatentJob("dp fp64", latent_model().double(), PROMPTS, NEW, "dp"))
    jobs += [LatentJob(f"wide {mode}", wide, PROMPTS, NEW, mode)
             for mode in ("tp", "dp")]
    jobs += [LatentJob(name, wide if b.widths_differ else model, PROMPTS, NEW, b.mode,
                       b.split, b.bytes_rule, b.heads)
             for name, b in LATENT_BROKEN.items()]
    # the mix-up where the query has no LoRA (the site's model) and where its rank
    # equals the key's non-rotary width (as in the grid's MLA, and verify's wide model)
    grid_like = latent_model(config=dataclasses.replace(WIDE, q_lora_rank=10))
    jobs += [LatentJob(f"query at lora rank, {name}", m, PROMPTS, NEW, "tp",
                       heads=query_at_lora_rank)
             for name, m in (("site", model), ("rank = d_nope", grid_like))]
    return {c.name: c for c in latent_jobs(jobs)}


@pytest.mark.parametrize("name", ["tp", "dp", "dp fp64", "wide tp", "wide dp"])
def test_both_layouts_equal_one_process(results, name):
    c = results[name]
    assert c.tokens_equal and c.logits_close and c.latent_close, c.lines()
    assert c.ok and len(c.bytes) == 2


def test_dp_attention_holds_one_rank_share_of_the_latent(results):
    tp, dp = results["tp"], results["dp"]
    fed = PROMPTS.shape[1] + NEW - 1
    cfg = latent_model().config
    whole = PROMPTS.shape[0] * fed * cfg.n_layer * cfg.latent_dim * 4  # FP32
    assert [m for m, _ in tp.bytes] == [whole, whole]  # measured: every rank holds it all
    assert [m for m, _ in dp.bytes] == [whole // 2, whole // 2]


def test_collectives_per_decode_step(results):
    layers = latent_model().config.n_layer
    assert results["tp"].collectives == {"all_reduce": 2 * layers, "broadcast": 1}
    assert results["dp"].collectives == {"all_gather": layers, "all_reduce": layers}


@pytest.mark.parametrize("name", list(LATENT_BROKEN))
def test_each_broken_variant_is_caught(results, name):
    c = results[name]
    assert not c.ok, c.lines()
    if name == "latent-bytes-once":  # decoding is right, only the bytes rule is wrong
        assert c.tokens_equal and c.latent_close
        assert all(m != f for m, f in c.bytes)
    else:
        assert not c.tokens_equal and not c.latent_close


def test_widths_that_differ_turn_a_mix_up_of_two_into_other_numbers(results):
    c = WIDE
    widths = [c.n_embd, c.n_inner, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
              c.qk_rope_head_dim, c.v_head_dim, c.qk_head_dim, c.latent_dim,
              c.qk_nope_head_dim + c.v_head_dim]
    assert len(set(widths)) == len(widths)
    # where d_nope = d_v the mix-up is the right split; where they differ it decodes
    # without raising, and only a comparison with one process shows it
    assert results["query at lora rank, site"].ok
    assert results["query at lora rank, rank = d_nope"].ok
    broken = results["latent-query-at-lora-rank"]
    assert not broken.logits_close and all(m == f for m, f in broken.bytes)


def test_deepseek_v3_bytes_per_rank():
    v3 = published_config("DeepSeek-V3")
    tp = latent_rank_bytes(v3, "tp", 8, 3, batch=64, seq_len=4096, dtype=torch.bfloat16)
    dp = latent_rank_bytes(v3, "dp", 8, 3, batch=64, seq_len=4096, dtype=torch.bfloat16)
    assert tp == 64 * 4096 * 61 * 576 * 2 and dp * 8 == tp


def test_requests_cover_the_batch_once():
    rows = [r for rank in range(4) for r in RequestSplit().requests(8, 4, rank)]
    assert rows == list(range(8))


@pytest.mark.parametrize(("job", "message"), [
    (LatentJob("x", latent_model(), PROMPTS[:3], NEW, "dp"), "splits the batch evenly"),
    (LatentJob("x", latent_model(), PROMPTS, NEW, "ep"), "unknown latent layout"),
    (LatentJob("x", Decoder(llama_config()), PROMPTS, NEW, "tp"), "takes an MLADecoder"),
    (LatentJob("x", latent_model(), PROMPTS, 0, "tp"), "max_new_tokens"),
])
def test_refused_before_any_rank_starts(job, message):
    with pytest.raises(ValueError, match=message):
        check_latent_job(job, 2)
    with pytest.raises(ValueError, match="must divide n_head"):
        check_latent_job(LatentJob("x", latent_model(), PROMPTS, NEW, "tp"), 3)
