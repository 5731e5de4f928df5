"""Each layer kind's byte formula (:mod:`kvdoc.measure.layer_caches`) against an independent
oracle: the bytes of the tensors transformers 5.24.0's own cache classes hold after a forward of
T tokens through a tiny random model of that family (sizes off every default), and the
``config.json`` transformers writes for each family read back by ``python -m kvdoc memory``."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from kvdoc.measure.layer_caches import (  # noqa: E402
    LayerCache,
    attention_layer,
    compressed_layer,
    gated_delta_layer,
    indexed_mla_layer,
    mamba2_layer,
)
from kvdoc.measure.model_caches import read_config  # noqa: E402

LENGTHS = (1, 2, 3, 5, 7, 11)


def _held(layer: object) -> tuple[int, int]:
    """Bytes a transformers cache layer holds, apart: in the model's dtype and in FP32 beside
    it (a tensor that shares another's storage counted once; shape scalars not at all)."""
    seen, dtype_bytes, fp32_bytes = set(), 0, 0
    for name, value in vars(layer).items():
        values = value.values() if isinstance(value, dict) else [value]
        for t in values:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            if t.dtype == torch.float32 and name == "recurrent_states":
                fp32_bytes += t.numel() * 4
            else:
                dtype_bytes += t.numel() * t.element_size()
    return dtype_bytes, fp32_bytes


def _cache_after(model: object, T: int, dtype: torch.dtype) -> list[object]:
    torch.manual_seed(T)
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    with torch.no_grad():
        return model.to(dtype)(ids, use_cache=True).past_key_values.layers


def _check(model: object, want: list[LayerCache], lengths=LENGTHS,
           window_rows: int | None = None) -> None:
    """At every length, every layer's bytes equal the formula's, in BF16 (the recurrent state
    in FP32) and in FP32. transformers keeps ``W - 1`` rows of a window (the next call brings
    the W-th); the formula counts the ``W`` a decode step reads, so it is evaluated at
    ``window_rows``."""
    model.eval()
    for dtype, s in ((torch.bfloat16, 2), (torch.float32, 4)):
        for T in lengths:
            layers = _cache_after(model, T, dtype)
            assert len(layers) == len(want)
            for i, (got, layer) in enumerate(zip(layers, want, strict=True)):
                if window_rows is not None and layer.window is not None:
                    layer = layer._replace(window=window_rows)
                expect = (s * layer.elements(T), 4 * layer.state32)
                assert _held(got) == expect, (type(got).__name__, i, T, dtype)


def test_gated_delta_net_layers_of_qwen3_5() -> None:
    c = tf.Qwen3_5TextConfig(vocab_size=50, hidden_size=24, intermediate_size=40,
                             num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1,
                             head_dim=10, linear_conv_kernel_dim=3, linear_key_head_dim=6,
                             linear_value_head_dim=5, linear_num_key_heads=2,
                             linear_num_value_heads=4)
    delta = gated_delta_layer(2, 4, 6, 5, 3)
    _check(tf.Qwen3_5ForCausalLM(c), [delta] * 3 + [attention_layer(1, 10)])


def test_gated_delta_net_layers_of_qwen3_next() -> None:
    c = tf.Qwen3NextConfig(vocab_size=50, hidden_size=24, intermediate_size=40,
                           num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
                           head_dim=10, linear_conv_kernel_dim=3, linear_key_head_dim=6,
                           linear_value_head_dim=5, linear_num_key_heads=2,
                           linear_num_value_heads=4, num_experts=2, num_experts_per_tok=1,
                           moe_intermediate_size=8, shared_expert_intermediate_size=8,
                           layer_types=["linear_attention", "full_attention",
                                        "linear_attention"])
    delta = gated_delta_layer(2, 4, 6, 5, 3)
    _check(tf.Qwen3NextForCausalLM(c), [delta, attention_layer(1, 10), delta])


def test_mamba2_layers_of_bamba() -> None:
    c = tf.BambaConfig(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                       num_attention_heads=3, num_key_value_heads=1, attn_layer_indices=[1],
                       mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=2, mamba_d_state=5,
                       mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4,
                       use_mamba_kernels=False)
    mamba = mamba2_layer(4, 12, 2, 5, 3)
    _check(tf.BambaForCausalLM(c), [mamba, attention_layer(1, 8), mamba])


def test_gpt_oss_windows_and_sinks() -> None:
    c = tf.GptOssConfig(vocab_size=50, hidden_size=24, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                        sliding_window=4, num_local_experts=2, num_experts_per_tok=1)
    # the sinks are a parameter of the layer, nothing in the cache
    _check(tf.GptOssForCausalLM(c), [attention_layer(2, 6, 4), attention_layer(2, 6)],
           window_rows=3)


def test_indexer_keys_of_deepseek_v3_2() -> None:
    c = tf.DeepseekV32Config(vocab_size=50, hidden_size=24, intermediate_size=40,
                             moe_intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=3, num_key_value_heads=3, n_routed_experts=4,
                             num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=10,
                             q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6,
                             v_head_dim=5, index_head_dim=8, index_n_heads=2, index_topk=3,
                             head_dim=14, first_k_dense_replace=2)
    # top-k (3) below the context does not shrink the cache: every position is kept
    _check(tf.DeepseekV32ForCausalLM(c), [indexed_mla_layer(10, 4, 8)] * 2)


def test_compressed_layers_of_deepseek_v4() -> None:
    """rates 2 (CSA) and 3 (HCA), a window of 5: lengths inside a block, on its boundary and
    past several; the pure window layer's K and V are one tensor's copies in transformers."""
    c = tf.DeepseekV4Config(
        vocab_size=50, hidden_size=24, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, head_dim=16, q_lora_rank=12, partial_rotary_factor=0.25,
        n_routed_experts=4, num_experts_per_tok=2, sliding_window=5, o_groups=2, o_lora_rank=8,
        index_n_heads=2, index_head_dim=8, index_topk=2, hc_mult=2, mlp_layer_types=["moe"] * 3,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3},
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"])
    model = tf.DeepseekV4ForCausalLM(c).eval()
    want = [compressed_layer(16, 5), compressed_layer(16, 5, 2, 8), compressed_layer(16, 5, 3)]
    for T in LENGTHS:
        window = _cache_after(model, T, torch.float32)[0]
        # transformers 5.24.0 stores the sliding layer's K = V rows twice: the formula once
        assert torch.equal(window.keys, window.values)
        window.values = window.keys
    _check(_SharedWindow(model), want, window_rows=4)


class _SharedWindow:
    """``model``, its pure window layers' V made K's own tensor after each forward (the rows
    are equal, checked above): what the layer needs, the formula's count."""

    def __init__(self, model: object) -> None:
        self.model, self.config = model, model.config

    def eval(self) -> _SharedWindow:
        return self

    def to(self, dtype: torch.dtype) -> _SharedWindow:
        self.model = self.model.to(dtype)
        return self

    def __call__(self, ids: torch.Tensor, use_cache: bool) -> object:
        out = self.model(ids, use_cache=use_cache)
        for layer in out.past_key_values.layers:
            if torch.equal(layer.keys, layer.values):
                layer.values = layer.keys
        return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "bamba", "granitemoehybrid",
                                    "gpt_oss", "deepseek_v32", "deepseek_v4"])
def test_config_json_as_transformers_writes_it(family: str, tmp_path) -> None:
    """A transformers config object of the family, saved with ``save_pretrained`` and read back
    by the memory command's reader, counts what the formula counts for those sizes."""
    configs = {
        "qwen3_5": (tf.Qwen3_5Config(text_config=dict(
            num_hidden_layers=4, num_key_value_heads=4, head_dim=24, linear_num_key_heads=5,
            linear_num_value_heads=10, linear_key_head_dim=12, linear_value_head_dim=14,
            linear_conv_kernel_dim=3)),
            [gated_delta_layer(5, 10, 12, 14, 3)] * 3 + [attention_layer(4, 24)]),
        "qwen3_next": (tf.Qwen3NextConfig(num_hidden_layers=8, num_key_value_heads=4,
                                          head_dim=24, linear_num_key_heads=5),
                       ([gated_delta_layer(5, 32, 128, 128, 4)] * 3
                        + [attention_layer(4, 24)]) * 2),
        "bamba": (tf.BambaConfig(num_hidden_layers=5, attn_layer_indices=[1, 4], hidden_size=96,
                                 num_attention_heads=6, num_key_value_heads=3, mamba_n_heads=6,
                                 mamba_d_head=32, mamba_n_groups=3, mamba_d_state=7,
                                 mamba_d_conv=5),
                  [mamba2_layer(6, 32, 3, 7, 5), attention_layer(3, 16),
                   *[mamba2_layer(6, 32, 3, 7, 5)] * 2, attention_layer(3, 16)]),
        "granitemoehybrid": (tf.GraniteMoeHybridConfig(
            num_hidden_layers=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
            mamba_n_heads=12, mamba_n_groups=2, mamba_d_state=9, mamba_d_conv=3,
            layer_types=["mamba", "attention", "mamba"]),
            [mamba2_layer(12, 16, 2, 9, 3), attention_layer(2, 16), mamba2_layer(12, 16, 2, 9, 3)]),
        "gpt_oss": (tf.GptOssConfig(num_hidden_layers=4, num_key_value_heads=4, head_dim=40,
                                    sliding_window=33),
                    [attention_layer(4, 40, 33), attention_layer(4, 40)] * 2),
        "deepseek_v32": (tf.DeepseekV32Config(num_hidden_layers=3, kv_lora_rank=48,
                                              qk_rope_head_dim=16, index_head_dim=24),
                         [indexed_mla_layer(48, 16, 24)] * 3),
        "deepseek_v4": (tf.DeepseekV4Config(
            num_hidden_layers=4, head_dim=96, index_head_dim=24, sliding_window=40,
            compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 10},
            layer_types=["sliding_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention", "compressed_sparse_attention"]),
            [compressed_layer(96, 40), compressed_layer(96, 40, 3, 24),
             compressed_layer(96, 40, 10), compressed_layer(96, 40, 3, 24)]),
    }
    config, want = configs[family]
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == family
    got = read_config(tmp_path)
    assert list(got.layers) == want, family
    for T in (0, 1, 9, 1000):
        assert got.kv_bytes(T, 2, "bfloat16") == 2 * sum(
            2 * layer.elements(T) + 4 * layer.state32 for layer in want)


def test_the_release_s_compress_ratios_list_reads_as_layer_types(tmp_path) -> None:
    """A config.json with V4's legacy ``compress_ratios`` (one entry a layer, then one for the
    prediction layer) reads as transformers reads it: the first ``num_hidden_layers``."""
    config = {"model_type": "deepseek_v4", "num_hidden_layers": 3, "head_dim": 64,
              "index_head_dim": 32, "sliding_window": 16, "max_position_embeddings": 4096,
              "num_attention_heads": 8, "hidden_size": 128, "compress_ratios": [0, 4, 128, 0]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = read_config(tmp_path)
    assert list(got.layers) == [compressed_layer(64, 16), compressed_layer(64, 16, 4, 32),
                                compressed_layer(64, 16, 128)]
    assert got.kind == "compressed"


def _sizes(**more: object) -> dict:
    """Off every default: 3 layers, 6 query heads over 2 K/V heads of 12 (none of them 8)."""
    return {**dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                   hidden_size=72, intermediate_size=40, vocab_size=60), **more}


OLDER = {
    "llama": lambda: tf.LlamaConfig(**_sizes()),
    "mistral": lambda: tf.MistralConfig(**_sizes(sliding_window=5)),
    "mixtral": lambda: tf.MixtralConfig(**_sizes(num_local_experts=2, sliding_window=None)),
    "qwen2": lambda: tf.Qwen2Config(**_sizes()),
    "qwen2-window": lambda: tf.Qwen2Config(**_sizes(use_sliding_window=True, sliding_window=5,
                                                    max_window_layers=1)),
    "qwen3": lambda: tf.Qwen3Config(**_sizes(head_dim=10)),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_sizes(head_dim=10, num_experts=2,
                                                    num_experts_per_tok=1,
                                                    moe_intermediate_size=8)),
    "gemma": lambda: tf.GemmaConfig(**_sizes(head_dim=10)),
    "gemma2": lambda: tf.Gemma2Config(**_sizes(head_dim=10, sliding_window=5)),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**_sizes(head_dim=10, sliding_window=5,
                                                        num_hidden_layers=7)),
    "cohere2": lambda: tf.Cohere2Config(**_sizes(sliding_window=5, num_hidden_layers=4)),
    "phi3": lambda: tf.Phi3Config(**_sizes(pad_token_id=0)),
    "olmo2": lambda: tf.Olmo2Config(**_sizes()),
    "glm4": lambda: tf.Glm4Config(**_sizes(head_dim=10, pad_token_id=0)),
    "starcoder2": lambda: tf.Starcoder2Config(**_sizes(sliding_window=5)),
    "deepseek_v3": lambda: tf.DeepseekV3Config(**_sizes(  # MLA: K/V heads are the query heads
        num_key_value_heads=6, kv_lora_rank=10, q_lora_rank=12, qk_rope_head_dim=4,
        qk_nope_head_dim=6, v_head_dim=5,
        n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=3)),
    "gpt2": lambda: tf.GPT2Config(n_layer=3, n_head=6, n_embd=72, vocab_size=60),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**{k: v for k, v in _sizes().items()
                                            if k != "num_key_value_heads"}),
}


@pytest.mark.parametrize("family", sorted(OLDER))
def test_older_families_config_json_counts_what_transformers_holds(family: str,
                                                                   tmp_path) -> None:
    """The config.json transformers writes for each family, read by the memory command, counts
    per layer and length the bytes transformers' own cache holds after a forward (BF16 and
    FP32; a window's ``W - 1`` rows as above)."""
    config = OLDER[family]()
    config.save_pretrained(tmp_path)
    got = read_config(tmp_path)
    windows = {layer.window for layer in got.layers} - {None}
    assert len(windows) <= 1
    model = tf.AutoModelForCausalLM.from_config(config)
    _check(model, list(got.layers), window_rows=min(windows) - 1 if windows else None)


def test_falcon_s_grouped_heads_are_read_and_transformers_stores_them_repeated(
        tmp_path) -> None:
    """Falcon-40B's layout (``new_decoder_architecture``, ``num_kv_heads`` 2 of 6 heads): the
    reader counts the model's 2 K/V heads (``multi_query``, true by default, is not read then);
    transformers 5.24.0 caches K and V after repeating them to all 6 query heads
    (``FalconAttention.forward``: ``num_kv_heads = self.num_heads if
    self.new_decoder_architecture``), 3x the model's distinct rows."""
    tf.FalconConfig(num_hidden_layers=2, num_attention_heads=6, num_kv_heads=2, hidden_size=72,
                    vocab_size=60, new_decoder_architecture=True).save_pretrained(tmp_path)
    got = read_config(tmp_path)
    assert [layer.kv_heads for layer in got.layers] == [2, 2]
    model = tf.AutoModelForCausalLM.from_config(tf.FalconConfig.from_pretrained(tmp_path))
    _check(model, [layer._replace(per_token=3 * layer.per_token, kv_heads=6)
                   for layer in got.layers])
    old = {"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 6,
           "hidden_size": 72, "max_position_embeddings": 64}
    for extra, kv in (({"multi_query": True}, 1), ({"multi_query": False, "num_kv_heads": 6}, 6),
                      ({"multi_query": True, "new_decoder_architecture": True,
                        "num_kv_heads": 3}, 3)):
        (tmp_path / "config.json").write_text(json.dumps({**old, **extra}))
        assert read_config(tmp_path).layers[0].kv_heads == kv, extra
