"""The decoder and its caches: what the site derives, and what an engineer copies.

``config`` (one frozen config), ``mask`` (the offset causal mask), ``rope`` (rotary positions),
``cache`` (the cache interface, dynamic and static caches), ``window`` (a ring buffer for
sliding windows), ``embed`` (the token lookup), ``model`` (one forward for full recompute and
cached continuation), ``invariant`` (the batch-invariant mode: reductions in a fixed order),
``fast`` (the same single-token step written the way serving engines write it), ``mla``
(DeepSeek's multi-head latent attention, whose cache holds a latent instead of K and V),
``gemma`` (Gemma 3's sliding-window and global layers in one decoder) and ``hybrid`` (its cache:
rings for the window layers, growing K/V for the global ones).

This folder imports nothing but torch and the standard library, and nothing in it exists only
for a proof: the other layers observe it from outside. K and V are ``[B, H_kv, T, D_h]``.
"""
