"""Hand-sized examples for the pages: the 2-d worked example (``worked``), the two-layer toy
lab (``toy``) and what it shows (``toy_scenarios``), and what the pages share for display: one-character tokens (``tokens``),
HTML tables and dependency maps (``html_tables``), LaTeX from values (``latex``), diagrams
(``diagrams``), shapes through the decoder (``shapes``), reading times (``reading``) and the
progress lines of long cells (``progress``); and the checks only pages run: dependency maps
(``dependency_maps``) of values inside the decoder (``decoder_sites``), the cross-check with
transformers (``crosscheck``), padded and shared-prefix runs against recompute
(``serving_checks``), the broken-variant sweep recorded once a build (``sweep_record``), and
the policies' yardsticks that ``tests/test_policies.py`` runs: the scheduler's specification and
vLLM V1's rule (``schedule_spec``), the radix cache's LRU oracle (``radix_policy``), sampling
against its distribution (``sampling``), and the broken policies each catches
(``broken_policies``); and the catalogue of bad input every layer refuses (``refusals``).

The display modules turn results into something a reader can look at; the checks here are
tested like those of :mod:`kvdoc.proofs`.
"""
