"""The evidence that the cached path computes the model's function, and that bad input is
refused: dependency maps, the verification suite (``python -m kvdoc verify``) with its axes,
the cache invariants (bytes, held rows, lengths, ring and block edges), independent references
and the cross-check with transformers, the broken variants the suite must catch, checks of the
scheduler and the radix prefix cache, and the bad-input catalogue.

A finite grid is a test, not a proof in general: each check names the axes it ran on.
"""
