"""Memory and time: dtype sizes, byte formulas and units (``kv_bytes``), a model's sizes layer by
layer (``model_caches``, and from a transformers ``config.json``, ``config_json``), the ``python -m
kvdoc memory`` command (``memory``), bytes a cache update writes (``copymeter``), counted work and
FLOPs (``costs``), the timing harness (``timing``), where two greedy generations part
(``divergence``), the benchmark (``decode_paths``, ``bench_run``, ``bench_result``,
``bench_tables``, ``bench``), ATen operation counts (``dispatch``) and the shared Markdown table
renderer (``tables``). Measurements report what they see; nothing here asserts a timing.
"""
