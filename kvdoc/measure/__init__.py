"""Memory and time: dtype sizes, byte formulas and units (``kv_bytes``), a model's sizes layer by
layer (``layer_caches``; the published ones, a kvdoc config and a transformers ``config.json``
read into them, ``model_caches``), the ``python -m kvdoc memory`` command (``memory``), the bytes
a cache update writes and ATen operation counts (``dispatch``), counted work and FLOPs
(``costs``), the timing harness (``timing``), where two greedy generations part
(``divergence``), the benchmark (``decode_paths``, ``bench_run``, and its command, tables and
figures, ``bench``), decode at batch B (``batch_decode``) and the shared Markdown table renderer
(``tables``). Measurements report what they see; nothing here asserts a timing.
"""
