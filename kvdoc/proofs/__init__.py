"""The evidence that the cached path computes the model's function: the verification suite
(``python -m kvdoc verify``) with its axes and checks, the cache invariants, independent
references, the broken variants the suite must catch. What only the pages and tests use is in
:mod:`kvdoc.teach`.

A finite grid is a test, not a proof in general: each check names the axes it ran on.
"""
