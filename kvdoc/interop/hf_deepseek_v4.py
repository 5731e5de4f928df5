"""kvdoc's V4 attention layer (:class:`kvdoc.core.v4.CompressedAttention`) as transformers'
``DeepseekV4Attention``, and that layer run full or in chunks over its own cache layer
(``DeepseekV4CSACache``, ``DeepseekV4HCACache`` or a sliding window), to match the two at the
layer: transformers' V4 is a mixture of experts with hyper-connections, which kvdoc does not
build, so the whole models cannot be compared.

The weights keep their names (the indexer's ``weights_proj`` sits in transformers' ``scorer``).
transformers' V4 computes in float32 whatever the model's dtype in more places than its other
models (RMSNorm, the rotary angles and rotation, the compressor's softmax, the indexer's
scores, the query's unweighted norm): :func:`float64_lifted` computes them in the model's dtype
for the length of a block, so that an FP64 comparison measures FP64 rounding.

>>> from kvdoc.core.v4 import CompressedConfig, CompressedAttention
>>> _ = torch.manual_seed(0)
>>> ours = CompressedAttention(CompressedConfig(), "csa").eval()
>>> theirs = to_transformers(ours)
>>> x = torch.randn(2, 11, 64)
>>> with torch.no_grad():
...     err = (run_layer(theirs, x, (4, 1, 6)) - ours(x, None, 0, 0)).abs().max().item()
>>> err < 1e-5
True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvdoc.core.v4 import CompressedAttention, CompressedConfig

HF_TYPES = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
            "hca": "heavily_compressed_attention"}


def hf_config(config: CompressedConfig, kind: str) -> Any:
    """A one-layer ``DeepseekV4Config`` of ``kind`` with ``config``'s attention sizes (the MoE's
    sizes are placeholders: only the attention layer is built)."""
    from transformers import DeepseekV4Config

    c = config
    hf = DeepseekV4Config(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=1,
        num_attention_heads=c.n_head, head_dim=c.head_dim,
        partial_rotary_factor=c.rope_head_dim / c.head_dim, q_lora_rank=c.q_lora_rank,
        o_groups=c.o_groups, o_lora_rank=c.o_lora_rank, sliding_window=c.sliding_window,
        compress_rates={"compressed_sparse_attention": c.csa_rate,
                        "heavily_compressed_attention": c.hca_rate},
        index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim,
        index_topk=c.index_topk, rope_theta=c.rope_theta,
        compress_rope_theta=c.compress_rope_theta, rms_norm_eps=c.layer_norm_epsilon,
        layer_types=[HF_TYPES[kind]], mlp_layer_types=["moe"], n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=4, max_position_embeddings=c.n_positions)
    if hf.qk_rope_head_dim != c.rope_head_dim:
        raise ValueError(f"transformers derives a rotary width of {hf.qk_rope_head_dim} from "
                         f"{c.rope_head_dim} / {c.head_dim}")
    hf._attn_implementation = "eager"  # V4 ships eager attention only
    return hf


def to_transformers(attn: CompressedAttention) -> Any:
    """transformers' ``DeepseekV4Attention`` (layer 0 of a one-layer config) holding ``attn``'s
    weights, in its dtype, in eval mode; its config is ``.config``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    dtype = attn.kv_proj.weight.dtype
    with torch.random.fork_rng():
        hf = DeepseekV4Attention(hf_config(attn.config, attn.kind), 0)
    state = {name.replace("indexer.weights_proj", "indexer.scorer.weights_proj"): value
             for name, value in attn.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    return hf.to(dtype).eval()


def run_layer(hf: Any, x: torch.Tensor, chunks: Sequence[int] | None = None) -> torch.Tensor:
    """``hf``'s output for ``x`` ``[B, T, d]`` at positions ``0 ..``: one call without a cache
    (``chunks`` None), or calls of ``chunks`` tokens over a ``DynamicCache`` of the layer's
    own kind, as ``DeepseekV4Model.forward`` makes them (its sliding-window mask and rotary)."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    config = hf.config
    rotary = DeepseekV4RotaryEmbedding(config).to(x.device)
    cache = None if chunks is None else DynamicCache(config=config)
    outs, start = [], 0
    for size in [x.shape[1]] if chunks is None else chunks:
        part = x[:, start:start + size]
        positions = torch.arange(start, start + part.shape[1], device=x.device)[None]
        embeddings = {kind: rotary(part, positions, layer_type=kind)
                      for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=config, inputs_embeds=part,
                                                 attention_mask=None, cache=cache,
                                                 position_ids=positions)
        outs.append(hf(part, embeddings, positions, mask, cache=cache)[0])
        start += part.shape[1]
    if start != x.shape[1]:
        raise ValueError(f"chunks {list(chunks or [])} cover {start} of {x.shape[1]} positions")
    return torch.cat(outs, dim=1)


class _TransformersLayer(torch.nn.Module):
    """Calls transformers' layer (one call, no cache) where kvdoc's attention was."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor, cache: Any, layer_idx: int, start: int,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        if cache is not None or start:
            raise ValueError("the transformers layers run full forwards only")
        return run_layer(self.hf, x)


def with_transformers_attention(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a :class:`~kvdoc.core.v4.CompressedDecoder` whose every attention is
    transformers' ``DeepseekV4Attention`` holding its weights (embeddings, norms, MLPs and head
    stay kvdoc's): full forwards only, the grid's reference for the V4 model."""
    import copy

    clone = copy.deepcopy(model)
    for block in clone.h:
        block.attn = _TransformersLayer(to_transformers(block.attn))
    return clone


@contextmanager
def float64_lifted() -> Iterator[None]:
    """Within the block, transformers' V4 computes its float32 islands in the tensors' dtype:
    ``DeepseekV4RMSNorm`` and the rotary angles by patched forwards, and every ``.float()`` and
    ``softmax(dtype=torch.float32)`` of a float64 tensor (the rotation, the query's unweighted
    norm, the compressors' softmax, the indexer's scores) by patched tensor methods
    (:func:`~kvdoc.interop.hf_float64.patched`: single threaded use only)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    from kvdoc.interop.hf_float64 import cos_sin, float64_kept, patched, rms_norm

    plain_softmax = torch.Tensor.softmax

    def keep_softmax(self: torch.Tensor, dim: int, dtype: torch.dtype | None = None,
                     **kwargs: Any) -> torch.Tensor:
        keep = self.dtype == torch.float64
        return plain_softmax(self, dim, dtype=None if keep else dtype, **kwargs)

    def rotary(self: Any, x: torch.Tensor, position_ids: torch.Tensor,
               layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        theta = float(self.config.rope_parameters[layer_type]["rope_theta"])
        dim = self.config.qk_rope_head_dim
        cos, sin = cos_sin(position_ids, dim, theta, x.dtype)
        return cos[..., :dim // 2], sin[..., :dim // 2]

    with patched([(v4.DeepseekV4RMSNorm, "forward", rms_norm),
                  (v4.DeepseekV4RotaryEmbedding, "forward", rotary),
                  (torch.Tensor, "float", float64_kept), (torch.Tensor, "softmax", keep_softmax)]):
        yield
