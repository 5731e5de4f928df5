"""The evidence that the cached path computes the model's function: the verification suite
(``python -m kvdoc verify``) with its axes and checks, the cache invariants (bytes, held rows,
lengths, window and block edges), independent references, the broken variants the suite must
catch. What only the pages and tests use (dependency maps, the cross-check with transformers,
the recorded sweep, the checks of the scheduler, the radix prefix cache, the hand-over and
batch invariance, the policies' yardsticks, the bad-input catalogue) is in :mod:`kvdoc.teach`.

A finite grid is a test, not a proof in general: each check names the axes it ran on.
"""
