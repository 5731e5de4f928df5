"""The published 2025-2026 releases whose layers keep more than K/V of every position (windows
with sinks, linear-attention and Mamba-2 states, indexer keys), as
:class:`~kvdoc.measure.model_caches.ModelCache` fields: ``(name, layers, context, source,
note)``. Each ``source`` names the file its sizes were read from; a release whose
``config.json`` could not be read is left out (the memory command reads it with ``--config``).

Left out: Qwen3.5 (transformers 5.24.0's ``Qwen3_5TextConfig`` defaults are not
Qwen/Qwen3.5-27B's sizes, and its config.json was not read), Nemotron-H and Granite 4 (not
read), DeepSeek-V4 (``DeepseekV4Config``'s default ``layer_types`` is, by its docstring, V4-Pro's
pattern, not V4-Flash's, and neither release's config.json was read).

>>> [spec[0] for spec in RECENT]
['gpt-oss-20b', 'gpt-oss-120b', 'Qwen3-Next-80B-A3B', 'Bamba-9B', 'DeepSeek-V3.2-Exp']
"""

from __future__ import annotations

from .layer_caches import (
    LayerCache,
    attention_layer,
    gated_delta_layer,
    indexed_mla_layer,
    mamba2_layer,
)

_HF = "https://huggingface.co/{}/blob/main/config.json"
_STATE = ("keep a fixed state (the conv state in the cache's dtype, the {} state in FP32, as "
          "transformers 5.24.0 keeps them)")


def _gpt_oss(name: str, layers: int) -> tuple[str, tuple[LayerCache, ...], int, str, str]:
    # layer_types in the published config: sliding, full, sliding, full, ...
    pair = (attention_layer(8, 64, 128), attention_layer(8, 64))
    return (name, pair * (layers // 2), 131072,
            f"{_HF.format('openai/' + name)} (num_hidden_layers {layers}, num_key_value_heads "
            "8, head_dim 64, sliding_window 128, layer_types alternating sliding_attention and "
            "full_attention, max_position_embeddings 131072)",
            "the attention sinks are one learned scalar a head, not cached per position")


RECENT: tuple[tuple[str, tuple[LayerCache, ...], int, str, str], ...] = (
    _gpt_oss("gpt-oss-20b", 24),
    _gpt_oss("gpt-oss-120b", 36),
    # full_attention_interval 4: three linear-attention layers, then a full one
    ("Qwen3-Next-80B-A3B",
     ((gated_delta_layer(16, 32, 128, 128, 4),) * 3 + (attention_layer(2, 256),)) * 12, 262144,
     _HF.format("Qwen/Qwen3-Next-80B-A3B-Instruct") + " (num_hidden_layers 48, "
     "full_attention_interval 4, num_key_value_heads 2, head_dim 256, linear_num_key_heads 16, "
     "linear_num_value_heads 32, linear_key_head_dim 128, linear_value_head_dim 128, "
     "linear_conv_kernel_dim 4, max_position_embeddings 262144)",
     "36 Gated DeltaNet layers " + _STATE.format("recurrent") + "; 12 attention layers keep "
     "K/V per position"),
    # attn_layer_indices 9, 18, 27: the other 29 layers are Mamba-2
    ("Bamba-9B",
     tuple(attention_layer(8, 128) if i in (9, 18, 27) else mamba2_layer(128, 64, 1, 128, 4)
           for i in range(32)), 262144,
     _HF.format("ibm-fms/Bamba-9B") + " (num_hidden_layers 32, attn_layer_indices [9, 18, 27], "
     "num_attention_heads 32, num_key_value_heads 8, hidden_size 4096, mamba_n_heads 128, "
     "mamba_d_head 64, mamba_n_groups 1, mamba_d_state 128, mamba_d_conv 4, mamba_expand 2; "
     "no max_position_embeddings: transformers 5.24.0's BambaConfig default, 262144)",
     "29 Mamba-2 layers " + _STATE.format("SSM") + "; 3 attention layers keep K/V"),
    ("DeepSeek-V3.2-Exp", (indexed_mla_layer(512, 64, 128),) * 61, 163840,
     "transformers 5.24.0 models/deepseek_v32/configuration_deepseek_v32.py, DeepseekV32Config "
     "defaults (its checkpoint: deepseek-ai/DeepSeek-V3.2-Exp; num_hidden_layers 61, "
     "kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128, index_topk 2048, "
     "max_position_embeddings 163840); the release's config.json not read",
     "every position keeps its latent and an indexer key (the top 2,048 a query reads change "
     "with the query, so none is dropped); the multi-token-prediction layer is left out"),
)
