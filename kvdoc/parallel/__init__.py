"""The cache across processes: tensor- and context-parallel decoding on torch.distributed.

A layer above :mod:`kvdoc.measure` (it uses the byte formula) and below :mod:`kvdoc.proofs`
(whose broken variants break it): ranks started (``launch``) with counted collectives
(``comm``), heads and positions split (``tensor``, ``context``), the decoding loop and who holds
what (``decode``) checked against one process (``comparison``), an MLA latent under TP and
DP-attention (``latent``), a prefill's K/V handed block by block to a decode rank (``blocks``)
and ``python -m kvdoc parallel`` (``command``). Only CPU tensors over gloo are run
and checked here; NCCL on GPUs is not.
"""
