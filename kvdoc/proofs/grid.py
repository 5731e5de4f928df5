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
['bamba', 'deep', 'deltanet', 'gemma3', 'gemma3-global-first', 'gpt-oss', 'gpt-oss-split-k',
 'gqa', 'indexed', 'llama', 'mha', 'mistral', 'mla', 'mla-absorbed', 'mqa', 'qwen2', 'qwen3',
 'split-k', 'v4-compressed']
>>> sorted(CACHES), sorted(IMPLEMENTATIONS)  # doctest: +NORMALIZE_WHITESPACE
(['compressed', 'dynamic', 'hybrid', 'paged', 'shared-prefix', 'state', 'static', 'window'],
 ['fast', 'model'])
>>> MODELS["gqa"].build(0).config.n_kv_head
2
>>> served(MODELS["mla"].build(0).config)  # FastDecoder fuses K/V attention: not MLA's
[('dynamic', 'model'), ('static', 'model'), ('paged', 'model'), ('shared-prefix', 'model')]
>>> served(MODELS["gemma3"].build(0).config, kinds=["paged", "window", "hybrid"])
[('paged', 'model'), ('hybrid', 'model')]
>>> served(MODELS["bamba"].build(0).config)  # paged: blocks for attention, states beside
[('paged', 'model'), ('shared-prefix', 'model'), ('state', 'model')]
>>> served(MODELS["indexed"].build(0).config)  # indexer keys beside the latent, any kind
[('dynamic', 'model'), ('static', 'model'), ('paged', 'model'), ('shared-prefix', 'model')]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvdoc.core.cache import KVCache
from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder, GatedRMSNorm
from kvdoc.core.fast import FastDecoder
from kvdoc.core.frame import GLOBAL, SLIDING
from kvdoc.core.gemma import Gemma3Config, Gemma3Decoder, GemmaRMSNorm
from kvdoc.core.gptoss import GptOssConfig, GptOssDecoder
from kvdoc.core.indexed import IndexedConfig, IndexedDecoder
from kvdoc.core.mamba2 import Mamba2Config, MambaDecoder
from kvdoc.core.mla import MLAConfig, MLADecoder
from kvdoc.core.model import Decoder, GPTConfig, llama_config, mistral_config
from kvdoc.core.state import StateSpec
from kvdoc.core.v4 import CompressedConfig, CompressedDecoder
from kvdoc.serving.paged import new_paged_cache, new_shared_prefix_cache
from kvdoc.serving.splitk import split_k_decoder

from .references import (
    bamba_reference,
    deepseek_reference,
    deepseek_v32_reference,
    mha_reference,
    qwen35_reference,
    transformers_reference,
    v4_reference,
)

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
THOROUGH = dict(length=150, chunks=(1, 2, 3, 5, 7, 16, 17, 31, 32, 33, 64), batches=(3, 1))
"""The ``--thorough`` grid: a stream past 128, more chunk sizes, batch 3 and 1 (on the next
seed's weights: :func:`~kvdoc.proofs.verify.verify_passes`)."""
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
INDEXED_SEEDS = 57
"""The indexed model's weights are drawn from seed ``57 + s``: the first offset whose verify
streams (default and ``--thorough``) leave no near-tie at the k-th place, where rounding would
choose the keys (tests/test_indexed.py::test_the_grid_streams_decide_the_selection)."""
INDEXED = IndexedConfig(**dataclasses.asdict(MLA), index_n_heads=2, index_head_dim=10, index_topk=7)
"""MLA's sizes with DeepSeek-V3.2's indexer, every indexer size off
:class:`~kvdoc.core.indexed.IndexedConfig`'s default: 7 keys a query of the 67-token stream, so
the selection matters from position 7 on; 2 indexer heads, so a quarter of the keys score an
exact 0 and ties at the 7th place are common (18 of the stream's 134 rows in FP32 at seed 0):
the grid runs on ties."""
INDEXED_SCENARIOS = ("stream", "last_only", "reference", "counted", "crop", "branch", "failure",
                     "bytes", "edges", "padded", "evicted")
"""What the indexed model runs: the selection's paths (chunks, steps, a pad mask, the reference)
and its composed cache's life (bytes, crop, branches, a failed call, a radix tree's evictions
over a pool that holds the indexer keys beside the latent); generation, weights and low
precision see nothing the MLA models do not."""
GEMMA = Gemma3Config(vocab_size=89, n_positions=256, n_head=6, n_kv_head=3, n_embd=48, n_inner=96,
                     head_dim=12, query_pre_attn_scalar=20, n_layer=3, sliding_window=WINDOW,
                     sliding_window_pattern=3, layer_norm_epsilon=1e-5,
                     rope_theta=500000.0, rope_local_base_freq=20000.0,
                     final_logit_softcapping=3.0, tie_word_embeddings=False)
"""Every value off :class:`~kvdoc.core.gemma.Gemma3Config`'s default: two window layers, then a
global one; ``head_dim`` not ``n_embd / n_head``, the softmax scale not ``head_dim ** -0.5``,
two RoPE bases, a soft cap that bends the logits."""
GEMMA_GLOBAL_FIRST = dataclasses.replace(GEMMA, global_layers=(0,))  # no pattern gives it
DELTANET = DeltaNetConfig(vocab_size=89, n_positions=256, n_embd=40, n_inner=72, n_layer=3,
                          layer_types=("full_attention", "linear_attention", "linear_attention"),
                          n_head=3, n_kv_head=1, head_dim=12,
                          partial_rotary_factor=0.5, rope_theta=500000.0, linear_num_key_heads=3,
                          linear_num_value_heads=6, linear_key_head_dim=6, linear_value_head_dim=10,
                          linear_conv_kernel_dim=3, layer_norm_epsilon=1e-5,
                          tie_word_embeddings=True, chunk_size=6)
"""Every value off :class:`~kvdoc.core.deltanet.DeltaNetConfig`'s default: a gated attention
layer, then two Gated DeltaNet layers (a layout no every-k-th interval gives); 3 key heads
serving 6 value heads of another width, a 3-tap conv, half of each attention head rotated, and a
prefill chunk of 6 that no stream chunk matches (a 13-token call crosses two of its
boundaries)."""
MAMBA2 = Mamba2Config(vocab_size=89, n_positions=256, n_layer=3, attn_layers=(1,), n_embd=48,
                      n_inner=72, n_head=6, n_kv_head=3, mamba_n_heads=12, mamba_n_groups=3,
                      mamba_d_state=10, mamba_d_conv=3, mamba_expand=3, chunk_size=7,
                      conv_bias=False, proj_bias=True, time_step_limit=(0.05, 1.5),
                      layer_norm_epsilon=1e-4, rope_theta=500000.0, tie_word_embeddings=True)
"""Every value off :class:`~kvdoc.core.mamba2.Mamba2Config`'s and ``BambaConfig``'s defaults:
a Mamba layer, an attention layer, a Mamba layer; 3 groups of 4 heads sharing B and C, a
convolution of 3 (a state of 2 inputs), chunks of 7 (none of the stream's chunk sizes), a
``dt`` clamp that binds."""
STATE_SCENARIOS = ("stream", "last_only", "reference", "prefill_decode", "crop", "branch",
                   "failure", "bytes", "edges", "padded", "evicted")
"""The checks that see a state layer (a fork, a refused crop and a restored snapshot, a refused
padded call, a state that does not grow, a radix tree resuming at saved states); the rest (a
fresh copy, weights changed in place, quantised K/V) see nothing a state adds to the attention
models' runs."""
V4 = CompressedConfig(vocab_size=89, n_positions=256, layer_types=("hca", "csa"),
                      n_embd=40, n_head=3, head_dim=14, rope_head_dim=6, q_lora_rank=11,
                      o_groups=3, o_lora_rank=5, n_inner=56, sliding_window=7, csa_rate=3,
                      hca_rate=5, index_n_heads=8, index_head_dim=10, index_topk=3,
                      rope_theta=5000.0, compress_rope_theta=70000.0, layer_norm_epsilon=1e-5,
                      tie_word_embeddings=True)
"""Every size off :class:`~kvdoc.core.v4.CompressedConfig`'s default, an HCA layer then a CSA
layer (a window-only layer is the window part of either, matched in tests/test_compressed.py):
blocks of 5 and of 3 (the indexer picking 3 entries), which neither the stream (67) nor a chunk
of 2 or 13 divides, and a window of 7, which the stream and the chunk of 13 cross. 8 indexer
heads: an entry every head's ReLU zeroes scores 0, a tie; with 8 heads one in 256 does, so the
reference (whose top-k breaks ties its own way) rarely meets one."""
V4_SCENARIOS = ("stream", "reference", "crop", "failure", "bytes", "edges")
"""What the V4 model runs, the checks that see its caches (last_only, prefill and decode_step,
generate, fresh and weights are Decoder's, run on every other model): not ``padded`` (its
blocks count from each row's position 0, so it refuses per-row positions), nor the byte figures
or quantised caches, which know K/V and latent layers only."""
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


def _decoder(config: GPTConfig | MLAConfig, offset: int = 0) -> Callable[[int], nn.Module]:
    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed + offset)
        cls = {MLAConfig: MLADecoder, Gemma3Config: Gemma3Decoder, DeltaNetConfig: DeltaNetDecoder,
               Mamba2Config: MambaDecoder, IndexedConfig: IndexedDecoder,
               CompressedConfig: CompressedDecoder,
               GptOssConfig: GptOssDecoder}.get(type(config), Decoder)
        model = cls(config).eval()
        with torch.no_grad():  # Gemma's norms start at zero weight: norms swapped would not show
            for norm in (m for m in model.modules()
                         if isinstance(m, (GemmaRMSNorm, GatedRMSNorm))):
                norm.weight.normal_(0.0, 0.3)
            if cls is MambaDecoder:  # off transformers' init (norms at 1, D and dt_bias at 1)
                _spread_mamba(model)
        if getattr(config, "tie_word_embeddings", False):
            # a head tied to wte at PyTorch's N(0, 1) gives logits ~sqrt(d) wide, where FP32
            # rounding alone nears the tolerance; transformers initialise wte at N(0, 0.02)
            with torch.no_grad():
                model.wte.weight.mul_(0.02)
        return model
    return build


def _kv(config: GPTConfig | MLAConfig) -> bool:
    return isinstance(config, GPTConfig)  # an MLA model caches a latent instead


def _spread_mamba(model: MambaDecoder) -> None:
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight", "ln_f.weight")):
            p.normal_(1.0, 0.3)
        elif name.endswith(("dt_bias", "D")):
            p.normal_(0.0, 1.0)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.5)  # A = -exp(A_log): decays from fast to slow


def _stateful(config: object) -> bool:  # a recurrent layer keeps a state, not rows
    return any(isinstance(spec, StateSpec) for spec in config.cache_layout)


def _rows(config: object) -> bool:
    # every layer caches whole rows: not a recurrent state, nor a V4 model's pooled blocks
    return not _stateful(config) and not isinstance(config, CompressedConfig)


def _paged(config: object) -> bool:  # rows in blocks, a recurrent state beside them: not V4's
    return not isinstance(config, CompressedConfig)


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
    # DeepSeek-V3.2: each query reads the top 7 keys its indexer scores, ties to the earlier one;
    # transformers breaks ties by topk, which depends on the row's length, so the reference is
    # transformers with kvdoc's tie rule (kvdoc.core.indexed says why)
    "indexed": ModelSpec("DeepSeek-V3.2-style indexed attention: MLA of mla's sizes, each query "
                         "reads the top 7 of its indexer's 2-head scores, ties to the earlier",
                         _decoder(INDEXED, INDEXED_SEEDS), deepseek_v32_reference,
                         "transformers DeepSeek-V3.2, same weights, ties to the earlier position",
                         scenarios=INDEXED_SCENARIOS),
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
    # a fixed-size state per DeltaNet layer beside a growing K/V layer, in one cache
    "deltanet": ModelSpec("Qwen3.5-style: 1 gated attention layer (half-rotary heads), then 2 "
                          "Gated DeltaNet layers (conv 3 taps, 3 key / 6 value heads)",
                          _decoder(DELTANET), qwen35_reference,
                          "transformers Qwen3.5, same weights", scenarios=STATE_SCENARIOS),
    # Mamba-2 layers (a conv state and an SSD state per sequence) beside an attention layer
    "bamba": ModelSpec("Bamba-style Mamba-2 hybrid: Mamba, attention, Mamba; SSD state "
                       "[B, 12, 12, 10], conv state of 2 inputs; RoPE on half of each head",
                       _decoder(MAMBA2), bamba_reference, "transformers Bamba, same weights",
                       scenarios=STATE_SCENARIOS),
    # DeepSeek-V4's attention with dense MLPs: matched to transformers at the layer
    # (tests/test_compressed.py), as transformers' V4 is MoE-only with hyper-connections
    "v4-compressed": ModelSpec("DeepSeek-V4-style: an HCA layer (blocks of 5), a CSA layer (blocks "
                               "of 3, top 3); window 7, K = V, sinks",
                               _decoder(V4), v4_reference,
                               "kvdoc's decoder with transformers' DeepseekV4Attention layers",
                               scenarios=V4_SCENARIOS),
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
    "dynamic": CacheSpec(lambda m, b, cap: m.new_cache(b, "dynamic"), in_place=False,
                         serves=_rows),
    "static": CacheSpec(lambda m, b, cap: m.new_cache(b, "static", cap), in_place=True,
                        serves=_rows),
    "window": CacheSpec(lambda m, b, cap: m.new_cache(b, "window"), in_place=False,
                        serves=lambda config: _kv(config) and config.sliding_window is not None),
    # every position of every layer in blocks of the pool's layout (K/V or an MLA latent); a
    # windowed layer's own mask limits what it reads, as over a dynamic cache
    "paged": CacheSpec(new_paged_cache, in_place=True,
                       serves=_paged),
    "shared-prefix": CacheSpec(new_shared_prefix_cache, in_place=False,
                               serves=_paged),
    "hybrid": CacheSpec(lambda m, b, cap: m.new_cache(b, "hybrid"), in_place=False,
                        serves=lambda config: hasattr(config, "layer_windows")),
    # a state layer per recurrent layer, a growing K/V layer per attention layer
    "state": CacheSpec(lambda m, b, cap: m.new_cache(b, "state"), in_place=False,
                       serves=_stateful),
    # a V4 model's window, entries and block buffers (kvdoc.core.compressed)
    "compressed": CacheSpec(lambda m, b, cap: m.new_cache(b, "compressed"), in_place=False,
                            serves=lambda config: isinstance(config, CompressedConfig)),
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
