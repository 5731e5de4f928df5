"""FP64 comparisons with transformers: its float32 islands (RMSNorm and RoPE computed in
float32 whatever the model's dtype) lifted for the length of a block
(:func:`float64_islands_lifted`).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def float64_islands_lifted(hf_model: Any) -> Iterator[Any]:
    """Within the block, transformers' Llama, Mistral, Qwen2, Qwen3, Phi-3, DeepSeek-V3, Gemma 3
    and gpt-oss compute RMSNorm and RoPE in the model's dtype.

    transformers computes both in float32 whatever the model's dtype (an upcast meant for half
    precision), so an FP64 Llama differs from an exact FP64 computation by about 1e-7 there;
    inside the block an FP64 comparison measures FP64 rounding. GPT-2 and FP32 models change
    only by the rounding of the rotary angles (float64 here, as in :mod:`kvdoc.core.model`).
    """
    from kvdoc.core.model import rope_angles

    def rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
        mean_square = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(mean_square + self.variance_epsilon))

    def rotary(self: Any, x: torch.Tensor,
               position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.stack([rope_angles(row, head_dim, theta)
                              for row in position_ids])  # [B, C, D_h]
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def gemma_rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def gemma_rotary(self: Any, x: torch.Tensor, position_ids: torch.Tensor,
                     layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        theta = float(config.rope_parameters[layer_type]["rope_theta"])  # a base per layer type
        angles = torch.stack([rope_angles(row, config.head_dim, theta) for row in position_ids])
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def gptoss_rotary(self: Any, x: torch.Tensor,
                      position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from kvdoc.core.gptoss import yarn_frequencies
        from kvdoc.interop.hf_gptoss import config_from_gptoss

        freq, scale = yarn_frequencies(config_from_gptoss(config))  # YaRN's, in float64
        angles = position_ids.to(torch.float64)[..., None] * freq.to(position_ids.device)
        return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)

    config = hf_model.config
    model_type = getattr(config, "model_type", None)
    lifted: dict[str, Any] = {}
    if model_type == "gemma3_text":
        lifted = {"RMSNorm": gemma_rms_norm, "RotaryEmbedding": gemma_rotary}
    elif model_type == "gpt_oss":  # cos and sin of half the width, YaRN's factor in them
        lifted = {"RMSNorm": rms_norm, "RotaryEmbedding": gptoss_rotary}
    elif model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3", "deepseek_v3"):
        split_width = config.hidden_size // config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or split_width
        theta = float(config.rope_parameters["rope_theta"])
        lifted = {"RMSNorm": rms_norm, "RotaryEmbedding": rotary}
    patched = [m for m in hf_model.modules() if type(m).__name__.endswith(tuple(lifted))]
    for module in patched:
        kind = next(k for k in lifted if type(module).__name__.endswith(k))
        module.forward = types.MethodType(lifted[kind], module)
    try:
        yield hf_model
    finally:
        for module in patched:
            del module.forward  # back to the class's method
