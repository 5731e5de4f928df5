"""The axes of the verification grid: model configurations, cache kinds, implementations.

This is the one place to plug something new into ``python -m kvdoc verify``: one entry in
:data:`MODELS`, :data:`CACHES` or :data:`IMPLEMENTATIONS` puts it on the default grid of
:func:`kvdoc.proofs.suite.run_suite`, where every registered scenario runs on it. A model has the
:class:`~kvdoc.core.model.Decoder` interface, its layers in ``model.h`` or ``model.layers`` (the
``failure`` scenario raises in them); an implementation is called as the model is, also with
``cache=None`` for a full forward (:class:`kvdoc.core.fast.FastDecoder` is ``"fast"``: the speed
of its decode step is proved not to cost correctness). Something not registered is passed in:
``run_suite(model=...)``.

>>> sorted(MODELS)  # doctest: +NORMALIZE_WHITESPACE
['deep', 'gemma3', 'gemma3-global-first', 'gpt-oss', 'gpt-oss-split-k', 'gqa', 'llama', 'mha',
 'mistral', 'mla', 'mla-absorbed', 'mqa', 'qwen2', 'qwen3', 'split-k']
>>> sorted(CACHES), sorted(IMPLEMENTATIONS)
(['dynamic', 'hybrid', 'paged', 'shared-prefix', 'static', 'window'], ['fast', 'model'])
>>> MODELS["gqa"].build(0).config.n_kv_head
2
>>> served(MODELS["mla"].build(0).config)  # FastDecoder fuses K/V attention: not MLA's
[('dynamic', 'model'), ('static', 'model'), ('paged', 'model'), ('shared-prefix', 'model')]
>>> served(MODELS["gemma3"].build(0).config, kinds=["paged", "window", "hybrid"])
[('paged', 'model'), ('hybrid', 'model')]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvdoc.core.cache import KVCache
from kvdoc.core.fast import FastDecoder
from kvdoc.core.gemma import GLOBAL, SLIDING, Gemma3Config, Gemma3Decoder, GemmaRMSNorm
from kvdoc.core.gptoss import GptOssConfig, GptOssDecoder
from kvdoc.core.mla import MLAConfig, MLADecoder
from kvdoc.core.model import Decoder, GPTConfig, llama_config, mistral_config
from kvdoc.serving.paged import new_paged_cache, new_shared_prefix_cache
from kvdoc.serving.splitk import split_k_decoder

from .references import deepseek_reference, mha_reference, transformers_reference

STREAM_LENGTH = 67
"""Tokens in the default stream: past 32 and 64, and prime, so no chunk size above 1 divides it."""
WINDOW = 16
"""The Mistral-style model's window: the default stream crosses it four times."""
SPLIT = 5
"""Keys per chunk of the split-K model: divides neither the window nor the stream."""
CHUNKS = (1, 2, 5, 13)
"""Chunk sizes of the default stream checks."""
BATCHES = (2,)
"""Batch sizes of the default stream checks (other scenarios also run batch 1 where it matters)."""
THOROUGH = dict(length=150, chunks=(1, 2, 3, 5, 7, 16, 17, 31, 32, 33, 64), batches=(3, 1),
                seeds=(0, 1))
"""The ``--thorough`` grid: a stream past 128, more chunk sizes, batch 3 and 1, two seeds."""
GRID = dict(kinds=("dynamic", "static"), impls=("model",), batches=(1, 2), scenarios=("stream",))
"""The equivalence grid of a given model: ``run_suite(**GRID, model=...)``."""


# every size and switch off GPTConfig's default
LLAMA = llama_config(vocab_size=89, n_positions=256, n_layer=1, n_head=6, n_embd=96,
                     n_kv_head=2, rope_theta=500000.0, tie_word_embeddings=True)
QWEN2, QWEN3 = (dataclasses.replace(LLAMA, qkv_bias=True),
                dataclasses.replace(LLAMA, qk_norm=True, head_size=20))
# 12 layers (two-digit indices), narrow so that it stays cheap
DEEP = llama_config(vocab_size=89, n_positions=256, n_layer=12, n_head=2, n_embd=16, n_inner=24,
                    n_kv_head=1)
MLA = MLAConfig(vocab_size=89, n_positions=256, n_layer=1, n_head=3, n_embd=48, n_inner=96,
                q_lora_rank=12, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=6,
                v_head_dim=20, layer_norm_epsilon=1e-5, rope_theta=500000.0)
"""Every size off :class:`~kvdoc.core.mla.MLAConfig`'s default (V's head width not the
non-rotary key's); a rotary width of 6, the smallest at which DeepSeek's permutation differs
from its inverse (:mod:`kvdoc.proofs.broken.loaders`)."""
GEMMA = Gemma3Config(vocab_size=89, n_positions=256, n_head=6, n_kv_head=3, n_embd=48, n_inner=96,
                     head_dim=12, query_pre_attn_scalar=20, n_layer=3, sliding_window=WINDOW,
                     sliding_window_pattern=3, layer_norm_epsilon=1e-5,
                     rope_theta=500000.0, rope_local_base_freq=20000.0,
                     final_logit_softcapping=3.0, tie_word_embeddings=False)
"""Every value off :class:`~kvdoc.core.gemma.Gemma3Config`'s default: two window layers, then a
global one; ``head_dim`` not ``n_embd / n_head``, the softmax scale not ``head_dim ** -0.5``,
two RoPE bases, a soft cap that bends the logits."""
GEMMA_GLOBAL_FIRST = dataclasses.replace(GEMMA, global_layers=(0,))  # no pattern gives it
SINKS = GptOssConfig(vocab_size=89, n_positions=256, n_head=6, n_kv_head=3, n_embd=42,
                     head_dim=10, n_inner=22, n_experts=5, experts_per_token=3, n_layer=3,
                     sliding_window=WINDOW, layer_norm_epsilon=1e-4, rope_theta=500.0,
                     yarn_factor=4.0, yarn_original_positions=64, yarn_beta_fast=4.0,
                     yarn_beta_slow=0.5, yarn_truncate=True, swiglu_alpha=1.5, swiglu_limit=1.5,
                     tie_word_embeddings=True)
"""Every value off :class:`~kvdoc.core.gptoss.GptOssConfig`'s default: a window layer, a full
one, a window one; 3 of 5 experts a token, a clamp that bites; YaRN whose ramp has pairs inside
it (truncated to pairs 0 .. 3 of 5), its original context 256 / 4, so transformers does not warn."""
SINKS_FULL_FIRST = dataclasses.replace(SINKS, layer_types=(GLOBAL, SLIDING, SLIDING))
""":data:`SINKS` with its full layer first: ``layer_types`` off its default (the split-K model)."""
SINK_SCENARIOS = ("stream", "reference")
"""The checks split-K with sinks runs: a sink counted per split shows in the stream (full and
cached split differently) and against transformers; its caches and calls are gpt-oss's, which
the gpt-oss model runs every check on."""
LAYOUT_SCENARIOS = ("stream", "counted", "reference")
"""The checks that see a layer out of order or of the wrong type, which the deep and global-first
models run; the rest see nothing a twelfth layer or a global layer first adds."""


def _decoder(config: GPTConfig | MLAConfig) -> Callable[[int], nn.Module]:
    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        cls = {MLAConfig: MLADecoder, Gemma3Config: Gemma3Decoder,
               GptOssConfig: GptOssDecoder}.get(type(config), Decoder)
        model = cls(config).eval()
        with torch.no_grad():  # Gemma's norms start at zero weight: norms swapped would not show
            for norm in (m for m in model.modules() if isinstance(m, GemmaRMSNorm)):
                norm.weight.normal_(0.0, 0.3)
        if getattr(config, "tie_word_embeddings", False):
            # a head tied to wte at PyTorch's N(0, 1) gives logits ~sqrt(d) wide, where FP32
            # rounding alone nears the tolerance; transformers initialise wte at N(0, 0.02)
            with torch.no_grad():
                model.wte.weight.mul_(0.02)
        return model
    return build


def _kv(config: GPTConfig | MLAConfig) -> bool:
    return isinstance(config, GPTConfig)  # an MLA model caches a latent instead


@dataclass(frozen=True)
class ModelSpec:
    """One model configuration: ``build(seed)`` in FP32 and eval mode; ``reference(model)``,
    ``ids -> logits`` of an implementation independent of the model's code, built from its
    weights; the ``impls`` and ``scenarios`` it runs unless ``run_suite`` is given some (None:
    all that serve it; a model there for one property runs the checks that can see it)."""

    describe: str
    build: Callable[[int], nn.Module]
    reference: Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]] | None = None
    reference_name: str = ""
    impls: tuple[str, ...] | None = None
    scenarios: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CacheSpec:
    """One cache kind: ``new(model, batch, capacity)``, whether a call writes into the cache passed
    in (a static cache) or must leave it unchanged (a dynamic one), which models it serves."""

    new: Callable[[nn.Module, int, int], KVCache]
    in_place: bool
    serves: Callable[[GPTConfig | MLAConfig], bool] = lambda config: True


MODELS: dict[str, ModelSpec] = {
    "mha": ModelSpec("GPT-2, 4 query heads, 4 K/V heads", _decoder(GPTConfig()),
                     transformers_reference, "transformers GPT-2, same weights"),
    "gqa": ModelSpec("GPT-2, 4 query heads, 2 K/V heads", _decoder(GPTConfig(n_kv_head=2)),
                     mha_reference, "MHA with each K/V head copied over its group"),
    # mqa and llama leave no function-changing config value at its default (with mistral's
    # window): a code path that ignores one shows on them (tests/test_grid_config.py)
    "mqa": ModelSpec("GPT-2, 4 query heads, 1 K/V head, norm eps 1e-4",
                     _decoder(GPTConfig(n_kv_head=1, layer_norm_epsilon=1e-4)),
                     mha_reference, "MHA with the K/V head copied over all query heads"),
    "llama": ModelSpec("Llama-style: RoPE base 5e5, RMSNorm, SwiGLU, 1 layer, width 96, "
                       "6 query heads, 2 K/V heads, tied LM head",
                       _decoder(LLAMA), transformers_reference, "transformers Llama, same weights"),
    "qwen2": ModelSpec("Qwen2-style: llama with Q/K/V biases", _decoder(QWEN2),
                       transformers_reference, "transformers Qwen2, same weights"),
    "qwen3": ModelSpec("Qwen3-style: llama with q/k norms, heads 20 wide", _decoder(QWEN3),
                       transformers_reference, "transformers Qwen3, same weights"),
    "mistral": ModelSpec(f"Mistral-style: Llama with a sliding window of {WINDOW} positions",
                         _decoder(mistral_config(sliding_window=WINDOW)), transformers_reference,
                         "transformers Mistral, same weights"),
    # split-K attention is an implementation of attention, not of a call: the model attends that
    # way in its full forward too, so the reference (SDPA throughout) is what tells it apart
    "split-k": ModelSpec(f"Mistral-style, split-K attention over chunks of {SPLIT} keys",
                         lambda seed: split_k_decoder(
                             _decoder(mistral_config(sliding_window=WINDOW))(seed), SPLIT),
                         transformers_reference, "transformers Mistral, same weights",
                         # FastDecoder's step attends with SDPA, not split-K: on this model it
                         # is mistral's fast step again (--thorough runs it all the same)
                         impls=("model",)),
    # MLA: a full forward up-projects the latent; the cached calls do too ("mla") or attend in
    # latent space ("mla-absorbed"), so cached-vs-full compares the absorbed path with the plain
    "mla": ModelSpec("MLA (DeepSeek-V3), latent 24 + rotary key 6, 3 heads, plain decode",
                     _decoder(MLA), deepseek_reference, "transformers DeepSeek-V3, same weights"),
    "mla-absorbed": ModelSpec("MLA, the same model, cached calls absorbed into the latent",
                              _decoder(dataclasses.replace(MLA, absorb=True)),
                              deepseek_reference, "transformers DeepSeek-V3, same weights"),
    # 12 layers: a loader or payload that orders layers by name ("h.10" before "h.2") shows
    "deep": ModelSpec("Llama-style, 12 layers, width 16, 2 query heads, 1 K/V head",
                      _decoder(DEEP), transformers_reference, "transformers Llama, same weights",
                      impls=("model",), scenarios=LAYOUT_SCENARIOS),
    # window and global layers in one model, cached in one hybrid cache (and, to compare, in a
    # dynamic or static one that keeps every position of every layer)
    "gemma3": ModelSpec(f"Gemma-3-style: 2 window layers of {WINDOW}, then 1 global; q/k norms, "
                        "GeGLU, soft-capped logits", _decoder(GEMMA), transformers_reference,
                        "transformers Gemma 3, same weights"),
    # a layout no every-k-th pattern gives: code that derives or exports the layout as a
    # pattern shows here (and a pattern one layer off on gemma3, whose global layer is last)
    "gemma3-global-first": ModelSpec(f"Gemma-3-style, the global layer first, then 2 window "
                                     f"layers of {WINDOW}", _decoder(GEMMA_GLOBAL_FIRST),
                                     transformers_reference, "transformers Gemma 3, same weights",
                                     impls=("model",), scenarios=LAYOUT_SCENARIOS),
    # a sink logit per head in every softmax, window and full layers on the hybrid cache, experts
    "gpt-oss": ModelSpec(f"gpt-oss-style: a sink per head, window layers of {WINDOW} around a "
                         "full one, 3 of 5 experts, YaRN", _decoder(SINKS),
                         transformers_reference, "transformers gpt-oss, same weights"),
    "gpt-oss-split-k": ModelSpec(f"gpt-oss-style, the full layer first, split-K attention over "
                                 f"chunks of {SPLIT} keys, the sinks merged once",
                                 lambda seed: split_k_decoder(_decoder(SINKS_FULL_FIRST)(seed),
                                                              SPLIT),
                                 transformers_reference, "transformers gpt-oss, same weights",
                                 impls=("model",), scenarios=SINK_SCENARIOS),
}
CACHES: dict[str, CacheSpec] = {
    "dynamic": CacheSpec(lambda m, b, cap: m.new_cache(b, "dynamic"), in_place=False),
    "static": CacheSpec(lambda m, b, cap: m.new_cache(b, "static", cap), in_place=True),
    "window": CacheSpec(lambda m, b, cap: m.new_cache(b, "window"), in_place=False,
                        serves=lambda config: _kv(config) and config.sliding_window is not None),
    # every position of every layer in blocks of the pool's layout (K/V or an MLA latent); a
    # windowed layer's own mask limits what it reads, as over a dynamic cache
    "paged": CacheSpec(new_paged_cache, in_place=True),
    "shared-prefix": CacheSpec(new_shared_prefix_cache, in_place=False),
    "hybrid": CacheSpec(lambda m, b, cap: m.new_cache(b, "hybrid"), in_place=False,
                        serves=lambda config: hasattr(config, "layer_windows")),
}


IMPLEMENTATIONS: dict[str, Callable[[nn.Module], Callable]] = {"model": lambda m: m,
                                                              "fast": FastDecoder}
"""How a cached call is made, by name: ``model -> call``."""
# which models an implementation serves, where not all: FastDecoder fuses K/V attention and
# has no place for q/k norms (``--thorough`` runs every implementation on what it serves)
IMPLEMENTATION_SERVES: dict[str, Callable[[GPTConfig | MLAConfig], bool]] = {
    "fast": lambda config: _kv(config) and not getattr(config, "qk_norm", False)}


def served(config: GPTConfig | MLAConfig, kinds: Sequence[str] | None = None,
           impls: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """The (cache kind, implementation) pairs of the grid that serve a model with ``config``."""
    return [(kind, impl) for kind in (kinds or CACHES) if CACHES[kind].serves(config)
            for impl in (impls or IMPLEMENTATIONS)
            if IMPLEMENTATION_SERVES.get(impl, lambda c: True)(config)]
