"""The Mamba-2 hybrid (kvdoc.core.mamba2) against transformers' Bamba and against itself: the
chunked and recurrent SSD forms, full forward and cached path in FP32 and FP64, the state's
bytes and crop, bad input, and why transformers' own decode steps depart from its forward."""

import dataclasses
import math

import pytest
import torch

from kvdoc.core.feed import feed
from kvdoc.core.mamba2 import Mamba2Config, MambaDecoder, ssd_chunked, ssd_step
from kvdoc.core.state import read_state, restore, snapshot
from kvdoc.interop.hf_bamba import bamba_config, config_from_bamba, from_bamba, to_bamba
from kvdoc.interop.hf_float64 import float64_islands_lifted
from kvdoc.proofs import grid
from kvdoc.proofs.broken.recurrent import conv_state_shifted, undecayed_carry
from kvdoc.proofs.compare import TOLERANCE, close, max_abs

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is faster

DTYPES = (torch.float32, torch.float64)
CHUNKS = (1, 5, [20, 5, 13, 1, 1, 1, 2, 24])  # steps; chunks; a prefill, chunks, then steps


@pytest.fixture(scope="module")
def models():
    # sizes off every default, weights off transformers' init
    return {dt: grid.MODELS["bamba"].build(0).to(dt) for dt in DTYPES}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, grid.MAMBA2.vocab_size, (2, 67),
                         generator=torch.Generator().manual_seed(7))


def hf_logits(hf, ids, **kwargs):
    with torch.no_grad(), float64_islands_lifted(hf):
        return hf(ids, **kwargs)


# --- the SSD, two ways --------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 3, 4, 9, 20])
def test_the_chunked_form_is_the_recurrence(chunk):
    g = torch.Generator().manual_seed(chunk)
    b, T, H, P, N = 2, 9, 4, 3, 5

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, B, C, s0 = rand(b, T, H, P), rand(b, T, H, N), rand(b, T, H, N), rand(b, H, P, N)
    dt = torch.rand(b, T, H, generator=g, dtype=torch.float64) * 2
    A, D = -torch.rand(H, generator=g, dtype=torch.float64) * 3, rand(H)
    y, s = ssd_chunked(x, dt, A, B, C, D, s0, chunk)
    ys, state = [], s0
    for t in range(T):
        y_t, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], D, state)
        ys.append(y_t)
    assert close(y, torch.stack(ys, dim=1), 1e-12) and close(s, state, 1e-12)
    if chunk < T:  # the carry between chunks, which the broken variant does not decay
        assert not close(undecayed_carry(x, dt, A, B, C, D, s0, chunk)[0], y, 1e-3)


def test_a_decode_step_keeps_the_last_inputs_of_the_convolution(models):
    model = models[torch.float64]
    ids = torch.tensor([[5, 17, 3, 44, 8, 61, 2]])
    found = []
    mixer = model.h[0].mamba
    handle = mixer.in_proj.register_forward_hook(lambda m, i, o: found.append(o))
    with torch.no_grad():
        _, cache = model(ids, model.new_cache(1))
    handle.remove()
    c = model.config
    xBC = found[0][..., c.mamba_inner:c.mamba_inner + c.conv_dim]  # [1, T, conv_dim]
    want = xBC[:, -(c.mamba_d_conv - 1):].transpose(1, 2)
    assert torch.equal(read_state(cache, 0)["conv"], want)
    with torch.no_grad():
        _, shifted = conv_state_shifted(model)(ids, model.new_cache(1))
    assert not torch.equal(read_state(shifted, 0)["conv"], want)


# --- against transformers and against itself -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_full_forward_and_every_cached_path_match_transformers(models, ids, dtype):
    model, tol = models[dtype], TOLERANCE[dtype]
    hf = to_bamba(model)
    with torch.no_grad():
        full = model(ids).logits
        theirs = hf_logits(hf, ids).logits
        assert close(full, theirs, tol), max_abs(full, theirs)
        for chunk in CHUNKS:
            run = feed(model, ids, model.new_cache(2), chunk)
            assert close(run.logits, full, tol), (chunk, max_abs(run.logits, full))
            assert close(run.logits, theirs, tol), (chunk, max_abs(run.logits, theirs))
    assert all(torch.equal(a, b) for a, b in zip(from_bamba(hf).state_dict().values(),
                                                 model.state_dict().values(), strict=True))


def _steps(hf, ids, prompt, **per_step):
    """transformers' prefill of ``prompt`` tokens, then one-token steps: logits [B, T - P, V]."""
    out = hf_logits(hf, ids[:, :prompt], use_cache=True)
    cache, got = out.cache, []
    for t in range(prompt, ids.shape[1]):
        kwargs = {k: f(t) for k, f in per_step.items()}
        out = hf_logits(hf, ids[:, t:t + 1], cache=cache, use_cache=True, **kwargs)
        cache = out.cache
        got.append(out.logits)
    return torch.cat(got, dim=1)


def test_transformers_own_decode_steps_turn_rope_at_position_zero(models, ids):
    """What issue 47 measured (FP64, ~1e-3 from the first step, prefill exact): transformers
    5.24.0's ``BambaModel.forward`` (models/bamba/modeling_bamba.py) defaults ``position_ids`` to
    ``torch.arange(inputs_embeds.shape[1])`` with no cached length added (Llama's adds
    ``past_seen_tokens``), so a step called without positions turns Q and K at 0. With them, and
    its float32 islands lifted, its steps agree to FP64 rounding. A second departure, where
    ``time_step_limit`` binds: ``mamba2_chunk_scan`` clamps ``dt`` to it, while the recurrent
    branch of ``BambaMixer.forward`` calls ``mamba2_selective_state_update`` without it."""
    model, ids, prompt = models[torch.float64], ids[:, :30], 20
    tol = TOLERANCE[torch.float64]
    unbound = MambaDecoder(dataclasses.replace(grid.MAMBA2, time_step_limit=(0.0, math.inf)))
    unbound.load_state_dict(model.state_dict())
    for ours, limit_binds in ((unbound.to(torch.float64).eval(), False), (model, True)):
        hf = to_bamba(ours)
        full = hf_logits(hf, ids).logits[:, prompt:]
        bare = _steps(hf, ids, prompt)
        positioned = _steps(hf, ids, prompt, position_ids=lambda t: torch.tensor([[t]]))
        assert max_abs(bare[:, :1], full[:, :1]) > 1e-4  # from the first step
        assert close(positioned, full, tol) != limit_binds, max_abs(positioned, full)
        with torch.no_grad():  # kvdoc's steps: its own forward, and transformers'
            run = feed(ours, ids, ours.new_cache(2), [prompt] + [1] * (ids.shape[1] - prompt))
        assert close(run.logits[:, prompt:], full, tol)


# --- the cache: a state that does not grow, cannot be cropped, is restored ----------------------

def test_state_bytes_stay_while_kv_bytes_grow_and_a_crop_needs_a_snapshot(models, ids):
    model = models[torch.float32]
    c, cache = model.config, model.new_cache(2)
    state = [i for i, t in enumerate(c.layer_types) if t == "linear_attention"]
    per_layer = 2 * 4 * (c.conv_dim * (c.mamba_d_conv - 1)
                         + c.mamba_n_heads * c.mamba_head_dim * c.mamba_d_state)
    kv_row = 2 * 2 * c.n_kv_head * c.head_dim * 4  # K and V, batch 2, FP32
    with torch.no_grad():
        for n in (1, 9, 30):
            _, cache = model(ids[:, cache.seq_len:n], cache)
            assert [cache.layers[i].nbytes() for i in state] == [per_layer] * len(state)
            assert cache.nbytes() == len(state) * per_layer + n * kv_row
        snap = snapshot(cache)
        _, cache = model(ids[:, 30:40], cache)
        before = {k: v.clone() for k, v in read_state(cache, 0).items()}
        with pytest.raises(ValueError, match="cannot go back from 40 to 30"):
            cache.crop(30)
        assert cache.seq_len == 40 and torch.equal(read_state(cache, 0)["conv"], before["conv"])
        other = torch.cat((ids[:, :30], ids[:, 40:50]), dim=1)
        again = model(other[:, 30:], restore(cache, snap)).logits
    assert close(again, model(other).logits[:, 30:], TOLERANCE[torch.float32])


def test_bad_input_is_refused_before_any_write(models, ids):
    model = models[torch.float32]
    with torch.no_grad():
        _, cache = model(ids[:, :10], model.new_cache(2))
        before = {k: v.clone() for k, v in read_state(cache, 2).items()}
        with pytest.raises(ValueError, match="padded batches"):
            model(ids[:, 10:12], cache, attn_mask=torch.ones(2, 2, 12, dtype=torch.bool))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model(torch.full((2, 3), 999), cache)
        with pytest.raises(ValueError, match="batch size"):
            model(ids[:1, 10:12], cache)
    assert cache.seq_len == 10
    assert all(torch.equal(read_state(cache, 2)[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="cache is 'state'"):
        model.new_cache(2, "static")
    with pytest.raises(ValueError, match="another model"):
        model(ids[:, :3], grid.MODELS["llama"].build(0).new_cache(2))


def test_config_and_loader_refusals():
    with pytest.raises(ValueError, match="attn_layers must be increasing"):
        Mamba2Config(attn_layers=(2,))
    with pytest.raises(ValueError, match="mamba_n_heads=8 must be a multiple of mamba_n_groups=3"):
        Mamba2Config(mamba_n_groups=3)
    with pytest.raises(ValueError, match="mamba_d_conv must be an integer >= 2"):
        Mamba2Config(mamba_d_conv=1)
    assert config_from_bamba(bamba_config(grid.MAMBA2)) == grid.MAMBA2
    hf_config = bamba_config(grid.MAMBA2)
    hf_config.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias=True"):
        config_from_bamba(hf_config)
