"""The decoder and its caches: what the site derives, and what an engineer copies.

The copy set is two files that run with torch alone: ``model`` (the config, rotary positions,
the input checks and one forward for full recompute and cached continuation) and ``cache`` (the
offset causal mask; a cache of per-layer storages and one length; dynamic and static layers;
whether a cache serves a model, decided by the config's ``cache_layout``). The rest builds on
them: ``window`` (rings for sliding-window layers, the hybrid cache of a model that also has
global layers), ``frame`` (the decoder, block, attention and gated MLP every model below
builds on, and their layer types), ``mla`` (DeepSeek's latent attention, whose layout is
one head of two widths), ``state`` (the fixed-size state of a recurrent layer, beside K/V
layers, and its snapshots), ``gemma`` (Gemma 3's window and global layers), ``deltanet``
(Qwen3.5's Gated DeltaNet and gated attention layers), ``delta_rule`` (DeltaNet's recurrence,
token by token and in chunks), ``mamba2`` (Bamba's Mamba-2 hybrid: a conv and an SSD state per
mixer), ``v4`` and ``compressed`` (DeepSeek-V4's attention layers and their caches of pooled
blocks), ``gptoss`` (gpt-oss's sink logit per head, its window and full layers and experts),
``streaming`` (StreamingLLM's first tokens kept beside a window, a different function),
``invariant`` (reductions in a fixed order), ``fast`` (the single-token step written the way
serving engines write it) and ``feed`` (a stream fed in chunks).

This folder imports nothing but torch and the standard library. K and V are
``[B, H_kv, T, D_h]``.
"""
