"""Deliberately wrong implementations, kept so that the verification can be seen to fail.

Each is a small change to the real code made through public hooks only, in a module by what it
breaks. Every one is **wrong on purpose**; :data:`kvdoc.proofs.variants.VARIANTS` lists them,
and ``python -m kvdoc verify --variant NAME`` must fail on each.
"""

LONG_STREAM = 32
"""Where the long-stream variants go wrong: their bugs show only past this many positions."""
