"""The evidence that the cached path computes the model's function: the verification suite
(``python -m kvdoc verify``) with its axes and checks, the cache invariants (bytes, held rows,
lengths, window and block edges), independent references, the broken variants the suite must
catch, checks of the scheduler and the radix prefix cache. What only the pages and tests use
(dependency maps, the cross-check with transformers, the recorded sweep, the policies'
yardsticks, the bad-input catalogue) is in :mod:`kvdoc.teach`.

A finite grid is a test, not a proof in general: each check names the axes it ran on.
"""
