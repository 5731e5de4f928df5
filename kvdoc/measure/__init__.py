"""Memory and time: dtype sizes, the byte formulas (plain, int8 and FP8) and byte units
(``kv_bytes``), a model's sizes as its cache layer by layer, for every published model the
package knows and for a transformers ``config.json`` (``model_caches``), the
``python -m kvdoc memory`` command (``memory``), bytes a cache update writes
(``copymeter``), counted work and FLOPs (``costs``), the timing harness (``timing``), where two
greedy generations part (``divergence``), what is timed (``decode_paths``), the benchmark's run
(``bench_run``), its settings and result (``bench_result``), its tables (``bench_tables``) and
its command (``bench``, ``python -m kvdoc bench``), ATen operation counts (``dispatch``) and the
Markdown table renderer that every report shares (``tables``).
Measurements report what they see; nothing here asserts a timing.
"""
