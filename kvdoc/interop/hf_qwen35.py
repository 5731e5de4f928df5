"""transformers' Qwen3.5 (text, dense) to and from :class:`kvdoc.core.deltanet.DeltaNetDecoder`.

Inside a layer the weights keep transformers' names; only the prefixes move (``model.layers.i.``
is ``h.i.``). The layer types come from ``layer_types``; RoPE's base and rotary fraction from
``rope_parameters`` (a text model's three M-RoPE sections turn the same text positions, so they
are plain RoPE here). Qwen3-Next (``qwen3_next``) is refused by name: transformers 5.24 builds its
Gated DeltaNet from other projections (``in_proj_qkvz``, ``in_proj_ba``, heads interleaved) and a
sparse-MoE MLP on every layer that is not in ``mlp_only_layers``.

>>> _ = torch.manual_seed(0)
>>> hf = qwen35_model(DeltaNetConfig(chunk_size=4))
>>> ours = from_qwen35(hf)
>>> ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
>>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
True
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder
from kvdoc.interop.hf_config import OUTER, holding, load_exported, outer_weights


def qwen35_config(config: DeltaNetConfig) -> Any:
    """The transformers ``Qwen3_5TextConfig`` of the same model (no dropout, no special tokens).

    >>> config_from_qwen35(qwen35_config(DeltaNetConfig())) == DeltaNetConfig()
    True
    """
    from transformers import Qwen3_5TextConfig

    c = config
    return Qwen3_5TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.n_inner,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim, hidden_act="silu", max_position_embeddings=c.n_positions,
        rms_norm_eps=c.layer_norm_epsilon, tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                         "partial_rotary_factor": c.partial_rotary_factor},
        attention_bias=False, attention_dropout=0.0,
        linear_conv_kernel_dim=c.linear_conv_kernel_dim,
        linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
        linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads, layer_types=list(c.layer_types),
        pad_token_id=None, bos_token_id=None, eos_token_id=None)


def config_from_qwen35(hf_config: Any, chunk_size: int = 64) -> DeltaNetConfig:
    """The :class:`DeltaNetConfig` of a transformers ``Qwen3_5TextConfig`` (or of a
    ``Qwen3_5Config``'s ``text_config``); a ValueError for another model type or a variant kvdoc
    lacks.

    >>> from transformers import Qwen3NextConfig
    >>> config_from_qwen35(Qwen3NextConfig())
    Traceback (most recent call last):
    ...
    ValueError: qwen3_next is not loaded: its Gated DeltaNet projects Q, K, V, Z (in_proj_qkvz) ...
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "qwen3_5":
        hf_config, model_type = hf_config.text_config, hf_config.text_config.model_type
    if model_type == "qwen3_next":
        raise ValueError(
            "qwen3_next is not loaded: its Gated DeltaNet projects Q, K, V, Z (in_proj_qkvz) and "
            "b, a (in_proj_ba) with the heads interleaved, not Qwen3.5's four projections, and "
            "every layer outside mlp_only_layers is a sparse mixture of experts (transformers "
            "5.24's Qwen3NextSparseMoeBlock), which kvdoc does not implement")
    if model_type != "qwen3_5_text":
        raise ValueError(f"expected a qwen3_5_text config, got {model_type!r}")
    rope = dict(hf_config.rope_parameters or {})
    unsupported = {
        "rope_type": (rope.get("rope_type", "default"), ("default",)),
        "hidden_act": (hf_config.hidden_act, ("silu",)),
        "attention_bias": (hf_config.attention_bias, (False,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(f"qwen3_5_text config has {name}={value!r}; kvdoc supports {allowed}")
    return DeltaNetConfig(
        vocab_size=hf_config.vocab_size, n_positions=hf_config.max_position_embeddings,
        n_embd=hf_config.hidden_size, n_inner=hf_config.intermediate_size,
        n_layer=hf_config.num_hidden_layers, layer_types=tuple(hf_config.layer_types),
        n_head=hf_config.num_attention_heads, n_kv_head=hf_config.num_key_value_heads,
        head_dim=hf_config.head_dim,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        rope_theta=float(rope["rope_theta"]),
        linear_num_key_heads=hf_config.linear_num_key_heads,
        linear_num_value_heads=hf_config.linear_num_value_heads,
        linear_key_head_dim=hf_config.linear_key_head_dim,
        linear_value_head_dim=hf_config.linear_value_head_dim,
        linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
        layer_norm_epsilon=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings), chunk_size=chunk_size)


def from_qwen35(hf_model: Any, chunk_size: int = 64) -> DeltaNetDecoder:
    """A :class:`DeltaNetDecoder` with the weights of transformers' ``Qwen3_5ForCausalLM``, in
    the model's dtype, in eval mode (``chunk_size``: kvdoc's prefill chunk)."""
    state = hf_model.state_dict()
    mapped = outer_weights(state)
    for name, value in state.items():
        if name.startswith("model.layers."):
            mapped["h." + name.removeprefix("model.layers.")] = value
    config = config_from_qwen35(hf_model.config, chunk_size)
    return holding(DeltaNetDecoder(config), mapped)


def to_qwen35(model: DeltaNetDecoder) -> Any:
    """transformers' ``Qwen3_5ForCausalLM`` holding ``model``'s weights (the inverse of
    :func:`from_qwen35`), in the model's dtype, in eval mode; the global RNG is left as it was."""
    from transformers import Qwen3_5ForCausalLM

    state = model.state_dict()
    with torch.random.fork_rng():
        hf = Qwen3_5ForCausalLM(qwen35_config(replace(model.config)))
    mapped = {theirs: state[ours] for theirs, ours in OUTER.items()}
    for name, value in state.items():
        if name.startswith("h."):
            mapped["model.layers." + name.removeprefix("h.")] = value
    return load_exported(hf, mapped, model, "Qwen3_5")


def qwen35_model(config: DeltaNetConfig | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> Any:
    """A transformers ``Qwen3_5ForCausalLM`` with random weights from ``config`` (default
    :class:`DeltaNetConfig`), built offline, in eval mode. transformers starts every
    ``1 + weight`` RMSNorm at zero; these are drawn (as small as its other weights' spread), so
    that a q/k norm or a final norm loaded into the wrong place shows."""
    torch.manual_seed(seed)
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM(qwen35_config(config or DeltaNetConfig()))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if re.search(r"(layernorm|norm)\.weight$", name):
                p.add_(0.1 * torch.randn_like(p))
    return hf.to(dtype).eval()


@contextmanager
def float64_lifted(hf_model: Any) -> Iterator[Any]:
    """Within the block, transformers' Qwen3.5 computes in the model's dtype where it computes
    in float32 whatever the dtype (an upcast meant for half precision): its RMSNorms, RoPE's
    angles, the decay ``g`` (``A_log.float()``, ``a.float()``) and both delta rules (their inputs
    ``.to(torch.float32)``). Each of those functions is transformers' own source, compiled again
    with ``float32`` read as ``float64`` and ``.float()`` as ``.double()``: an FP64 model then
    measures FP64 rounding (outside the block it departs from exact FP64 by about 1e-7)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from kvdoc.core.model import rope_angles

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
        angles = rope_angles(text, rotary_dim, theta)  # [B, C, rotary_dim]
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    for rule in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule):
        recompiled(rule)  # into scope, where the lifted GatedDeltaNet.forward finds it
    methods = {m.Qwen3_5RMSNorm: recompiled(m.Qwen3_5RMSNorm.forward),
               m.Qwen3_5RMSNormGated: recompiled(m.Qwen3_5RMSNormGated.forward),
               m.Qwen3_5GatedDeltaNet: recompiled(m.Qwen3_5GatedDeltaNet.forward),
               m.Qwen3_5TextRotaryEmbedding: rotary}
    patched = [mod for mod in hf_model.modules() if type(mod) in methods]
    for mod in patched:
        mod.forward = types.MethodType(methods[type(mod)], mod)
    try:
        yield hf_model
    finally:
        for mod in patched:
            del mod.forward  # back to the class's method
