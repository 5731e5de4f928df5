"""Sinks: gpt-oss's learned sink logit against transformers, split-K's merge with a sink, and
StreamingLLM's sink tokens (a different function, measured)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvdoc.core.gptoss import GptOssDecoder, sink_attention
from kvdoc.core.model import Decoder, llama_config
from kvdoc.core.streaming import SinkWindowLayer, stream_logits, streaming_decoder
from kvdoc.interop.hf_config import random_model
from kvdoc.interop.hf_gptoss import (
    config_from_gptoss,
    from_gptoss,
    gptoss_config,
    to_gptoss,
)
from kvdoc.measure.divergence import stream_divergence
from kvdoc.proofs.broken.arithmetic import merge_sink_per_split, sink_per_split, window_without_sink
from kvdoc.proofs.compare import TOLERANCE
from kvdoc.proofs.grid import SINKS, WINDOW
from kvdoc.proofs.suite import run_suite
from kvdoc.serving.splitk import all_partials, split_k_attention, split_k_decoder
from kvdoc.teach.crosscheck import lifted_logits

CHUNKS = [20, 5, 5, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # 41 positions in all
"""A prefill, chunks, then one-token steps: past the window of 16 twice."""


def _stream(batch: int = 2, length: int = sum(CHUNKS), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SINKS.vocab_size, (batch, length), generator=g)


def _cached(model, ids: torch.Tensor, chunks=CHUNKS, cache=None) -> torch.Tensor:
    cache, out, pos = cache or model.new_cache(ids.shape[0]), [], 0
    for n in chunks:
        logits, cache = model(ids[:, pos:pos + n], cache)
        out.append(logits)
        pos += n
    return torch.cat(out, dim=1)


def _tol(dtype: torch.dtype, reference: torch.Tensor) -> float:
    # FP64: 1e-12 of the logits' scale; FP32: the suite's 1e-5 (logits here are about 1 wide)
    scale = max(1.0, reference.abs().max().item())
    return (1e-12 if dtype == torch.float64 else TOLERANCE[torch.float32]) * scale


def gptoss_model(config, seed: int, dtype: torch.dtype):
    """transformers' ``GptOssForCausalLM`` of ``config`` with weights that make the sinks and
    the experts' clamp bite. transformers draws every matrix and sink with a standard deviation
    of 0.02 and the biases at 0: the clamp would never bite, attention would be nearly uniform
    and a sink left out would change little. So, as standard deviations about a mean of 0: the
    sinks are redrawn at 1, each matrix at ``fan_in ** -0.5``, the biases at 0.1, and the norms'
    weights at 0.2 about 1; the embedding (also the head, where tied) keeps 0.02."""
    hf = random_model(gptoss_config(config), seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
            elif p.dim() == 3:  # the experts' [E, in, out]
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif "embed_tokens" not in name and "lm_head" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return hf.to(dtype)


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["FP32", "FP64"])
def pair(request):
    """transformers' GptOssForCausalLM of the grid's sizes (all off the defaults), and kvdoc's
    model loaded from it."""
    hf = gptoss_model(SINKS, seed=3, dtype=request.param)
    return hf, from_gptoss(hf), lifted_logits(hf, _stream())


def test_the_grid_config_is_off_every_default():
    default = type(SINKS)()
    same = [f.name for f in dataclasses.fields(SINKS)
            if getattr(SINKS, f.name) == getattr(default, f.name) and f.name != "layer_types"]
    assert same == [], same
    assert SINKS.layer_windows == (WINDOW, None, WINDOW)


def test_full_and_cached_match_transformers(pair):
    hf, ours, want = pair
    dtype, ids = ours.wte.weight.dtype, _stream()
    tol = _tol(dtype, want)
    with torch.no_grad():
        full, cached = ours(ids).logits, _cached(ours, ids)
    assert (full - want).abs().max().item() <= tol
    assert (cached - want).abs().max().item() <= tol
    # the hybrid cache: window layers hold W rows, the full layer every position
    _, cache = ours(ids, ours.new_cache(2))
    assert [len(cache.held(i)) for i in range(3)] == [WINDOW, ids.shape[1], WINDOW]
    assert cache.nbytes() == sum(layer.expected_nbytes(ids.shape[1]) for layer in cache.layers)


def test_transformers_cached_path_matches_its_own_full_forward(pair):
    """Measured, not assumed: transformers 5.24's own cache fed the same chunks."""
    hf, _, want = pair
    ids = _stream()
    assert (lifted_logits(hf, ids, CHUNKS) - want).abs().max().item() <= _tol(hf.dtype, want)


def test_export_round_trips(pair):
    hf, ours, want = pair
    ids = _stream()
    assert torch.equal(lifted_logits(to_gptoss(ours), ids), want)
    assert config_from_gptoss(gptoss_config(SINKS)) == SINKS


def test_the_sinks_are_seen(pair):
    """A model whose sinks are -inf (plain softmax) departs from transformers: the comparison
    sees the sink."""
    _, ours, want = pair
    with torch.no_grad():
        err = (window_without_sink(ours)(_stream()).logits - want).abs().max().item()
    assert err > 1e3 * _tol(ours.wte.weight.dtype, want)


def test_unsupported_configs_are_refused():
    hf_config = gptoss_config(SINKS)
    hf_config.rope_parameters = {**hf_config.rope_parameters, "attention_factor": 2.0}
    with pytest.raises(ValueError, match="attention_factor"):
        config_from_gptoss(hf_config)
    with pytest.raises(ValueError, match="experts_per_token"):
        dataclasses.replace(SINKS, experts_per_token=6)


def test_bad_input_leaves_the_cache_as_it_was():
    torch.manual_seed(0)
    model = GptOssDecoder(SINKS).eval()
    ids = _stream(batch=1, length=20)
    _, cache = model(ids, model.new_cache(1))
    before = [t.clone() for t in cache.tensors()]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[1, SINKS.vocab_size]]), cache)
    assert cache.seq_len == 20
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors(), strict=True))


# --- split-K: the sink enters the merged denominator once ---------------------------------------

def _qkv(T: int, C: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, C, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 2, 3, T, 8, generator=g, dtype=torch.float64)
    return q, k, v, torch.randn(6, generator=g, dtype=torch.float64) * 2


@pytest.mark.parametrize("split", [1, 2, 5, 7, 40])
def test_split_k_with_a_sink_equals_unsplit_attention(split):
    q, k, v, sinks = _qkv(T=23)
    causal = torch.ones(3, 23, dtype=torch.bool).tril(diagonal=20)  # queries at 20, 21, 22
    window = causal & ~torch.ones(3, 23, dtype=torch.bool).tril(diagonal=20 - 6)  # a window of 6
    for mask in (None, causal, window):
        want = sink_attention(q, k, v, sinks, mask)
        got = split_k_attention(q, k, v, split, mask, sinks)
        assert (got - want).abs().max().item() <= 1e-12
        # a sink per split is another function wherever there is more than one chunk
        per_split = merge_sink_per_split(all_partials(q, k, v, split, mask), sinks)
        assert ((per_split - want).abs().max().item() > 1e-3) == (split < 23)


def test_a_row_reading_no_key_gives_zeros_with_a_sink():
    q, k, v, sinks = _qkv(T=10)
    hidden = torch.zeros(3, 10, dtype=torch.bool)
    assert split_k_attention(q, k, v, 4, hidden, sinks).abs().max().item() == 0.0
    with pytest.raises(ValueError, match="sinks must be"):
        split_k_attention(q, k, v, 4, None, sinks[:2])


def test_split_k_gptoss_decoder_equals_the_model():
    torch.manual_seed(0)
    model = GptOssDecoder(SINKS).double().eval()
    split = split_k_decoder(model, 5)
    ids = _stream()
    with torch.no_grad():
        full = model(ids).logits
        assert (split(ids).logits - full).abs().max().item() <= 1e-12
        assert (_cached(split, ids) - full).abs().max().item() <= 1e-12
        assert (sink_per_split(model)(ids).logits - full).abs().max().item() > 1e-3


# --- the grid: the models pass, the broken variants are caught ---------------------------------

@pytest.mark.parametrize("variant, caught_by", [("sink-per-split", {"logits", "reference"}),
                                                ("window-without-sink", {"reference"})])
def test_the_grid_catches_the_broken_sinks(variant, caught_by):
    report = run_suite(variant, kinds=("hybrid",), dtypes=(torch.float32,), length=40,
                       chunks=(1, 7), scenarios=("stream", "reference"))
    assert not report.passed
    # a sink per split is a different function of the chunking: full and cached differ too; a
    # window without its sink is one function everywhere, which only transformers tells apart
    assert caught_by <= set(report.failed_checks()) <= caught_by | {"kv"}
    assert {r.model for r in report.results} == {"gpt-oss"}


def test_the_grid_passes_the_sink_models():
    report = run_suite(models=("gpt-oss", "gpt-oss-split-k"), kinds=("hybrid",),
                       dtypes=(torch.float64,), length=40, chunks=(1, 7),
                       scenarios=("stream", "reference"))
    assert report.passed, report.failures_table()


# --- StreamingLLM: the first tokens kept beside a window; measured, not checked equal ----------

@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return Decoder(llama_config(vocab_size=89, n_layer=2)).double().eval()


def test_streaming_equals_full_attention_until_it_evicts(llama):
    ids = _stream(length=30)
    d = stream_divergence(llama, ids, sinks=3, window=8)
    assert d.evicts_at == 11
    assert d.before <= 1e-12  # every key still where it was
    assert d.after > 1e-3     # a different function from then on
    assert (d.per_position[:11] <= 1e-12).all() and (d.per_position[11:] > 1e-6).all()


def test_the_sink_window_layer_keeps_sinks_and_window(llama):
    streaming = streaming_decoder(llama, sinks=3, window=8)
    ids = _stream(length=30)
    _, cache = stream_logits(streaming, ids)
    layer = cache.layers[0]
    assert isinstance(layer, SinkWindowLayer)
    assert cache.held(0) == (0, 1, 2, *range(22, 30))
    assert cache.nbytes() == sum(la.expected_nbytes(30) for la in cache.layers)
    # the keys are stored before RoPE: the held rows are the projections of those tokens
    H, D = llama.config.n_head, llama.config.head_dim
    kv = llama.config.kv_dim
    with torch.no_grad():
        x = llama.h[0].ln_1(llama.wte(ids))
        k = llama.h[0].attn.c_attn(x)[..., H * D:H * D + kv]
    k = k.view(2, 30, -1, D).transpose(1, 2)[:, :, list(cache.held(0))]
    assert (layer.k - k).abs().max().item() <= 1e-12
    with pytest.raises(ValueError, match="sink-and-window cache"):
        streaming(ids)
    with pytest.raises(ValueError, match="RoPE Decoder without a window"):
        streaming_decoder(streaming, sinks=1, window=4)


def test_streaming_a_chunk_reads_every_held_row(llama):
    """A call of several tokens reads the held rows and the chunk: equal to one-token steps
    until the window fills."""
    streaming = streaming_decoder(llama, sinks=2, window=12)
    ids = _stream(length=14)
    stepped, _ = stream_logits(streaming, ids)
    chunked = _cached(streaming, ids, [9, 5])
    assert (chunked - stepped).abs().max().item() <= 1e-12
    assert math.isfinite(chunked.abs().max().item())
