"""FP64 comparisons with transformers: its float32 islands (RMSNorm and RoPE computed in
float32 whatever the model's dtype; Bamba's Mamba-2 scan and Qwen3.5's decay and delta rules
too) lifted for the length of a block (:func:`float64_islands_lifted`,
:func:`qwen35_float64_lifted`).
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_FLOAT = torch.Tensor.float


def rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``RMSNorm.forward`` in the input's dtype."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def float64_kept(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.float`` that keeps a float64 tensor as it is."""
    return self if self.dtype == torch.float64 else _FLOAT(self, *args, **kwargs)


def cos_sin(positions: torch.Tensor, dim: int, theta: float,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of kvdoc's RoPE angles (float64) at ``positions`` ``[B, C]``, in ``dtype``."""
    from kvdoc.core.model import rope_angles

    angles = rope_angles(positions, dim, theta)  # [B, C, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Within the block, each ``(owner, name, value)`` set as ``owner.name``; afterwards each as
    it was (deleted again where ``owner`` only inherited it: a module's ``forward``,
    ``Tensor.float``). Single threaded use only: a class patched is patched for everyone."""
    saved = [(owner, name, vars(owner).get(name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextmanager
def float64_islands_lifted(hf_model: Any) -> Iterator[Any]:
    """Within the block, transformers' Llama, Mistral, Qwen2, Qwen3, Phi-3, DeepSeek-V3,
    DeepSeek-V3.2, Gemma 3, gpt-oss and Bamba compute RMSNorm and RoPE in the model's dtype
    (Bamba: its gated RMSNorm and its Mamba-2 scan too, whose ``.float()`` calls keep a float64
    tensor as it is; Qwen3.5: :func:`qwen35_float64_lifted`).

    transformers computes both in float32 whatever the model's dtype (an upcast meant for half
    precision), so an FP64 Llama differs from an exact FP64 computation by about 1e-7 there;
    inside the block an FP64 comparison measures FP64 rounding. GPT-2 and FP32 models change
    only by the rounding of the rotary angles (float64 here, as in :mod:`kvdoc.core.model`).
    """
    def rotary(self: Any, x: torch.Tensor,
               position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin(position_ids, head_dim, theta, x.dtype)

    def gemma_rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def gemma_rotary(self: Any, x: torch.Tensor, position_ids: torch.Tensor,
                     layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        theta = float(config.rope_parameters[layer_type]["rope_theta"])  # a base per layer type
        return cos_sin(position_ids, config.head_dim, theta, x.dtype)

    def gated_rms_norm(self: Any, x: torch.Tensor,
                       gate: torch.Tensor | None = None) -> torch.Tensor:
        x = x if gate is None else x * torch.nn.functional.silu(gate)
        groups = x.view(*x.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * groups.view(x.shape)

    def gptoss_rotary(self: Any, x: torch.Tensor,
                      position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from kvdoc.core.gptoss import yarn_frequencies
        from kvdoc.interop.hf_gptoss import config_from_gptoss

        freq, scale = yarn_frequencies(config_from_gptoss(config))  # YaRN's, in float64
        angles = position_ids.to(torch.float64)[..., None] * freq.to(position_ids.device)
        return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)

    config = hf_model.config
    model_type = getattr(config, "model_type", None)
    if model_type == "qwen3_5_text":
        with qwen35_float64_lifted(hf_model):
            yield hf_model
        return
    lifted: dict[str, Any] = {}
    if model_type == "bamba":  # RoPE on the first half of a head; the scan's .float() calls
        head_dim = int(config.hidden_size // config.num_attention_heads
                       * config.rope_parameters.get("partial_rotary_factor", 1.0))
        theta = float(config.rope_parameters["rope_theta"])
        lifted = {"RMSNorm": rms_norm, "RMSNormGated": gated_rms_norm, "RotaryEmbedding": rotary}
    elif model_type == "gemma3_text":
        lifted = {"RMSNorm": gemma_rms_norm, "RotaryEmbedding": gemma_rotary}
    elif model_type == "gpt_oss":  # cos and sin of half the width, YaRN's factor in them
        lifted = {"RMSNorm": rms_norm, "RotaryEmbedding": gptoss_rotary}
    elif model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3", "deepseek_v3",
                        "deepseek_v32"):
        split_width = config.hidden_size // config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or split_width
        theta = float(config.rope_parameters["rope_theta"])
        lifted = {"RMSNorm": rms_norm, "RotaryEmbedding": rotary}
    patches = []
    for module in hf_model.modules():
        kinds = [k for k in lifted if type(module).__name__.endswith(k)]
        if kinds:
            patches.append((module, "forward", types.MethodType(lifted[max(kinds, key=len)],
                                                                module)))
    if model_type == "bamba":  # its scan and state update call .float() on their inputs
        patches.append((torch.Tensor, "float", float64_kept))
    with patched(patches):
        yield hf_model


@contextmanager
def qwen35_float64_lifted(hf_model: Any) -> Iterator[Any]:
    """Within the block, transformers' Qwen3.5 computes in the model's dtype where it computes
    in float32 whatever the dtype (an upcast meant for half precision): its RMSNorms, RoPE's
    angles, the decay ``g`` (``A_log.float()``, ``a.float()``) and both delta rules (their inputs
    ``.to(torch.float32)``). Each of those functions is transformers' own source, compiled again
    with ``float32`` read as ``float64`` and ``.float()`` as ``.double()``: an FP64 model then
    measures FP64 rounding (outside the block it departs from exact FP64 by about 1e-7)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    scope = dict(vars(m))  # the lifted functions call each other by these globals

    def recompiled(fn: Any) -> Any:
        source = textwrap.dedent(inspect.getsource(fn))
        source = re.sub(r"^@.*\n", "", source, flags=re.M)  # decorators: kernels, kwargs
        source = source.replace("torch.float32", "torch.float64").replace(".float()",
                                                                          ".double()")
        exec(compile(source, inspect.getsourcefile(fn), "exec"), scope)
        return scope[fn.__name__]

    config = hf_model.config
    rotary_dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    theta = float(config.rope_parameters["rope_theta"])

    def rotary(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[Any, Any]:
        text = position_ids if position_ids.dim() == 2 else position_ids[0]  # [B, C]
        return cos_sin(text, rotary_dim, theta, x.dtype)

    for rule in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule):
        recompiled(rule)  # into scope, where the lifted GatedDeltaNet.forward finds it
    methods = {m.Qwen3_5RMSNorm: recompiled(m.Qwen3_5RMSNorm.forward),
               m.Qwen3_5RMSNormGated: recompiled(m.Qwen3_5RMSNormGated.forward),
               m.Qwen3_5GatedDeltaNet: recompiled(m.Qwen3_5GatedDeltaNet.forward),
               m.Qwen3_5TextRotaryEmbedding: rotary}
    with patched([(mod, "forward", types.MethodType(methods[type(mod)], mod))
                  for mod in hf_model.modules() if type(mod) in methods]):
        yield hf_model
