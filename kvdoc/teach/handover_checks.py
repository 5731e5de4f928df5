"""Checks of the prefill/decode hand-over (:mod:`kvdoc.serving.handover`).

:func:`check_handover` holds one :func:`~kvdoc.serving.handover.disaggregated_generate` run to
``generate`` (tokens), one full forward (logits, within the tolerance), the same calls on the
cache never packed (``torch.equal`` in one process; across processes a matmul may sum in another
order) and the byte formula; tests/test_handover.py runs it on every model of the grid in FP32
and each of :data:`PAYLOAD_DTYPES`, where a payload that passes through a narrower dtype shows.

>>> import torch
>>> from kvdoc.teach.broken_shown import pack_zeroed_last_v
>>> from kvdoc.proofs.compare import default_model
>>> model, prompt = default_model(), torch.tensor([[5, 6, 7, 8]])
>>> [(c.dtype, c.passed) for c in check_dtypes(model, prompt, 4, PAYLOAD_DTYPES)]
[('FP64', True), ('BF16', True), ('FP16', True)]
>>> check = check_handover(model, prompt, 4, packer=pack_zeroed_last_v)
>>> check.bytes_match, check.passed
(True, False)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder, decode_step, generate, prefill
from kvdoc.measure.model_caches import config_cache
from kvdoc.proofs.compare import DTYPE_NAMES, TOLERANCE, close, max_abs
from kvdoc.serving.handover import disaggregated_generate, pack


@dataclass(frozen=True)
class HandoverCheck:
    """One hand-over run against one process (logits not compared in BF16 or FP16; ``same_bits``
    True across processes): the K/V bytes moved and their formula; the payload's parts."""

    dtype: str
    tokens_equal: bool
    logits_error: float
    logits_close: bool
    same_bits: bool
    kv_bytes: int
    formula_bytes: int
    logits_bytes: int
    overhead_bytes: int
    payload_bytes: int

    @property
    def bytes_match(self) -> bool:
        return self.kv_bytes == self.formula_bytes

    @property
    def passed(self) -> bool:
        return self.tokens_equal and self.logits_close and self.same_bits and self.bytes_match


def check_handover(model: Decoder, prompt: torch.Tensor, max_new_tokens: int, *,
                   in_process: bool = True,
                   packer: Callable[..., bytes] = pack) -> HandoverCheck:
    """Run the hand-over once and compare it with one process doing everything."""
    dtype = next(model.parameters()).dtype
    run = disaggregated_generate(model, prompt, max_new_tokens, in_process=in_process,
                                 packer=packer)
    # on the kind the worker ships: another kind (a window or hybrid cache) sums the keys in
    # another order, and in BF16 a near tie between two tokens can fall either way
    alone = generate(model, prompt, max_new_tokens, cache="dynamic")
    with torch.no_grad():  # logits[:, i] predicts token i + 1: those behind the chosen tokens
        full = model(alone[:, :-1]).logits[:, prompt.shape[1] - 1:]
    unshipped = _unshipped_logits(model, alone, prompt.shape[1]) if in_process else run.logits
    tol = TOLERANCE.get(dtype)
    # the dynamic cache the hand-over ships: every position of every layer, or an MLA latent
    formula = config_cache(model.config, windows=False).kv_bytes(prompt.shape[1], prompt.shape[0],
                                                                  dtype)
    return HandoverCheck(
        DTYPE_NAMES[dtype], torch.equal(run.tokens, alone),
        max_abs(run.logits, full), tol is None or close(run.logits, full, tol),
        run.logits.shape == unshipped.shape and torch.equal(run.logits, unshipped),
        run.kv_bytes, formula, run.logits_bytes, run.overhead_bytes, run.payload_bytes)


@torch.no_grad()
def _unshipped_logits(model: Decoder, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The logits behind ``tokens[:, prompt_len:]`` from the hand-over's own calls on a dynamic
    cache that stays in this process."""
    cache = model.new_cache(tokens.shape[0], "dynamic")
    logits, cache = prefill(model, tokens[:, :prompt_len], cache)
    steps = [logits[:, -1:]]
    for t in range(prompt_len, tokens.shape[1] - 1):
        logits, cache = decode_step(model, tokens[:, t:t + 1], cache)
        steps.append(logits)
    return torch.cat(steps, dim=1)


def check_dtypes(model: Decoder, prompt: torch.Tensor, max_new_tokens: int,
                 dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
                 **kwargs) -> list[HandoverCheck]:
    """:func:`check_handover` on a copy of ``model`` in each of ``dtypes``."""
    return [check_handover(copy.deepcopy(model).to(d), prompt, max_new_tokens, **kwargs)
            for d in dtypes]


PAYLOAD_DTYPES = (torch.float64, torch.bfloat16, torch.float16)  # each shipped from FP32 too
