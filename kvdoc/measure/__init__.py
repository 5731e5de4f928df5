"""Memory and time: byte formulas and a model's sizes layer by layer, the ``python -m kvdoc
memory`` command, bytes a cache update writes, the cost model, the timing harness and the
benchmark, decode at batch B, prefix-cache hit rates, where two computations part. Measurements
report what they see; nothing here asserts a timing.
"""
