"""The Gated DeltaNet hybrid (kvdoc.core.deltanet), its state cache (kvdoc.core.state) and its
match with transformers' Qwen3_5ForCausalLM (kvdoc.interop.hf_qwen35)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kvdoc.core.cache import DynamicLayer, KVCache, LayerSpec
from kvdoc.core.delta_rule import chunked_delta_rule, recurrent_delta_rule
from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder
from kvdoc.core.state import (
    StateSpec,
    hybrid_cache,
    read_state,
    restore,
    snapshot,
    update_state,
)
from kvdoc.proofs.grid import DELTANET

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
SPEC = StateSpec((("conv", (5, 2)), ("recurrent", (3, 4, 6))))


def _ids(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, DELTANET.vocab_size, (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def _fed(model, ids: torch.Tensor, lengths: list[int], cache: KVCache | None = None):
    cache = model.new_cache(ids.shape[0]) if cache is None else cache
    out, at = [], 0
    for n in lengths:
        logits, cache = model(ids[:, at:at + n], cache)
        out.append(logits)
        at += n
    return torch.cat(out, dim=1), cache


# --- the state layer -------------------------------------------------------------------------

def test_state_layer_bytes_do_not_grow_and_a_call_forks() -> None:
    cache = hybrid_cache((SPEC, LayerSpec(2, (4, 4))), batch_size=2)
    sizes = []
    for start, n in ((0, 3), (3, 1), (4, 7)):
        work = cache.begin()
        old = read_state(work, 0)
        update_state(work, 0, start, conv=old["conv"] + 1, recurrent=old["recurrent"] - 1)
        work.update(1, torch.ones(2, 2, n, 4), torch.ones(2, 2, n, 4), start)
        work.finish(start + n)
        # the caller's cache holds the state before the call, the fork the one after
        assert read_state(cache, 0)["conv"] is old["conv"] and cache.seq_len == start
        assert torch.equal(read_state(work, 0)["conv"], old["conv"] + 1)
        sizes.append(work.layers[0].nbytes())
        assert work.layers[0].nbytes() == work.layers[0].expected_nbytes(start + n)
        cache = work
    assert sizes == [4 * 2 * (5 * 2 + 3 * 4 * 6)] * 3
    assert cache.held(0) == range(11, 11) and cache.held(1) == range(11)


def test_state_layer_refuses_bad_writes_and_leaves_state() -> None:
    cache = hybrid_cache((SPEC,), batch_size=1)
    state = read_state(cache, 0)
    with pytest.raises(ValueError, match="holds \\['conv', 'recurrent'\\]"):
        update_state(cache, 0, 0, conv=state["conv"])
    with pytest.raises(ValueError, match="state 'conv' must be \\(1, 5, 2\\)"):
        update_state(cache, 0, 0, conv=torch.zeros(1, 5, 3), recurrent=state["recurrent"])
    with pytest.raises(ValueError, match="write starts at 2"):
        update_state(cache, 0, 2, **state)
    with pytest.raises(ValueError, match="keeps no K/V rows"):
        cache.update(0, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), 0)
    with pytest.raises(ValueError, match="not a state layer"):
        update_state(KVCache([DynamicLayer.empty(1, 2, (4, 4))]), 0, 0, **state)
    assert read_state(cache, 0)["conv"] is state["conv"]


def test_check_compatible_tells_a_state_from_kv() -> None:
    class Config:
        n_positions = 64
        cache_layout = (SPEC, LayerSpec(2, (4, 4)))

    cache = hybrid_cache(Config.cache_layout, 1)
    cache.check_compatible(Config, 1, torch.float32, torch.device("cpu"), 3)
    for layout in ((LayerSpec(2, (4, 4)),) * 2, (SPEC, SPEC),
                   (StateSpec((("conv", (5, 2)), ("recurrent", (3, 4, 5)))),
                    LayerSpec(2, (4, 4)))):
        Config.cache_layout = layout
        with pytest.raises(ValueError, match="cache was built for another model"):
            cache.check_compatible(Config, 1, torch.float32, torch.device("cpu"), 3)


def test_crop_refused_and_snapshot_restores() -> None:
    torch.manual_seed(0)
    model = DeltaNetDecoder(dataclasses.replace(DELTANET, chunk_size=4)).eval()
    ids, alt = _ids(2, 20), _ids(2, 20, seed=4)
    with torch.no_grad():
        _, cache = _fed(model, ids, [9])
        snap = snapshot(cache)
        _, cache = _fed(model, ids[:, 9:], [5, 1, 1], cache)
        held = [t.clone() for t in cache.tensors()]
        with pytest.raises(ValueError, match="cannot go back from 16 to 9 without a snapshot"):
            cache.crop(9)
        assert cache.seq_len == 16 and all(
            torch.equal(a, b) for a, b in zip(held, cache.tensors(), strict=True))
        assert cache.crop(16) is cache  # to where it is: nothing to undo
        restore(cache, snap)
        assert cache.seq_len == 9 and cache.held(0) == range(9) and cache.held(2) == range(9, 9)
        target = torch.cat((ids[:, :9], alt[:, 9:]), dim=1)
        got, _ = _fed(model, target[:, 9:], [4, 1, 6], cache)
        want = model(target).logits[:, 9:]
    assert (got - want).abs().max().item() < TOL[torch.float32] * want.abs().max().item()
    with pytest.raises(ValueError, match="cannot restore a cache of 9 positions to 16"):
        restore(cache, snap._replace(position=16))
    assert snap.nbytes() == 2 * 4 * 2 * (DELTANET.conv_dim * 2 + 6 * 6 * 10)


# --- the delta rule --------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_rule_equals_recurrent(chunk: int) -> None:
    g = torch.Generator().manual_seed(chunk)
    q, k = (torch.nn.functional.normalize(
        torch.randn(2, 3, 19, 5, generator=g, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(2, 3, 19, 7, generator=g, dtype=torch.float64)
    state = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64)
    decay = -3 * torch.rand(2, 3, 19, generator=g, dtype=torch.float64)
    beta = torch.rand(2, 3, 19, generator=g, dtype=torch.float64)
    out_c, s_c = chunked_delta_rule(q, k, v, decay, beta, state, chunk)
    out_r, s_r = recurrent_delta_rule(q, k, v, decay, beta, state)
    assert (out_c - out_r).abs().max().item() < 1e-12
    assert (s_c - s_r).abs().max().item() < 1e-12


def test_config_checks() -> None:
    assert DeltaNetConfig(n_layer=5).layer_types[1::2] == ("full_attention",) * 2
    for bad, match in (({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
                       ({"partial_rotary_factor": 0.1}, "RoPE rotates pairs"),
                       ({"layer_types": ("linear_attention",)}, "layer_types must be"),
                       ({"n_kv_head": 3}, "n_head=4 must be a multiple")):
        with pytest.raises(ValueError, match=match):
            DeltaNetConfig(**bad)


def test_model_refuses_padding_and_other_caches() -> None:
    model = DeltaNetDecoder(DELTANET).eval()
    ids = _ids(2, 4)
    with pytest.raises(ValueError, match="no attn_mask or positions"):
        model(ids, model.new_cache(2), attn_mask=torch.ones(2, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="cache is 'state'"):
        model.new_cache(2, "static")
    with pytest.raises(ValueError, match="cache was built for another model"):
        model(ids, KVCache([DynamicLayer.empty(2, 1, (12, 12))] * 3))


# --- transformers ----------------------------------------------------------------------------

def qwen35_model(config: DeltaNetConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
    """transformers' ``Qwen3_5ForCausalLM`` of ``config``. transformers starts every
    ``1 + weight`` RMSNorm at zero; these are drawn (as small as its other weights' spread), so
    that a q/k norm or a final norm loaded into the wrong place shows."""
    from kvdoc.interop.hf_config import random_model
    from kvdoc.interop.hf_qwen35 import qwen35_config

    hf = random_model(qwen35_config(config), seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if re.search(r"(layernorm|norm)\.weight$", name):
                p.add_(0.1 * torch.randn_like(p))
    return hf.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_transformers_full_and_cached(dtype: torch.dtype) -> None:
    from kvdoc.interop.hf_float64 import float64_islands_lifted
    from kvdoc.interop.hf_qwen35 import from_qwen35, to_qwen35

    hf = qwen35_model(DELTANET, seed=1, dtype=dtype)
    model = from_qwen35(hf, chunk_size=DELTANET.chunk_size)
    assert model.config == DELTANET and model.wte.weight.dtype == dtype
    ids = _ids(2, 30)
    with torch.no_grad(), float64_islands_lifted(hf):
        want = hf(ids).logits
    with torch.no_grad():
        full = model(ids).logits
        cached, cache = _fed(model, ids, [11, 7, 2] + [1] * 10)
        back = to_qwen35(model)(ids).logits
    tol = TOL[dtype] * want.abs().max().item()
    assert (full - want).abs().max().item() < tol
    assert (cached - want).abs().max().item() < tol
    assert cache.seq_len == 30 and cache.nbytes() == cache.expected_nbytes()
    with torch.no_grad():
        assert torch.equal(back, hf(ids).logits)  # the same weights, the same code


def test_float64_islands_matter_and_are_lifted() -> None:
    from kvdoc.interop.hf_float64 import float64_islands_lifted
    from kvdoc.interop.hf_qwen35 import from_qwen35

    hf = qwen35_model(DELTANET, dtype=torch.float64)
    ids = _ids(1, 20)
    with torch.no_grad():
        ours = from_qwen35(hf)(ids).logits
        plain = hf(ids).logits
        with float64_islands_lifted(hf):
            lifted = hf(ids).logits
        again = hf(ids).logits
    assert (plain - ours).abs().max().item() > 1e-9  # transformers' float32 islands show
    assert (lifted - ours).abs().max().item() < 1e-12
    assert torch.equal(again, plain)  # the block restores transformers' own code


def test_qwen3_next_dense_loads_and_moe_is_refused_by_name() -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from kvdoc.interop.hf_qwen35 import config_from_qwen35, from_qwen35, qwen35_config

    with pytest.raises(ValueError, match=r"qwen3_next layers \[0, 1\] are sparse mixtures"):
        config_from_qwen35(Qwen3NextConfig(num_hidden_layers=2))
    fields = qwen35_config(DELTANET).to_dict()
    same = {k: fields[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
        "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "layer_types")}
    torch.manual_seed(0)
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**same, num_experts=0)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):  # off zero, so a misplaced norm shows
                p.add_(0.1 * torch.randn_like(p))
    model = from_qwen35(hf, chunk_size=DELTANET.chunk_size)
    assert model.config == DELTANET
    ids = _ids(2, 20)
    with torch.no_grad():
        want = hf(ids).logits
        cached, _ = _fed(model, ids, [9, 4] + [1] * 7)
    assert (cached - want).abs().max().item() < TOL[torch.float32] * want.abs().max().item()


# --- the grid --------------------------------------------------------------------------------

def test_grid_passes_and_catches_the_broken_states() -> None:
    from kvdoc.proofs.suite import run_suite
    from kvdoc.proofs.variants import VARIANTS

    few = dict(models=("deltanet",), dtypes=(torch.float64,), length=30, chunks=(1, 13))
    report = run_suite(**few, scenarios=("stream", "crop", "bytes", "padded"))
    assert report.passed, report.failures_table()
    crops = report.select("crop")  # refused, then restored from a snapshot, on every kind
    assert {r.kind for r in crops} == {"state", "paged", "shared-prefix"}
    assert all(r.passed for r in crops)
    state_variants = [n for n, v in VARIANTS.items() if "state" in v.needs]
    assert len(state_variants) >= 2
    for name in state_variants:
        assert not run_suite(name, **few, scenarios=("stream",)).passed, name
