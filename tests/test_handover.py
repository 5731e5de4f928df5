"""The prefill/decode hand-over: equal to one process, bytes equal to the formula, bad payloads
refused with ValueError."""

import io

import pytest
import torch

from kvdoc.core.cache import DynamicCache
from kvdoc.core.model import GPTConfig
from kvdoc.proofs import grid
from kvdoc.proofs.compare import default_model
from kvdoc.proofs.traits import grid_traits
from kvdoc.serving.handover import disaggregated_generate, pack, unpack
from kvdoc.teach.broken_shown import pack_off_by_one, pack_zeroed_last_v
from kvdoc.teach.handover_checks import PAYLOAD_DTYPES, check_dtypes, check_handover

PROMPT = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 11]])


@pytest.fixture(scope="module")
def model():
    return default_model()


def test_cross_process_equals_one_process(model):
    # the one test that pays for a spawned process (~3 s)
    check = check_handover(model, PROMPT, 4, in_process=False)
    assert check.passed, check


@pytest.mark.parametrize("config", [GPTConfig(), GPTConfig(n_kv_head=2)])
def test_equal_in_fp32_and_fp64(config):
    checks = check_dtypes(default_model(config=config), PROMPT, 5)
    assert [c.dtype for c in checks] == ["FP32", "FP64"]
    for c in checks:
        assert c.passed, c
        # 2 x layers x B x H_kv x T x D_h x element size, as numbers, not the function
        assert c.kv_bytes == 2 * 2 * 2 * config.n_kv_head * 5 * 16 * (4 if c.dtype == "FP32"
                                                                       else 8)


def test_broken_packers_are_caught(model):
    off = check_handover(model, PROMPT, 4, packer=pack_off_by_one)
    assert not off.bytes_match and not off.passed
    zeroed = check_handover(model, PROMPT, 4, packer=pack_zeroed_last_v)
    assert zeroed.bytes_match and not zeroed.logits_close and not zeroed.passed


def _prefilled(model, length=3):
    logits, cache = model(PROMPT[:, :length], model.new_cache(2), last_only=True)
    return cache, logits


def test_round_trip_is_exact(model):
    cache, logits = _prefilled(model)
    back, back_logits = unpack(pack(cache, logits), model.config, torch.float32)
    assert torch.equal(back_logits, logits)
    for i in range(model.config.n_layer):
        assert all(torch.equal(a, b) for a, b in zip(back.layer(i), cache.layer(i), strict=True))


def test_static_cache_ships_only_held_rows(model):
    static = model.new_cache(2, "static", capacity=32)
    _, static = model(PROMPT[:, :3], static)
    back, _ = unpack(pack(static), model.config)
    assert back.seq_len == 3 and back.nbytes() == static.nbytes() * 3 // 32


@pytest.mark.parametrize("config, dtype, match", [
    (GPTConfig(n_layer=3), None, "another model"),
    (GPTConfig(n_kv_head=2), None, "another model"),
    (GPTConfig(n_embd=128), None, "another model"),  # head size 32
    (GPTConfig(), torch.float64, "dtype"),
    (GPTConfig(n_positions=2), None, "positions"),
    (GPTConfig(vocab_size=50), None, "logits"),
])
def test_wrong_config_refused(model, config, dtype, match):
    cache, logits = _prefilled(model)
    with pytest.raises(ValueError, match=match):
        unpack(pack(cache, logits), config, dtype)


@pytest.mark.parametrize("cut", [0, 10, 0.5, -1])
def test_truncated_payload_refused(model, cut):
    payload = pack(*_prefilled(model))
    end = int(len(payload) * cut) if isinstance(cut, float) else cut
    with pytest.raises(ValueError, match="not a hand-over payload"):
        unpack(payload[:end], model.config)


def test_tensor_shapes_checked_against_stated_sizes(model):
    # right header, last layer's V one position short: refused, nothing built
    body = torch.load(io.BytesIO(pack(*_prefilled(model))), weights_only=True)
    body["v"][-1] = body["v"][-1][:, :, :-1].clone()
    buffer = io.BytesIO()
    torch.save(body, buffer)
    with pytest.raises(ValueError, match="must hold 2 K and 2 V tensors"):
        unpack(buffer.getvalue(), model.config)


def test_window_cache_refused():
    model = default_model(config=GPTConfig(sliding_window=4))
    _, cache = model(PROMPT, model.new_cache(2, "window"))
    with pytest.raises(ValueError, match="every position"):
        pack(cache)


def test_no_logits_no_decode(model):
    with pytest.raises(ValueError, match="no next-token logits"):
        disaggregated_generate(model, PROMPT, 2, in_process=True,
                               packer=lambda cache, logits: pack(cache))


# --- every decoder of the grid: RoPE, a window, Gemma's hybrid layers, MLA's latent -----------

@pytest.fixture(scope="module")
def grid_models():
    return {name: grid.MODELS[name].build(0) for name in ("llama", "mla")}


HANDED = [name for name in grid.MODELS if name != "gemma3-global-first"
          and not grid_traits(name) & {"state", "indexed", "compressed"}]
"""Formerly verify's ``handover`` scenario (it never varied by cache kind): every grid model but
the global-first Gemma one, which only the checks that see a layer's type run, and those whose
cache holds more than the packer's two tensors a layer (a recurrent state, an indexed layer's
indexer keys, a V4 layer's pooled entries and block buffer); ``deep``, twelve layers, for a
packer that orders them by name."""


def _prompt(model):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, model.config.vocab_size, (2, 21), generator=g)  # past the window


@pytest.mark.parametrize("name", HANDED)
def test_every_model_hands_over_in_every_payload_dtype(name):
    model, dtypes = grid.MODELS[name].build(0), (torch.float32, *PAYLOAD_DTYPES)
    checks = check_dtypes(model, _prompt(model), 4, dtypes)
    assert [c.dtype for c in checks] == ["FP32", "FP64", "BF16", "FP16"]
    assert all(c.passed for c in checks), checks
    for broken in (pack_off_by_one, pack_zeroed_last_v):
        assert not check_handover(model, _prompt(model), 4, packer=broken).passed


def pack_layers_by_name(cache, logits=None):
    """BROKEN (verify's former variant handover-layers-by-name): the layers go out in the order
    of their names, ``0, 1, 10, 11, 2, ..``."""
    order = sorted(range(cache.n_layer), key=str)
    return pack(DynamicCache([cache.layer(i) for i in order]), logits)


def test_layers_packed_in_the_order_of_their_names_are_caught_past_ten_layers():
    deep = grid.MODELS["deep"].build(0)
    assert not check_handover(deep, _prompt(deep), 4, packer=pack_layers_by_name).passed
    llama = grid.MODELS["llama"].build(0)  # one layer: the order cannot show
    assert check_handover(llama, _prompt(llama), 4, packer=pack_layers_by_name).passed


def test_an_mla_payload_holds_the_latent(grid_models):
    model = grid_models["mla"]
    c = model.config
    _, cache = model(PROMPT, model.new_cache(2))
    back, _ = unpack(pack(cache), c)
    assert [tuple(t.shape) for t in back.layer(0)] == [(2, 1, 5, c.kv_lora_rank),
                                                       (2, 1, 5, c.qk_rope_head_dim)]
    with pytest.raises(ValueError, match="another model"):  # a latent is not K/V of a K/V model
        unpack(pack(cache), grid_models["llama"].config)


def test_every_payload_dtype_ships_bit_for_bit(model):
    checks = check_dtypes(model, PROMPT, 4, PAYLOAD_DTYPES)
    assert [c.dtype for c in checks] == ["FP64", "BF16", "FP16"]
    assert all(c.passed and c.same_bits for c in checks), checks


def pack_through_fp32(cache, logits=None) -> bytes:
    """BROKEN: K, V and the logits go through FP32 (a transfer buffer of one dtype) and back:
    exact in FP32 and narrower, FP64's low bits lost."""
    def wire(t: torch.Tensor) -> torch.Tensor:
        return t.float().to(t.dtype)

    layers = [tuple(map(wire, cache.layer(i))) for i in range(cache.n_layer)]
    return pack(DynamicCache(layers), None if logits is None else wire(logits))


def test_a_payload_through_fp32_is_caught_in_fp64_only(model):
    # verify's former variant handover-through-fp32
    checks = check_dtypes(model, PROMPT, 4, (torch.float32, *PAYLOAD_DTYPES),
                          packer=pack_through_fp32)
    assert {c.dtype: c.passed for c in checks} == {"FP32": True, "FP64": False, "BF16": True,
                                                   "FP16": True}
    fp64 = checks[1]
    assert fp64.bytes_match and not fp64.same_bits
