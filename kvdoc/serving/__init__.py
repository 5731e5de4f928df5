"""What serving systems build on the cache (Parts IV and V): left-padded batches
(``batching``), paged and shared-prefix caches (``paged``), a scheduler for continuous batching
and chunked prefill (``scheduler``), a radix-tree prefix cache (``radix``), prefill/decode
hand-over between processes (``handover``), blocks offloaded to host memory and disk
(``offload``), an int8 cache (``quant``), an FP8 cache (``fp8``), a simulated request mix
(``workload``), split-K attention (``splitk``) and speculative decoding (``speculative``).

Features only: the checks that they compute the model's function live in :mod:`kvdoc.proofs`.
"""
