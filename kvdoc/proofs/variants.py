"""The broken variants by name: what each gets wrong, and the kind of mistake it stands for.

The code of each is in the package :mod:`kvdoc.proofs.broken`; this module is the list the suite
sweeps (``python -m kvdoc verify`` must catch every entry) and the pages show.

>>> all(v.bug_class in BUG_CLASSES for v in VARIANTS.values())
True
>>> VARIANTS["rope-restart"].models_among(["mha", "llama", "mistral", "mla"])
['llama', 'mistral']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvdoc.core.gemma import Gemma3Decoder
from kvdoc.core.model import Decoder

from .broken import (
    arithmetic,
    cache_kinds,
    caches,
    decoders,
    loaders,
    measures,
    padded,
    rotary,
    serving,
)
from .traits import FAMILIES, check_traits, grid_traits, traits


@dataclass(frozen=True)
class BrokenVariant:
    """One deliberately wrong implementation.

    Attributes:
        name: the key in :data:`VARIANTS` and the value of ``--variant``.
        breaks: one sentence: what is wrong.
        build: makes the broken model from a correct one (same weights, dtype, device).
        bug_class: the kind of mistake, one of :data:`BUG_CLASSES`.
        stale_prefix: a scenario, not code: the cached path's first chunk is fed the prefix as it
            was before an edit (:func:`kvdoc.proofs.broken.decoders.stale_prefix`), the rest the
            current tokens.
    """

    name: str
    breaks: str
    build: Callable[[Decoder], Decoder]
    bug_class: str = "mask and positions"
    stale_prefix: bool = False
    needs: tuple[str, ...] = ("decoder",)
    """The traits (:data:`kvdoc.proofs.traits.TRAITS`) a model must have for the variant to be
    built from it: most break a K/V :class:`~kvdoc.core.model.Decoder` of a GPTConfig. Given as
    any collection, kept sorted (a set's order would change the page that lists it)."""
    one_model: bool = False
    """Run on the first model among the axes that has :attr:`needs` only: a bug in a pool, a
    cache kind or the scheduler shows on any of them, and one keeps the sweep short."""
    caches: Mapping[str, Callable] = field(default_factory=dict)
    """Broken cache factories ``(model, batch, capacity) -> cache`` in place of the real ones, by
    kind of :data:`kvdoc.proofs.grid.CACHES` (or a scenario's key: ``"int8"``, ``"fp8"``,
    ``"packer"``, ``"reference"``, ...)."""
    kinds: tuple[str, ...] | None = None
    """The cache kinds it runs on (those its broken caches replace); None: every kind."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """The dtypes a sweep runs it in (those it can show in); None: every dtype swept."""

    def __post_init__(self) -> None:
        needs = check_traits(self.needs)
        if len(needs.intersection(FAMILIES)) != 1:
            raise ValueError(f"variant {self.name!r} must need one family of "
                             f"{sorted(FAMILIES)}, got {sorted(needs)}")
        object.__setattr__(self, "needs", tuple(sorted(needs)))

    def builds_on(self, config: object) -> bool:
        """Whether it can be built from a model with ``config`` (of its family): a model given
        by name runs it even without the traits it needs to show (to see it escape)."""
        return traits(config).issuperset(set(FAMILIES).intersection(self.needs))

    def models_among(self, names: Sequence[str]) -> list[str]:
        """The models of ``names`` (of :data:`kvdoc.proofs.grid.MODELS`) it runs on."""
        hosts = [n for n in names if grid_traits(n).issuperset(self.needs)]
        return hosts[:1] if self.one_model else hosts


BUG_CLASSES = ("mask and positions", "cache storage", "long stream", "grouped-query attention",
               "last_only and generation", "crop and branch", "shared path", "failure mid-call",
               "rotary positions", "state across calls", "configuration value", "stale weights",
               "byte accounting", "int8 contract", "ring and block edges", "padded batches",
               "fp8 contract",
               "reduction order", "low precision", "payload dtype", "loader layout")
"""The kinds of mistake the variants stand for."""

def _copy(cls: type[Decoder]) -> Callable[[Decoder], Decoder]:
    return lambda m: decoders.copy_as(m, cls)


def _attention(cls: type) -> Callable[[Decoder], Decoder]:
    return lambda m: decoders.with_attention(m, cls)


VARIANTS: dict[str, BrokenVariant] = {v.name: v for v in (
    BrokenVariant("positions-restart",
                  "position ids restart at 0 on every call instead of at the cache length",
                  _copy(decoders.PositionsRestartDecoder), needs={"decoder", "learned"}),
    BrokenVariant("top-left-mask",
                  "the causal mask is not offset by the cache length (is_causal=True's top-left "
                  "triangle), also for one-token decode",
                  _attention(decoders.TopLeftMaskAttention)),
    BrokenVariant("no-mask", "no mask at all, so a chunk of several tokens reads its own future",
                  _attention(decoders.NoMaskAttention)),
    BrokenVariant("off-by-one-mask",
                  "the mask allows j <= P + i + 1: each query also reads the next token",
                  _attention(decoders.OffByOneMaskAttention)),
    BrokenVariant("cross-layer-cache", "every layer attends over layer 0's K/V instead of its own",
                  _copy(caches.CrossLayerDecoder), "cache storage"),
    BrokenVariant("new-before-old", "new K/V are concatenated before the cached ones, not after",
                  _copy(caches.NewBeforeOldDecoder), "cache storage"),
    BrokenVariant("stale-cache",
                  "a cache filled before a prefix edit (token 0 changed) is reused after it",
                  _copy(Decoder), "cache storage", stale_prefix=True),
    BrokenVariant("fp32-cache",
                  "a dynamic cache rounds the K/V it stores to FP32, also in an FP64 model",
                  _copy(caches.FP32CacheDecoder), "cache storage", dtypes=(torch.float64,)),
    BrokenVariant("modulo-slots",
                  "a static cache writes position t into slot t % 32 and reads slots as linear",
                  _copy(caches.ModuloDecoder), "long stream"),
    BrokenVariant("window-32", "a dynamic cache silently keeps only the newest 32 positions",
                  _copy(caches.WindowDecoder), "long stream"),
    BrokenVariant("gqa-tiled-cached",
                  "cached calls share K/V heads by tiling (h % H_kv), not by group",
                  _attention(decoders.TiledGQAAttention), "grouped-query attention",
                  needs={"decoder", "grouped"}),
    BrokenVariant("gqa-tiled-shared",
                  "every call shares K/V heads by tiling (h % H_kv), not by group",
                  _attention(decoders.SharedTiledGQAAttention), "grouped-query attention",
                  needs={"decoder", "grouped"}),
    BrokenVariant("last-only-first-row", "last_only=True returns the first new position's logits",
                  _copy(decoders.LastOnlyFirstRowDecoder), "last_only and generation"),
    BrokenVariant("position-counter",
                  "positions come from a counter on the model, not the cache length",
                  _copy(decoders.PositionCounterDecoder), "crop and branch",
                  needs={"decoder", "learned"}),
    BrokenVariant("clamped-positions",
                  "positions past 31 are clamped to 31 in every forward, full or cached",
                  _copy(decoders.ClampedPositionsDecoder), "shared path",
                  needs={"decoder", "learned"}),
    BrokenVariant("static-early-length",
                  "a static cache's length advances before every layer succeeded",
                  _copy(caches.EarlyLengthDecoder), "failure mid-call"),
    BrokenVariant("dynamic-in-place",
                  "a dynamic cache is written in place, so a failed call leaves a partial write",
                  _copy(caches.InPlaceDecoder), "failure mid-call"),
    BrokenVariant("static-last-layer-length",
                  "a static cache's length advances in the last layer's update, before the call "
                  "finished", _copy(caches.LastLayerLengthDecoder), "failure mid-call"),
    BrokenVariant("fast-step-snapshot",
                  "the fast decode step keeps the weights it copied first, never seeing a change",
                  _copy(decoders.SnapshotFastStepDecoder), "stale weights"),
    BrokenVariant("unrotated-k-cache",
                  "K is cached before RoPE; keys read back from the cache are never rotated",
                  rotary.unrotated_k, "rotary positions", needs={"decoder", "rope"}),
    BrokenVariant("rope-restart",
                  "RoPE turns each call's Q and K at positions 0..C-1, not at the cache length",
                  rotary.rope_restart, "rotary positions", needs={"decoder", "rope"}),
    BrokenVariant("pool-counts-k-only", "a paged pool's byte figures count K's bytes, not V's",
                  _copy(Decoder), "byte accounting", one_model=True, kinds=("paged",),
                  caches={"paged": cache_kinds.k_only_paged_cache}),
    BrokenVariant("int8-requantise",
                  "the int8 cache re-quantises every held row on each append, one scale a tensor",
                  _copy(Decoder), "int8 contract", needs={"decoder", "grouped"}, one_model=True,
                  kinds=("dynamic",),
                  caches={"int8": cache_kinds.requantising_int8_cache}),
    BrokenVariant("int8-read-v-scale",
                  "the int8 cache hands attention K dequantised with V's scales (what it stores "
                  "and layer() returns is right)",
                  _copy(Decoder), "int8 contract", needs={"decoder", "grouped"}, one_model=True,
                  kinds=("dynamic",),
                  caches={"int8": cache_kinds.v_scale_read_int8_cache}),
    BrokenVariant("int8-narrow-arithmetic",
                  "the int8 cache quantises and dequantises in the model's dtype: right in FP32 "
                  "and FP64; in BF16 or FP16 a value can land past its dtype's bound",
                  _copy(Decoder), "int8 contract",
                  needs={"decoder"}, one_model=True, kinds=("dynamic",),
                  caches={"int8": cache_kinds.narrow_int8_cache}),
    BrokenVariant("fp8-tensor-scale-write",
                  "the FP8 cache states per-head scales and reads with them, but quantises each "
                  "write under one scale for the tensor (its largest head's)",
                  _copy(Decoder), "fp8 contract", needs={"decoder", "grouped"}, one_model=True,
                  kinds=("dynamic",), caches={"fp8": cache_kinds.tensor_scale_fp8_cache}),
    BrokenVariant("fp8-rescale-each-write",
                  "the FP8 cache takes new scales from every write, decode steps included, and "
                  "reads the rows it held under them",
                  _copy(Decoder), "fp8 contract", one_model=True, kinds=("dynamic",),
                  caches={"fp8": cache_kinds.rescaling_fp8_cache}),
    BrokenVariant("ring-long-chunk",
                  "a chunk longer than the window puts its first W rows in the ring, not its last",
                  _copy(Decoder), "ring and block edges", needs={"decoder", "window"},
                  one_model=True, kinds=("window",),
                  caches={"window": cache_kinds.long_chunk_ring_cache}),
    BrokenVariant("ring-shared-until-wrap",
                  "a call shares the ring it continues until a held slot would be overwritten, so "
                  "two branches before the wrap write into one ring",
                  _copy(Decoder), "ring and block edges", needs={"decoder", "window"},
                  one_model=True, kinds=("window",),
                  caches={"window": cache_kinds.lazy_ring_cache}),
    BrokenVariant("prefix-late-copy",
                  "copy-on-write skips the shared, partly filled block a write continues",
                  _copy(Decoder), "ring and block edges", one_model=True,
                  kinds=("shared-prefix",),
                  caches={"shared-prefix": cache_kinds.late_copy_shared_prefix_cache}),
    BrokenVariant("decode-without-pad-mask",
                  "a padded batch's pad mask is passed on the prompt call, not on decode steps",
                  _copy(decoders.DecodeWithoutPadMaskDecoder), "padded batches",
                  one_model=True, kinds=("dynamic",)),
    BrokenVariant("fast-ignores-padding",
                  "the fast decode step ignores the padding arguments (positions, pad mask)",
                  _copy(decoders.PaddingBlindFastDecoder), "padded batches",
                  needs={"decoder", "learned", "grouped"}, one_model=True,
                  kinds=("static",)),
    BrokenVariant("rope-table-growth",
                  "RoPE's cos/sin table, built on the first call, grows with rows from position 0",
                  rotary.growing_table, "state across calls", needs={"decoder", "rope"}),
    BrokenVariant("rope-default-base",
                  "RoPE turns at the default base 10000, not config.rope_theta",
                  rotary.default_base, "configuration value", needs={"decoder", "rope"}),
    BrokenVariant("hybrid-rings-global",
                  "the hybrid cache rings the global layers too, so they lose keys past the window",
                  lambda m: decoders.copy_as(m, Gemma3Decoder), "ring and block edges",
                  needs={"gemma", "hybrid"}, kinds=("hybrid",),
                  caches={"hybrid": cache_kinds.ringed_global_hybrid_cache}),
    BrokenVariant("chunk-split-attention",
                  "attention reads the cached keys and the chunk's keys apart and merges them: "
                  "exact in arithmetic, but the bits follow the chunking",
                  _attention(arithmetic.ChunkSplitAttention), "reduction order", one_model=True,
                  kinds=("dynamic",)),
    BrokenVariant("fp8-reads-in-half",
                  "in a BF16 or FP16 model, attention reads K and V rounded to FP8 e4m3",
                  # shown on one model, the Llama-style one: one layer, the tightest bound
                  _attention(arithmetic.FP8ReadAttention), "low precision",
                  needs={"decoder", "rope"}, one_model=True, kinds=("dynamic",)),
    BrokenVariant("gemma-local-global-base",
                  "a Gemma model's window layers turn at the global RoPE base, not the local one",
                  rotary.local_global_base, "configuration value", needs={"gemma", "hybrid"},
                  kinds=("hybrid",)),
)}
"""Every broken variant, by name."""

# --- issue #30, classes 6-8: measurements counted, the function users call, axes crossed ------
VARIANTS.update({v.name: v for v in (
    BrokenVariant("mla-bytes-without-rope-key", "the per-layer byte formula counts an MLA "
                  "layer's latent c_KV but not the rotary key cached beside it",
                  lambda m: m, "byte accounting", needs={"latent"}, one_model=True,
                  kinds=("dynamic",), caches={"config_cache": measures.latent_without_rope_key}),
    BrokenVariant("step-kv-per-sequence", "a decode step's K/V bytes at batch B are one "
                  "sequence's, not the batch's", _copy(Decoder), "byte accounting",
                  one_model=True, kinds=("dynamic",),
                  caches={"step_traffic": measures.batch_as_sequence}),
    BrokenVariant("generate-padded-unmasked-decode", "generate_padded passes the pad mask on "
                  "the prompt call but not on its decode steps", _copy(Decoder),
                  "padded batches", one_model=True, kinds=("dynamic",),
                  caches={"generate_padded": padded.generate_padded_unmasked_decode}),
    BrokenVariant("handover-through-fp32", "the hand-over's packer moves K, V and the logits "
                  "through FP32 and casts them back: exact unless the model is wider than FP32",
                  _copy(Decoder), "payload dtype", one_model=True, kinds=("dynamic",),
                  caches={"packer": serving.pack_through_fp32}),
    BrokenVariant("deepseek-export-uninverted", "the DeepSeek exporter moves the rotary rows "
                  "with the importer's permutation, not its inverse (the same for a rotary "
                  "width of 4)", lambda m: m, "loader layout", needs={"latent"}, one_model=True,
                  kinds=("dynamic",),
                  caches={"reference": loaders.deepseek_reference_uninverted}),
    BrokenVariant("gemma-pattern-one-off", "a Gemma model's layer types come from its pattern "
                  "one layer off (layer 0 global), in the model and its cache alike",
                  loaders.gemma_pattern_one_off, "configuration value", needs={"gemma", "hybrid"},
                  one_model=True, kinds=("hybrid",)),
    BrokenVariant("gemma-export-pattern-only", "the export to transformers writes the Gemma "
                  "model's pattern and drops its list of global layers (the same model "
                  "wherever the layout is a pattern)", lambda m: m, "loader layout",
                  needs={"gemma", "global-first"}, one_model=True, kinds=("hybrid",),
                  caches={"reference": loaders.gemma_reference_pattern_only}),
    BrokenVariant("handover-layers-by-name", "the hand-over's packer ships the layers in the "
                  "order of their names, 0, 1, 10, 11, 2, ..", _copy(Decoder), "loader layout",
                  needs={"decoder", "deep"}, one_model=True, kinds=("dynamic",),
                  caches={"packer": serving.pack_layers_by_name}),
    BrokenVariant("export-layers-by-name", "the export to transformers lays kvdoc's blocks in "
                  "the order of their names, h.0, h.1, h.10, h.11, h.2, ..", lambda m: m,
                  "loader layout", needs={"decoder", "deep"}, one_model=True,
                  kinds=("dynamic",),
                  caches={"reference": loaders.transformers_reference_layers_by_name}),
    BrokenVariant("export-upcast", "the export to transformers hands a BF16 or FP16 model over "
                  "in FP32 (exact wherever the model is FP32 or wider)", lambda m: m,
                  "payload dtype", needs={"decoder"}, one_model=True, kinds=("dynamic",),
                  caches={"reference": loaders.transformers_reference_upcast}),
    BrokenVariant("split-k-pad-leak", "split-K attention takes one mask for every row in its "
                  "first chunk of keys, so a padded row reads the pad keys there",
                  padded.pad_leak_split_k, "padded batches", one_model=True,
                  kinds=("dynamic",)),
)})
