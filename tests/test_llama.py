"""The Llama-style decoder: RoPE (K cached rotated), GQA/MQA, RMSNorm, SwiGLU, tied head."""

import pytest
import torch

from kvdoc import Decoder
from kvdoc.core.model import apply_rope, llama_config, rope_angles
from kvdoc.proofs.compare import TOLERANCE, run_cached
from kvdoc.proofs.variants import VARIANTS


def make(dtype=torch.float32, **overrides) -> Decoder:
    torch.manual_seed(0)
    return Decoder(llama_config(**overrides)).to(dtype).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))


def test_rope_scores_depend_only_on_the_distance():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64) for _ in range(2))
    scores = [(apply_rope(q, m) * apply_rope(k, m - 3)).sum().item() for m in (3, 10, 200)]
    assert scores[0] == pytest.approx(scores[1], abs=1e-12)
    assert scores[0] == pytest.approx(scores[2], abs=1e-12)
    assert (q * k).sum().item() != pytest.approx(scores[0], abs=1e-3)  # distance 3 does turn it


def test_rope_of_a_chunk_is_rope_at_its_absolute_positions():
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(1))
    whole = apply_rope(x, 0)
    torch.testing.assert_close(apply_rope(x[:, :, 4:], 4), whole[:, :, 4:], atol=1e-6, rtol=1e-6)
    assert torch.equal(rope_angles(torch.arange(4, 7), 16), rope_angles(torch.arange(7), 16)[4:])


def test_the_cache_holds_rotated_keys(ids):
    """Layer 0's cached K is the rotated projection: c_attn's K columns turned at 0 .. T - 1."""
    model = make()
    seen = {}
    handle = model.h[0].attn.c_attn.register_forward_hook(
        lambda m, i, out: seen.setdefault("qkv", out))
    with torch.no_grad():
        _, cache = model(ids, model.new_cache(2))
    handle.remove()
    cfg = model.config
    B, T, _ = seen["qkv"].shape
    k_columns = seen["qkv"][..., cfg.n_embd:cfg.n_embd + cfg.kv_dim]  # [B, T, H_kv * D_h]
    raw_k = k_columns.view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
    torch.testing.assert_close(cache.layer(0)[0], apply_rope(raw_k, 0), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(cache.layer(0)[0], raw_k, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("overrides", [dict(n_kv_head=4), dict(n_kv_head=2), dict(n_kv_head=1),
                                       dict(tie_word_embeddings=True)],
                         ids=["mha", "gqa", "mqa", "tied"])
def test_cached_equals_full(ids, dtype, overrides):
    model = make(dtype, **overrides)
    with torch.no_grad():
        full = model(ids).logits
    for kind in ("dynamic", "static"):
        for chunk in (1, 5, [17, 1, 22]):
            torch.testing.assert_close(run_cached(model, ids, chunk, kind).logits, full,
                                       atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_gqa_divides_cache_bytes(ids, n_kv_head):
    model = make(n_kv_head=n_kv_head)
    cache = run_cached(model, ids, 8).cache
    cfg = model.config
    assert cache.nbytes() == 2 * cfg.n_layer * 2 * n_kv_head * ids.shape[1] * cfg.head_dim * 4
    # [B, H_kv, T, D_h]
    assert tuple(cache.layer(1)[0].shape) == (2, n_kv_head, ids.shape[1], cfg.head_dim)


def test_tied_head_shares_the_embedding():
    tied, untied = make(tie_word_embeddings=True), make()
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 97 * 64
    assert tied.wpe is None


ROPE_VARIANTS = {n: v for n, v in VARIANTS.items() if v.bug_class == "rotary positions"}


@pytest.mark.parametrize("name", sorted(ROPE_VARIANTS))
def test_rope_broken_variants_are_caught(ids, name):
    model = make()
    broken = ROPE_VARIANTS[name].build(model)
    with torch.no_grad():
        full = model(ids).logits
        # one call from position 0: correct
        torch.testing.assert_close(broken(ids).logits, full, atol=1e-5, rtol=1e-5)
    for chunk in (1, 5):
        assert not torch.allclose(run_cached(broken, ids, chunk).logits, full, atol=1e-5, rtol=1e-5)


def test_rope_variants_need_a_rope_model():
    torch.manual_seed(0)
    gpt2 = Decoder().eval()
    for variant in ROPE_VARIANTS.values():
        with pytest.raises(ValueError, match="position='rope'"):
            variant.build(gpt2)
