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
    recurrent,
    rotary,
    serving,
    sparse,
)
from .traits import FAMILIES, check_traits, grid_traits, traits


@dataclass(frozen=True)
class BrokenVariant:
    """One deliberately wrong implementation: ``build`` makes the broken model from a correct one
    (same weights, dtype, device). ``stale_prefix`` is a scenario, not code: the cached path's
    first chunk is fed the prefix as it was before an edit
    (:func:`kvdoc.proofs.broken.decoders.stale_prefix`)."""

    name: str
    breaks: str
    build: Callable[[Decoder], Decoder]
    bug_class: str = "mask and positions"
    stale_prefix: bool = False
    needs: tuple[str, ...] = ("decoder",)
    """The traits (:data:`kvdoc.proofs.traits.TRAITS`) a model must have to host it; kept sorted
    (a set's order would change the page that lists it)."""
    one_model: bool = False
    """Run on the first host among the axes only: a bug in a pool or a cache kind shows on any,
    and one keeps the sweep short."""
    caches: Mapping[str, Callable] = field(default_factory=dict)
    """What replaces the real factory under a kind of :data:`kvdoc.proofs.grid.CACHES` or a
    scenario's key (``"int8"``, ``"packer"``, ``"reference"``, ...)."""
    kinds: tuple[str, ...] | None = None
    """The cache kinds it runs on; None: every kind."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """The dtypes a sweep runs it in; None: every dtype swept."""

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
               "byte accounting", "int8 contract", "window and block edges", "padded batches",
               "fp8 contract", "low precision", "payload dtype",
               "loader layout", "key selection", "mode vs its function",
               "option off the grid", "state left behind", "sinks")
"""The kinds of mistake the variants stand for."""


def _copy(cls: type[Decoder]) -> Callable[[Decoder], Decoder]:
    return lambda m: decoders.copy_as(m, cls)


def _attention(cls: type) -> Callable[[Decoder], Decoder]:
    return lambda m: decoders.with_attention(m, cls)


def _swap(name: str, breaks: str, bug_class: str, caches: dict, kind: str = "dynamic",
          build: Callable | None = None, **options) -> BrokenVariant:
    """A variant run on one model's ``kind``, broken by ``caches`` (and ``build``, by default a
    plain copy)."""
    return BrokenVariant(name, breaks, build or _copy(Decoder), bug_class, one_model=True,
                         kinds=(kind,), caches=caches, **options)


def _as_is(model: Decoder) -> Decoder:
    return model


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
                  caches.decoder_with(dynamic_layer=caches.NewBeforeOldLayer,
                                      static_layer=caches.NewBeforeOldStaticLayer),
                  "cache storage"),
    BrokenVariant("stale-cache",
                  "a cache filled before a prefix edit (token 0 changed) is reused after it",
                  _copy(Decoder), "cache storage", stale_prefix=True),
    BrokenVariant("fp32-cache",
                  "a dynamic cache rounds the K/V it stores to FP32, also in an FP64 model",
                  caches.decoder_with(dynamic_layer=caches.FP32Layer), "cache storage",
                  dtypes=(torch.float64,)),
    BrokenVariant("modulo-slots",
                  "a static cache writes position t into slot t % 32 and reads slots as linear",
                  caches.decoder_with(static_layer=caches.ModuloStaticLayer), "long stream"),
    BrokenVariant("window-32", "a dynamic cache silently keeps only the newest 32 positions",
                  caches.decoder_with(dynamic_layer=caches.WindowLayer), "long stream"),
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
                  caches.decoder_with(static_cache=caches.EarlyLengthStaticCache),
                  "failure mid-call"),
    BrokenVariant("dynamic-in-place",
                  "a dynamic cache is written in place, so a failed call leaves a partial write",
                  caches.decoder_with(dynamic_cache=caches.InPlaceDynamicCache),
                  "failure mid-call"),
    BrokenVariant("static-last-layer-length",
                  "a static cache's length advances in the last layer's update, before the call "
                  "finished", caches.decoder_with(static_cache=caches.LastLayerLengthStaticCache),
                  "failure mid-call"),
    BrokenVariant("fast-step-snapshot",
                  "the fast decode step keeps the weights it copied first, never seeing a change",
                  _copy(decoders.SnapshotFastStepDecoder), "stale weights",
                  needs={"decoder", "fused"}),
    BrokenVariant("unrotated-k-cache",
                  "K is cached before RoPE; keys read back from the cache are never rotated",
                  rotary.unrotated_k, "rotary positions", needs={"decoder", "rope"}),
    BrokenVariant("rope-restart",
                  "RoPE turns each call's Q and K at positions 0..C-1, not at the cache length",
                  rotary.rope_restart, "rotary positions", needs={"decoder", "rope"}),
    _swap("pool-counts-k-only", "a paged pool's byte figures count K's bytes, not V's",
          "byte accounting", {"paged": cache_kinds.k_only_paged_cache}, "paged"),
    _swap("int8-requantise",
          "the int8 cache re-quantises every held row on each append, one scale a tensor",
          "int8 contract", {"int8": cache_kinds.requantising_int8_cache},
          needs={"decoder", "grouped"}),
    _swap("int8-read-v-scale",
          "the int8 cache hands attention K dequantised with V's scales (what it stores and "
          "layer() returns is right)",
          "int8 contract", {"int8": cache_kinds.v_scale_read_int8_cache},
          needs={"decoder", "grouped"}),
    _swap("int8-narrow-arithmetic",
          "the int8 cache quantises and dequantises in the model's dtype: right in FP32 and "
          "FP64; in BF16 or FP16 a value can land past its dtype's bound",
          "int8 contract", {"int8": cache_kinds.narrow_int8_cache}),
    _swap("fp8-tensor-scale-write",
          "the FP8 cache states per-head scales and reads with them, but quantises each write "
          "under one scale for the tensor (its largest head's)",
          "fp8 contract", {"fp8": cache_kinds.tensor_scale_fp8_cache},
          needs={"decoder", "grouped"}),
    _swap("fp8-rescale-each-write",
          "the FP8 cache takes new scales from every write, decode steps included, and reads "
          "the rows it held under them",
          "fp8 contract", {"fp8": cache_kinds.rescaling_fp8_cache}),
    _swap("ring-long-chunk",
          "a chunk longer than the window keeps its first W rows, not its last",
          "window and block edges", {"window": cache_kinds.long_chunk_ring_cache}, "window",
          needs={"decoder", "window"}),
    _swap("ring-shared-until-wrap",
          "a call writes in place into W slots shared with the cache it continues until the "
          "window fills, so two branches before then write into the same slots",
          "window and block edges", {"window": cache_kinds.lazy_ring_cache}, "window",
          needs={"decoder", "window"}),
    _swap("prefix-late-copy",
          "copy-on-write skips the shared, partly filled block a write continues",
          "window and block edges",
          {"shared-prefix": cache_kinds.late_copy_shared_prefix_cache}, "shared-prefix"),
    _swap("decode-without-pad-mask",
          "a padded batch's pad mask is passed on the prompt call, not on decode steps",
          "padded batches", {}, build=_copy(decoders.DecodeWithoutPadMaskDecoder)),
    _swap("fast-ignores-padding",
          "the fast decode step ignores the padding arguments (positions, pad mask)",
          "padded batches", {}, "static", _copy(decoders.PaddingBlindFastDecoder),
          needs={"decoder", "learned", "grouped"}),
    BrokenVariant("rope-table-growth",
                  "RoPE's cos/sin table, built on the first call, grows with rows from position 0",
                  rotary.growing_table, "state across calls", needs={"decoder", "rope"}),
    BrokenVariant("rope-default-base",
                  "RoPE turns at the default base 10000, not config.rope_theta",
                  rotary.default_base, "configuration value", needs={"decoder", "rope"}),
    BrokenVariant("hybrid-rings-global",
                  "the hybrid cache windows the global layers too, so they lose keys past "
                  "the window",
                  lambda m: decoders.copy_as(m, Gemma3Decoder), "window and block edges",
                  needs={"gemma", "hybrid"}, kinds=("hybrid",),
                  caches={"hybrid": cache_kinds.ringed_global_hybrid_cache}),
    # shown on one model, the Llama-style one: one layer, the tightest bound
    _swap("fp8-reads-in-half",
          "in a BF16 or FP16 model, attention reads K and V rounded to FP8 e4m3",
          "low precision", {}, build=_attention(arithmetic.FP8ReadAttention),
          needs={"decoder", "rope"}),
    BrokenVariant("gemma-local-global-base",
                  "a Gemma model's window layers turn at the global RoPE base, not the local one",
                  rotary.local_global_base, "configuration value", needs={"gemma", "hybrid"},
                  kinds=("hybrid",)),
    # measurements counted, the function users call, axes crossed (issue #30, classes 6-8)
    _swap("mla-bytes-without-rope-key",
          "the per-layer byte formula counts an MLA layer's latent c_KV but not the rotary key "
          "cached beside it", "byte accounting",
          {"config_cache": cache_kinds.latent_without_rope_key}, build=_as_is, needs={"latent"}),
    _swap("step-kv-per-sequence",
          "a decode step's K/V bytes at batch B are one sequence's, not the batch's",
          "byte accounting", {"step_traffic": cache_kinds.batch_as_sequence}),
    _swap("deepseek-export-uninverted",
          "the DeepSeek exporter moves the rotary rows with the importer's permutation, not its "
          "inverse (the same for a rotary width of 4)", "loader layout",
          {"reference": loaders.deepseek_reference_uninverted}, build=_as_is, needs={"latent"}),
    _swap("gemma-pattern-one-off",
          "a Gemma model's layer types come from its pattern one layer off (layer 0 global), in "
          "the model and its cache alike", "configuration value", {}, "hybrid",
          loaders.gemma_pattern_one_off, needs={"gemma", "hybrid"}),
    _swap("gemma-export-pattern-only",
          "the export to transformers writes the Gemma model's pattern and drops its list of "
          "global layers (the same model wherever the layout is a pattern)", "loader layout",
          {"reference": loaders.gemma_reference_pattern_only}, "hybrid", _as_is,
          needs={"gemma", "global-first"}),
    _swap("export-layers-by-name",
          "the export to transformers lays kvdoc's blocks in the order of their names, h.0, "
          "h.1, h.10, h.11, h.2, ..", "loader layout",
          {"reference": loaders.transformers_reference_layers_by_name}, build=_as_is,
          needs={"decoder", "deep"}),
    _swap("export-upcast",
          "the export to transformers hands a BF16 or FP16 model over in FP32 (exact wherever "
          "the model is FP32 or wider)", "payload dtype",
          {"reference": loaders.transformers_reference_upcast}, build=_as_is),
    # a recurrent layer's state, kept wrong between tokens (issue 47)
    BrokenVariant("state-not-carried",
                  "the chunked delta rule starts every chunk from the state its call began with: "
                  "the state is not advanced on a chunk boundary",
                  recurrent.state_not_carried, "state across calls",
                  needs={"deltanet", "state"}),
    BrokenVariant("conv-window-shifted",
                  "a DeltaNet layer keeps its conv window shifted by one: the K - 1 inputs "
                  "before the newest, not the last K - 1",
                  recurrent.conv_window_shifted, "state across calls",
                  needs={"deltanet", "state"}),
    BrokenVariant("mamba-conv-state-shifted",
                  "a Mamba-2 layer keeps as its conv state the inputs before the last one: the "
                  "newest dropped, one too old kept", recurrent.conv_state_shifted,
                  "state across calls", needs={"mamba", "state"}),
    BrokenVariant("ssd-undecayed-carry",
                  "the SSD's chunked form carries the state into the next chunk without the "
                  "decay over the chunk (full forward and long calls alike)",
                  recurrent.ssd_undecayed_carry, "shared path", needs={"mamba", "state"}),
    # DeepSeek-V3.2's indexed attention: which keys each query reads (kvdoc.core.indexed)
    BrokenVariant("index-topk-new-rows",
                  "a cached call's indexer ranks only the call's own keys: the top k are taken "
                  "over the new rows, and the cached positions are never read",
                  _copy(sparse.NewRowsTopkDecoder), "key selection",
                  needs={"latent", "indexed"}),
    BrokenVariant("index-ties-topk",
                  "ties among the indexer's scores are left to torch.topk over the whole row "
                  "(transformers' rule), whose order depends on the row's length: a row's keys "
                  "depend on how many follow it", _copy(sparse.TopkTiesDecoder),
                  "key selection", needs={"latent", "indexed"}),
    BrokenVariant("index-keys-unforked",
                  "a call on a dynamic cache forks the latent's layer but not the indexer keys', "
                  "so the cache it continues gains indexer keys beside an unchanged latent",
                  _copy(sparse.UnforkedKeysDecoder), "cache storage",
                  needs={"latent", "indexed"}, kinds=("dynamic",)),
    _swap("index-keys-not-copied",
          "a paged pool's copy-on-write copies a shared block's latent rows but not its "
          "indexer keys (zeros in their place)", "cache storage",
          {"shared-prefix": sparse.keys_not_copied_cache}, "shared-prefix", _as_is,
          needs={"latent", "indexed"}),
    # DeepSeek-V4's compressed caches: block edges inside a call's end, and a shared-path sink
    _swap("v4-entry-before-block-full",
          "a compressed layer pools its unfinished block when a call ends (its last row repeated "
          "to fill it): an entry emitted before its block is full", "window and block edges",
          {"compressed": sparse.early_entry_cache}, "compressed", _as_is,
          needs={"compressed"}),
    _swap("v4-buffer-dropped",
          "a compressed layer drops the unfinished block's rows at every call's end, so the "
          "block's entry pools only the rows of later calls", "window and block edges",
          {"compressed": sparse.dropped_buffer_cache}, "compressed", _as_is,
          needs={"compressed"}),
    _swap("v4-sink-twice",
          "each head's sink logit enters the softmax twice, in full and cached calls alike",
          "shared path", {}, "compressed", sparse.sink_twice, needs={"compressed"}),
    _swap("split-k-pad-leak",
          "split-K attention takes one mask for every row in its first chunk of keys, so a "
          "padded row reads the pad keys there", "padded batches", {},
          build=decoders.pad_leak_split_k),
    # issue #46: an alternative path held to the function outside it, an option's other
    # value, the state a policy leaves
    BrokenVariant("invariant-tiled-gqa",
                  "under batch_invariant(), query head h reads K/V head h % H_kv, not its "
                  "group's (the same bits on every call)",
                  _attention(arithmetic.InvariantTiledAttention), "mode vs its function",
                  needs={"decoder", "grouped"}, kinds=("dynamic",)),
    BrokenVariant("invariant-fp32-in-fp64",
                  "under batch_invariant(), an FP64 model attends in FP32 (the same bits on "
                  "every call, within FP32's tolerance)",
                  _attention(arithmetic.InvariantNarrowAttention), "mode vs its function",
                  kinds=("dynamic",), dtypes=(torch.float64,)),
    _swap("fp8-e5m2-saturates-at-448",
          "the FP8 cache's write saturates at e4m3's 448 whatever the storage format: e5m2 "
          "values past 448 scales are clipped", "option off the grid",
          {"fp8": cache_kinds.e4m3_clamp_fp8_cache}),
    _swap("import-top-level-rope-theta",
          "from_transformers() reads RoPE's base from the config's top-level rope_theta, which "
          "transformers 5 writes inside rope_parameters: every import turns at 10000",
          "option off the grid", {"importer": loaders.import_top_level_rope_theta},
          build=_as_is, needs={"decoder", "rope"}),
    _swap("evict-first-block",
          "block-mode eviction frees a leaf's first block and keeps its tail blocks under the "
          "leaf's shortened tokens (every decision and count right)", "state left behind",
          {"radix": serving.FirstBlockEviction}, "paged"),
    _swap("speculative-stale-draft-row",
          "after a rejection the draft's cache is cropped to the right length but keeps the "
          "first rejected proposal's K/V row (the tokens stay the target's)",
          "state left behind", {"speculative": serving.stale_draft_speculative}),
    BrokenVariant("sink-per-split",
                  "split-K attention folds the sink into every chunk's partial, so the merged "
                  "denominator counts it once per split, not once",
                  arithmetic.sink_per_split, "sinks", needs={"gptoss"}, one_model=True),
    BrokenVariant("window-without-sink",
                  "a gpt-oss model's window layers attend without their sink (the full layers "
                  "keep it), in the full forward and the cached calls alike",
                  arithmetic.window_without_sink, "sinks", needs={"gptoss", "hybrid"},
                  one_model=True),
    BrokenVariant("invariant-sink-outside-mode",
                  "under batch_invariant(), gpt-oss's sink attention runs the library's batched "
                  "matmul and softmax (the right function, bits that follow the call's shape)",
                  arithmetic.sink_outside_mode, "mode vs its function", needs={"gptoss"},
                  one_model=True, kinds=("dynamic",)),
)}
"""Every broken variant, by name."""
