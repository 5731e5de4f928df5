"""What serving systems build on the cache (Part IV): left-padded batches (``batching``),
paged and shared-prefix caches (``paged``), an int8 cache (``quant``) and a simulated request
mix (``workload``).

Features only: the checks that they compute the model's function live in :mod:`kvdoc.proofs`.
"""
