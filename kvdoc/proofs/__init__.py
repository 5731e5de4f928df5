"""The evidence that the cached path computes the model's function, and that bad input is
refused: the verification suite (``python -m kvdoc verify``) with its axes and checks, the
cache invariants (bytes, held rows, lengths, ring and block edges), independent references,
the broken variants the suite must catch, checks of the scheduler and the radix prefix cache,
and the bad-input catalogue. What only the pages use (dependency maps, the cross-check with
transformers, the recorded sweep) is in :mod:`kvdoc.teach`.

A finite grid is a test, not a proof in general: each check names the axes it ran on.
"""
