"""The cache across processes: tensor- and context-parallel decoding on torch.distributed.

A layer above :mod:`kvdoc.measure` (it uses the byte formula) and below :mod:`kvdoc.proofs`
(whose broken variants break it). :mod:`~kvdoc.parallel.launch` starts the ranks,
:mod:`~kvdoc.parallel.comm` counts their collectives, :mod:`~kvdoc.parallel.tensor` splits heads
and MLP columns, :mod:`~kvdoc.parallel.context` splits positions,
:mod:`~kvdoc.parallel.decode` runs the decoding loop on every rank
(:func:`~kvdoc.parallel.decode.parallel_generate`), :mod:`~kvdoc.parallel.comparison` compares it
with one process, :mod:`~kvdoc.parallel.latent` runs an MLA latent under TP and under
DP-attention, :mod:`~kvdoc.parallel.blocks` hands a TP prefill's K/V block by block to a
decode rank, :mod:`~kvdoc.parallel.figure` draws who holds which K/V and
:mod:`~kvdoc.parallel.command` is ``python -m kvdoc parallel``.

Only CPU tensors over gloo are run and checked here; NCCL on GPUs is not.
"""
