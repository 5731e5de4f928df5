"""Loading transformers' GPT-2, Llama and Mistral models into :class:`kvdoc.Decoder`.

:func:`from_transformers` takes any of the three. GPT-2's checkpoints store ``c_attn``,
``c_proj`` and ``c_fc`` as ``Conv1D`` weights of shape ``[in, out]``, the transpose of
``nn.Linear``'s ``[out, in]``; everything else maps by key once the ``transformer.`` prefix is
dropped. transformers is imported only when needed.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from kvdoc.core.config import GPTConfig
from kvdoc.core.gemma import Gemma3Decoder
from kvdoc.core.model import Decoder

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")
"""GPT-2's weights stored as ``Conv1D`` (``[in, out]``, the transpose of ``nn.Linear``'s)."""
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers some versions keep


def gpt2_config(config: GPTConfig) -> Any:
    """The transformers ``GPT2Config`` of the same model: GELU-tanh, no dropout, untied head.

    Only multi-head attention maps onto GPT-2: ``n_kv_head`` must equal ``n_head``.

    >>> from transformers import GPT2LMHeadModel
    >>> hf = GPT2LMHeadModel(gpt2_config(GPTConfig()))
    >>> sum(p.numel() for p in hf.parameters())
    145280
    >>> config_from_gpt2(hf.config) == GPTConfig()
    True
    """
    from transformers import GPT2Config

    if config.n_kv_head != config.n_head:
        raise ValueError("GPT-2 has no grouped-query attention: n_kv_head must equal n_head")
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=config.n_head, n_inner=config.n_inner,
        activation_function="gelu_new", layer_norm_epsilon=config.layer_norm_epsilon,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None)  # GPT-2's 50256 lies outside a small vocabulary


def config_from_gpt2(hf_config: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a transformers ``GPT2Config``; raises for a variant kvdoc lacks."""
    unsupported = {
        "activation_function": (hf_config.activation_function, ("gelu_new", "gelu_pytorch_tanh")),
        "scale_attn_weights": (hf_config.scale_attn_weights, (True,)),
        "scale_attn_by_inverse_layer_idx": (hf_config.scale_attn_by_inverse_layer_idx, (False,)),
        "reorder_and_upcast_attn": (hf_config.reorder_and_upcast_attn, (False,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(f"GPT-2 config has {name}={value!r}; kvdoc supports {allowed}")
    return GPTConfig(
        vocab_size=hf_config.vocab_size, n_positions=hf_config.n_positions,
        n_layer=hf_config.n_layer, n_head=hf_config.n_head, n_embd=hf_config.n_embd,
        n_inner=hf_config.n_inner or 4 * hf_config.n_embd,
        layer_norm_epsilon=hf_config.layer_norm_epsilon)


def decoder_from_gpt2(model_or_state_dict: Any, config: GPTConfig | None = None) -> Decoder:
    """A :class:`Decoder` holding the weights of a ``GPT2LMHeadModel`` (or of its state dict).

    Args:
        model_or_state_dict: a transformers ``GPT2LMHeadModel``, or its ``state_dict()``.
        config: required with a bare state dict (the head count is not in the weights);
            taken from ``model.config`` otherwise.

    Returns:
        A decoder in the dtype of the given weights, in eval mode.

    Raises:
        ValueError: a missing config, or keys or shapes that do not match the config.

    >>> from transformers import GPT2LMHeadModel
    >>> _ = torch.manual_seed(0)
    >>> hf = GPT2LMHeadModel(gpt2_config(GPTConfig())).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> ours = decoder_from_gpt2(hf)
    >>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
    True
    """
    if isinstance(model_or_state_dict, Mapping):
        state = model_or_state_dict
        if config is None:
            raise ValueError("a bare state dict does not say how many heads the model has: "
                             "pass config=")
    else:
        state = model_or_state_dict.state_dict()
        config = config or config_from_gpt2(model_or_state_dict.config)
    if not state:
        raise ValueError("empty state dict")
    mapped: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key.removeprefix("transformer.")
        if name.endswith(_BUFFERS):
            continue
        mapped[name] = value.t() if name.endswith(CONV1D_WEIGHTS) else value
    decoder = Decoder(config).to(next(iter(mapped.values())).dtype)
    expected = decoder.state_dict()
    missing = sorted(set(expected) - set(mapped))
    unexpected = sorted(set(mapped) - set(expected))
    if missing or unexpected:
        raise ValueError(f"GPT-2 weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, value in mapped.items():
        if value.shape != expected[name].shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)}, "
                             f"config expects {tuple(expected[name].shape)}")
    decoder.load_state_dict({k: v.contiguous() for k, v in mapped.items()})
    return decoder.eval()


# --- Llama and Mistral ------------------------------------------------------------------------

def transformers_config(config: GPTConfig) -> Any:
    """The transformers config of the same model: ``GPT2Config``, ``LlamaConfig`` or
    ``MistralConfig``.

    A learned-position config maps to GPT-2 (:func:`gpt2_config`); a Llama-style one
    (:func:`kvdoc.core.config.llama_config`) to Llama, or to Mistral when it has a sliding window.

    >>> from transformers import MistralForCausalLM
    >>> from kvdoc.core.config import mistral_config
    >>> hf = MistralForCausalLM(transformers_config(mistral_config()))
    >>> hf.config.sliding_window, config_from_transformers(hf.config) == mistral_config()
    (32, True)
    """
    if config.position == "learned":
        return gpt2_config(config)
    from transformers import LlamaConfig, MistralConfig

    if (config.norm, config.mlp, config.bias) != ("rmsnorm", "swiglu", False):
        raise ValueError("Llama and Mistral use RMSNorm, a SwiGLU MLP and no biases with RoPE")
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.n_inner,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head, max_position_embeddings=config.n_positions,
        rms_norm_eps=config.layer_norm_epsilon, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if config.sliding_window is None:
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    return MistralConfig(sliding_window=config.sliding_window, **common)


def config_from_transformers(hf_config: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a transformers GPT-2, Llama or Mistral config.

    Raises:
        ValueError: another model type, or a variant kvdoc lacks (scaled RoPE, another
            activation, a head size other than ``hidden_size / num_attention_heads``, biases).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "gpt2":
        return config_from_gpt2(hf_config)
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"kvdoc loads gpt2, llama and mistral models, not {model_type!r}")
    rope = dict(hf_config.rope_parameters or {})
    split_width = hf_config.hidden_size // hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or split_width
    unsupported = {
        "rope_type": (rope.get("rope_type", "default"), ("default",)),
        "hidden_act": (hf_config.hidden_act, ("silu",)),
        "head_dim": (head_dim, (split_width,)),
        "attention_bias": (getattr(hf_config, "attention_bias", False), (False,)),
        "mlp_bias": (getattr(hf_config, "mlp_bias", False), (False,)),
        "pretraining_tp": (getattr(hf_config, "pretraining_tp", 1) or 1, (1,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(f"{model_type} config has {name}={value!r}; kvdoc supports {allowed}")
    window = getattr(hf_config, "sliding_window", None) if model_type == "mistral" else None
    return GPTConfig(
        vocab_size=hf_config.vocab_size, n_positions=hf_config.max_position_embeddings,
        n_layer=hf_config.num_hidden_layers, n_head=hf_config.num_attention_heads,
        n_embd=hf_config.hidden_size, n_inner=hf_config.intermediate_size,
        n_kv_head=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        layer_norm_epsilon=hf_config.rms_norm_eps, position="rope",
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm="rmsnorm", mlp="swiglu",
        bias=False, tie_word_embeddings=bool(hf_config.tie_word_embeddings), sliding_window=window)


def _llama_state(state: Mapping[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """Llama/Mistral weights under kvdoc's GPT-2 names: Q, K, V (and gate, up) fused by rows."""
    wte = state["model.embed_tokens.weight"]
    mapped = {"wte.weight": wte, "ln_f.weight": state["model.norm.weight"],
              "lm_head.weight": state.get("lm_head.weight", wte)}  # absent: tied
    for i in range(n_layer):
        src = f"model.layers.{i}."
        get = lambda name, src=src: state[src + name]  # noqa: E731
        mapped.update({
            f"h.{i}.ln_1.weight": get("input_layernorm.weight"),
            f"h.{i}.attn.c_attn.weight": torch.cat([get(f"self_attn.{p}_proj.weight")
                                                     for p in "qkv"]),
            f"h.{i}.attn.c_proj.weight": get("self_attn.o_proj.weight"),
            f"h.{i}.ln_2.weight": get("post_attention_layernorm.weight"),
            f"h.{i}.mlp.c_fc.weight": torch.cat([get("mlp.gate_proj.weight"),
                                                  get("mlp.up_proj.weight")]),
            f"h.{i}.mlp.c_proj.weight": get("mlp.down_proj.weight"),
        })
    return mapped


def from_transformers(hf_model: Any) -> Decoder:
    """A :class:`Decoder` with the weights of transformers' ``GPT2LMHeadModel``,
    ``LlamaForCausalLM``, ``MistralForCausalLM`` or ``Gemma3ForCausalLM`` (a
    :class:`~kvdoc.core.gemma.Gemma3Decoder`, :func:`kvdoc.interop.gemma.from_gemma`), in the
    model's dtype, in eval mode.

    For Llama and Mistral, ``q_proj``, ``k_proj`` and ``v_proj`` are stacked into ``c_attn``
    and ``gate_proj``, ``up_proj`` into ``c_fc``; ``new_cache(batch)`` of a Mistral model gives
    a :class:`~kvdoc.core.window.SlidingWindowCache`.

    Raises:
        ValueError: another model type, or a configuration kvdoc does not implement.

    >>> from transformers import LlamaForCausalLM
    >>> from kvdoc.core.config import llama_config
    >>> _ = torch.manual_seed(0)
    >>> hf = LlamaForCausalLM(transformers_config(llama_config())).eval()
    >>> ours = from_transformers(hf)
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5)
    True
    """
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type == "gemma3_text":  # window and global layers: a decoder of its own
        from kvdoc.interop.gemma import from_gemma

        return from_gemma(hf_model)
    config = config_from_transformers(hf_model.config)
    if config.position == "learned":
        return decoder_from_gpt2(hf_model, config)
    state = hf_model.state_dict()
    try:
        mapped = _llama_state(state, config.n_layer)
    except KeyError as missing:
        raise ValueError(f"{hf_model.config.model_type} weights lack {missing}") from None
    decoder = Decoder(config).to(mapped["wte.weight"].dtype)
    expected = decoder.state_dict()
    for name, value in mapped.items():
        if value.shape != expected[name].shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)}, config expects "
                             f"{tuple(expected[name].shape)}")
    decoder.load_state_dict({k: v.contiguous() for k, v in mapped.items()})
    return decoder.to(mapped["wte.weight"].device).eval()


def to_transformers(model: Decoder) -> Any:
    """The transformers model of the same family (GPT-2, Llama, Mistral or Gemma 3) holding
    ``model``'s weights: the inverse of :func:`from_transformers`, in the model's dtype, in eval
    mode. The global RNG is left as it
    was.

    It is how :mod:`kvdoc.proofs.references` builds an implementation that shares no code with
    kvdoc.

    >>> from kvdoc.core.config import llama_config
    >>> _ = torch.manual_seed(0)
    >>> ours = Decoder(llama_config()).eval()
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> torch.allclose(to_transformers(ours)(ids).logits, ours(ids).logits, atol=1e-5)
    True
    """
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM

    if isinstance(model, Gemma3Decoder):
        from kvdoc.interop.gemma import to_gemma

        return to_gemma(model)
    config, state = model.config, model.state_dict()
    hf_config = transformers_config(config)
    family = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "mistral": MistralForCausalLM}
    with torch.random.fork_rng():
        hf = family[hf_config.model_type](hf_config)
    if hf_config.model_type == "gpt2":
        mapped = {("" if name.startswith("lm_head.") else "transformer.") + name:
                  (value.t() if name.endswith(CONV1D_WEIGHTS) else value)
                  for name, value in state.items()}
    else:
        d, kv = config.n_embd, config.kv_dim
        mapped = {"model.embed_tokens.weight": state["wte.weight"],
                  "model.norm.weight": state["ln_f.weight"],
                  "lm_head.weight": state["lm_head.weight"]}
        for i in range(config.n_layer):
            q, k, v = state[f"h.{i}.attn.c_attn.weight"].split((d, kv, kv))
            gate, up = state[f"h.{i}.mlp.c_fc.weight"].chunk(2)
            dst = f"model.layers.{i}."
            mapped.update({
                dst + "input_layernorm.weight": state[f"h.{i}.ln_1.weight"],
                dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": state[f"h.{i}.attn.c_proj.weight"],
                dst + "post_attention_layernorm.weight": state[f"h.{i}.ln_2.weight"],
                dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": state[f"h.{i}.mlp.c_proj.weight"],
            })
    return load_exported(hf, mapped, model, hf_config.model_type)


def load_exported(hf: Any, mapped: Mapping[str, torch.Tensor], model: torch.nn.Module,
                  family: str) -> Any:
    """``hf`` holding ``mapped`` (its own parameter names), in ``model``'s dtype, in eval mode.

    Every parameter of ``hf`` must be in ``mapped`` and nothing else (the causal-mask buffers
    some GPT-2 versions keep aside); otherwise a ``ValueError`` names what did not map.
    """
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in mapped.items()},
                                             strict=False)
    missing = [k for k in missing if not k.endswith(_BUFFERS)]
    if missing or unexpected:
        raise ValueError(f"weights do not map onto {family}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return hf.to(next(model.parameters()).dtype).eval()


@contextmanager
def float64_islands_lifted(hf_model: Any) -> Iterator[Any]:
    """Within the block, transformers' Llama, Mistral, DeepSeek-V3 and Gemma 3 compute RMSNorm and
    RoPE in the model's dtype.

    transformers computes both in float32 whatever the model's dtype (an upcast meant for half
    precision), so an FP64 Llama is only float32-accurate there and differs from an exact FP64
    computation by about 1e-7. Inside this block the RMSNorms and the rotary tables follow the
    model's dtype, so an FP64 comparison measures FP64 rounding. Nothing changes for GPT-2 or
    for FP32 models beyond rounding of the rotary angles (float64 here, as in
    :mod:`kvdoc.core.rope`).
    """
    from kvdoc.core.rope import rope_angles

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

    config = hf_model.config
    patched = []
    if getattr(config, "model_type", None) == "gemma3_text":
        for module in hf_model.modules():
            name = type(module).__name__
            if name.endswith(("RMSNorm", "RotaryEmbedding")):
                patched.append(module)
                lifted = gemma_rms_norm if name.endswith("RMSNorm") else gemma_rotary
                module.forward = types.MethodType(lifted, module)
    if getattr(config, "model_type", None) in ("llama", "mistral", "deepseek_v3"):
        split_width = config.hidden_size // config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or split_width
        theta = float(config.rope_parameters["rope_theta"])
        for module in hf_model.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm"):
                patched.append(module)
                module.forward = types.MethodType(rms_norm, module)
            elif name.endswith("RotaryEmbedding"):
                patched.append(module)
                module.forward = types.MethodType(rotary, module)
    try:
        yield hf_model
    finally:
        for module in patched:
            del module.forward  # back to the class's method


def transformers_model(family: str, config: GPTConfig | None = None, seed: int = 0,
                       dtype: torch.dtype = torch.float32) -> Any:
    """A transformers model with random weights, built offline from a kvdoc config, in eval mode.

    Args:
        family: ``"gpt2"``, ``"llama"`` or ``"mistral"``.
        config: default :class:`GPTConfig` (GPT-2), :func:`~kvdoc.core.config.llama_config` or
            :func:`~kvdoc.core.config.mistral_config` (window 32).
        seed: ``torch.manual_seed`` before the weights are drawn.
        dtype: the model's dtype.

    >>> transformers_model("llama").config.num_key_value_heads
    2
    """
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM

    from kvdoc.core.config import llama_config, mistral_config

    builders = {"gpt2": (GPT2LMHeadModel, GPTConfig), "llama": (LlamaForCausalLM, llama_config),
                "mistral": (MistralForCausalLM, mistral_config)}
    if family not in builders:
        raise ValueError(f"family must be one of {', '.join(builders)}, got {family!r}")
    cls, default = builders[family]
    hf_config = transformers_config(config or default())
    if hf_config.model_type != family:
        raise ValueError(f"this config builds a {hf_config.model_type} model, not {family}")
    torch.manual_seed(seed)
    return cls(hf_config).to(dtype).eval()
