"""Deliberately wrong implementations, kept so that the verification can be seen to fail.

Each broken variant is a small change to the real code, made without editing it and through
nothing but public hooks:

* :mod:`~kvdoc.proofs.broken.decoders`: decoders that hand wrong positions through the real
  ``positions=`` keyword, attention subclasses that hand a wrong mask to the real ``attend`` or
  share K/V heads wrongly, a fast step that keeps stale weights, and one scenario rather than
  code (a cache filled before a prefix edit and reused after it);
* :mod:`~kvdoc.proofs.broken.rotary`: rotary positions got wrong;
* :mod:`~kvdoc.proofs.broken.caches`: cache layers (a :class:`~kvdoc.core.cache.CacheLayer`
  subclass swapped in through a cache's public ``layers``,
  :func:`~kvdoc.proofs.broken.caches.with_layers`) and transactions (``update``, ``begin``,
  ``finish``) of the dynamic and static caches that store, return or count the wrong thing;
* :mod:`~kvdoc.proofs.broken.cache_kinds`: the window ring, the hybrid cache, the int8 and FP8
  caches, the paged pool and its block tables, each wrong at one edge;
* :mod:`~kvdoc.proofs.broken.serving`: radix trees, hand-over packers, schedulers and a decoder
  that drops a padded batch's positions.
* :mod:`~kvdoc.proofs.broken.arithmetic`: an attention whose reduction order follows the
  chunking, which only the bitwise check sees.

Every variant here is **wrong on purpose**. :data:`kvdoc.proofs.variants.VARIANTS` lists them by
name, with the kind of mistake each stands for (:data:`kvdoc.proofs.variants.BUG_CLASSES`); the
suite (``python -m kvdoc verify --variant NAME``) must fail on each.
"""

LONG_STREAM = 32
"""Where the long-stream variants go wrong: their bugs show only past this many positions. Not
the Mistral-style model's window (:data:`kvdoc.proofs.grid.WINDOW`), which is smaller."""
