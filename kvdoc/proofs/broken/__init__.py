"""Deliberately wrong implementations, kept so that the verification can be seen to fail.

Each is a small change to the real code made through public hooks only, without editing it, in
a module by what it breaks: decoders (positions, masks, K/V head sharing, generation, a stale
fast step), rotary positions, caches (layers swapped in through a cache's public ``layers``),
the other cache kinds, the serving layer, parallel decoding, loaders and exporters, measure
functions, padded batches, arithmetic. Every variant is **wrong on purpose**;
:data:`kvdoc.proofs.variants.VARIANTS` lists them by name and bug class, and
``python -m kvdoc verify --variant NAME`` must fail on each.
"""

LONG_STREAM = 32
"""Where the long-stream variants go wrong: their bugs show only past this many positions."""
