"""The sliding-window ring cache against a windowed full forward, over streams past the window."""

import dataclasses

import pytest
import torch

from kvdoc import Decoder
from kvdoc.core.feed import feed
from kvdoc.core.model import apply_rope, llama_config, mistral_config
from kvdoc.core.window import WindowLayer, window_cache
from kvdoc.proofs.compare import TOLERANCE, run_cached

W, T = 32, 100


def make(dtype=torch.float32, window=W) -> Decoder:
    torch.manual_seed(0)
    return Decoder(mistral_config(sliding_window=window)).to(dtype).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 5, 31, 32, 33, 70, [3, 40, 1, 56]])
def test_window_cache_equals_windowed_full_forward(ids, dtype, chunk):
    model = make(dtype)
    with torch.no_grad():
        full = model(ids).logits  # no cache: the offset mask with the window
    run = run_cached(model, ids, chunk, "window")
    torch.testing.assert_close(run.logits, full, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert run.cache.seq_len == T and list(run.cache.held()) == list(range(T - W, T))


def test_the_window_matters(ids):
    """Same weights without the window: equal before position W, different after (it can fail)."""
    windowed = make()
    unwindowed = Decoder(dataclasses.replace(windowed.config, sliding_window=None)).eval()
    unwindowed.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        a, b = windowed(ids).logits, unwindowed(ids).logits
    torch.testing.assert_close(a[:, :W], b[:, :W], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, W:], b[:, W:], atol=1e-4, rtol=1e-4)


def test_memory_stops_at_w_rows_and_the_cache_passed_in_keeps_its_rows(ids):
    model = make()
    cache = model.new_cache(2)
    assert [layer.window for layer in cache.layers] == [W] * model.config.n_layer
    cfg = model.config
    row = 2 * cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * 4  # K, V x L x B x H_kv x D_h x 4

    def check(start, n, before, after):
        assert after.nbytes() == row * min(start + 1, W)  # grows to W rows, then stays there
        assert list(after.held()) == list(range(max(0, start + 1 - W), start + 1))
        assert before.seq_len == start and before.nbytes() == row * min(start, W)

    feed(model, ids[:, :T], cache, 1, hook=check)


def test_a_call_copies_each_held_row_once():
    """The rows kept are a view of what the attention read: no second copy of the window."""
    layer = WindowLayer.empty(batch_size=1, heads=2, widths=(4, 4), window=3)
    rows = torch.randn(1, 2, 5, 4)
    layer.write(rows, rows, start=0)
    one = torch.randn(1, 2, 1, 4)
    k, _ = layer.write(one, one, start=5)
    assert k.shape[2] == 3 and layer.k.data_ptr() == k[:, :, -3:].data_ptr()
    long = torch.randn(1, 2, 7, 4)  # past 2W rows: the kept rows are copied out of the chunk
    k, _ = layer.write(long, long, start=6)
    assert layer.k.untyped_storage().nbytes() == 3 * 2 * 4 * 4
    torch.testing.assert_close(layer.k, long[:, :, -3:], rtol=0, atol=0)


def test_layer_holds_the_last_w_rotated_keys_in_order(ids):
    """What the ring holds equals the full forward's rotated K and V at the held positions."""
    model = make()
    cfg = model.config
    captured = []

    def rotated_k(module, inputs, out):  # c_attn's K columns, turned at positions 0 .. T - 1
        k = out[..., cfg.n_embd:cfg.n_embd + cfg.kv_dim]  # [B, T, H_kv * D_h]
        k = k.unflatten(-1, (cfg.n_kv_head, cfg.head_dim)).transpose(1, 2)  # [B, H_kv, T, D_h]
        captured.append(apply_rope(k, 0, cfg.rope_theta))

    handles = [b.attn.c_attn.register_forward_hook(rotated_k) for b in model.h]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    run = run_cached(model, ids, 7, "window")
    assert len(captured) == cfg.n_layer
    for layer, k_full in enumerate(captured):
        k, v = run.cache.layer(layer)
        torch.testing.assert_close(k, k_full[:, :, T - W:], atol=1e-5, rtol=1e-5)
        assert tuple(v.shape) == (2, cfg.n_kv_head, W, cfg.head_dim)


def test_a_forward_call_leaves_the_cache_passed_in_unchanged(ids):
    model = make()
    with torch.no_grad():
        _, cache = model(ids[:, :50], model.new_cache(2))
        before = [tuple(t.clone() for t in cache.layer(i)) for i in range(2)]
        _, after = model(ids[:, 50:53], cache)
    assert cache.seq_len == 50 and after.seq_len == 53
    for i in range(2):
        for old, now in zip(before[i], cache.layer(i), strict=True):
            assert torch.equal(old, now)


def test_window_cache_refuses_what_it_cannot_serve():
    torch.manual_seed(0)
    no_window = Decoder(llama_config()).eval()
    with pytest.raises(ValueError, match="needs a model with sliding windows"):
        no_window.new_cache(1, "window")
    small = window_cache(mistral_config(sliding_window=8), 1)
    with pytest.raises(ValueError, match="cannot serve"):
        small.check_compatible(make().config, 1, torch.float32, torch.device("cpu"), 1)
    cache = make().new_cache(1)
    with pytest.raises(ValueError, match="write starts at 3"):
        cache.update(0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 3)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        window_cache(mistral_config(), 1, window=0)


def test_dynamic_and_static_caches_also_serve_a_windowed_model(ids):
    model = make()
    with torch.no_grad():
        full = model(ids).logits
    for kind in ("dynamic", "static"):
        cached = run_cached(model, ids, 9, kind).logits
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 2, 3])
def test_tiny_windows(window):
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    model = make(window=window)
    with torch.no_grad():
        full = model(ids).logits
    for chunk in (1, 2, 7):
        run = run_cached(model, ids, chunk, "window")
        torch.testing.assert_close(run.logits, full, atol=1e-5, rtol=1e-5)
        assert run.cache.layer(0)[0].shape[2] == window
