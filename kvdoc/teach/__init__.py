"""Code only the pages run: the 2-d worked example (``worked``), the two-layer toy lab
(``toy``), what the pages share for display (``display``: tokens, tables, diagrams, reading
times); the pages' checks: dependency maps (``dependency_maps``) of sites inside the decoder
(``decoder_sites``), the cross-check with transformers (``crosscheck``), serving runs against
recompute (``serving_checks``), the broken-variant sweep recorded once a build
(``sweep_record``); the policies' yardsticks that ``tests/test_policies.py`` also runs, each
beside the broken policies it catches (``schedule_spec``, ``radix_policy``, ``sampling``); and
the catalogue of bad input every layer refuses (``refusals``).
"""
