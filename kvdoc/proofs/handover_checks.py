"""Checks of the prefill/decode hand-over (:mod:`kvdoc.serving.handover`).

* :func:`check_handover`: one :func:`~kvdoc.serving.handover.disaggregated_generate` run
  against :func:`kvdoc.core.model.generate` on the same prompt (the tokens) and one full forward
  over prompt + tokens (the logits behind each choice, within
  :data:`kvdoc.proofs.compare.TOLERANCE`), and the K/V bytes moved against the byte formula
  :func:`kvdoc.measure.model_caches.config_cache` (K and V, or an MLA model's latent).
* Shipping changes no bit: in one process (``in_process=True``, what the grid runs), the
  hand-over's logits are ``torch.equal`` to the same prefill and decode steps run on the cache
  that was never packed (:func:`_unshipped_logits`), in any dtype. Across processes only the
  tolerance holds: the prefill worker runs on one thread, and a matmul on other threads may sum
  in another order.
* :func:`check_dtypes`: the same in FP32 and FP64 (and, with ``dtypes=``, BF16 and FP16, where
  the full forward is not compared: its distance from the cached path is rounding noise there,
  bounded on :doc:`/part5/5-precision`, while the bitwise check holds exactly). The
  ``handover`` scenario runs every dtype of :data:`PAYLOAD_DTYPES` from its FP32 combination,
  so a payload that passes through a narrower dtype on the wire is seen in the one dtype it
  loses bits in (:func:`~kvdoc.proofs.broken.serving.pack_through_fp32`, FP64 only).
* What the check must catch: the broken packers of :mod:`kvdoc.proofs.broken.serving`,
  :func:`~kvdoc.proofs.broken.serving.pack_off_by_one` (ships one position too few, so decoding
  starts a position early) and :func:`~kvdoc.proofs.broken.serving.pack_zeroed_last_v` (the
  last layer's V replaced by zeros: the right byte count, the wrong values).

>>> import torch
>>> from kvdoc.proofs.broken.serving import pack_off_by_one, pack_zeroed_last_v
>>> from kvdoc.proofs.compare import default_model
>>> model, prompt = default_model(), torch.tensor([[5, 6, 7, 8]])
>>> [c.passed for c in check_dtypes(model, prompt, 4)]
[True, True]
>>> [(c.dtype, c.passed) for c in check_dtypes(model, prompt, 4, PAYLOAD_DTYPES)]
[('FP64', True), ('BF16', True), ('FP16', True)]
>>> check_handover(model, prompt, 4, packer=pack_off_by_one).passed
False
>>> check = check_handover(model, prompt, 4, packer=pack_zeroed_last_v)
>>> check.bytes_match, check.passed
(True, False)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder, decode_step, generate, prefill
from kvdoc.measure.model_caches import config_cache
from kvdoc.serving.handover import disaggregated_generate, pack

from .case import scenario
from .compare import DTYPE_NAMES, TOLERANCE, close, max_abs


@dataclass(frozen=True)
class HandoverCheck:
    """One hand-over run against the single-process run and the byte formula."""

    dtype: str
    tokens_equal: bool
    """The tokens equal ``generate``'s on a dynamic cache, the kind the prefill worker ships."""
    logits_error: float
    """``max |hand-over logits - full-forward logits|`` over every generated position."""
    logits_close: bool
    """Within :data:`~kvdoc.proofs.compare.TOLERANCE` of the full forward (a dtype without one,
    BF16 or FP16, is not compared: see :attr:`same_bits`)."""
    same_bits: bool
    """The hand-over's logits ``torch.equal`` to those of the cache that was never shipped (in
    one process; across processes, not compared: True)."""
    kv_bytes: int
    formula_bytes: int
    """``2 x n_layer x B x H_kv x T x D_h x element_size`` for the prompt's ``T`` positions
    (for a latent, ``B x T x`` its config's bytes per token)."""
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
    # on the kind the worker ships: another kind (a ring, a hybrid cache) sums the keys in
    # another order, and in BF16 a near tie between two tokens can fall either way
    alone = generate(model, prompt, max_new_tokens, cache="dynamic")
    with torch.no_grad():  # logits[:, i] predicts token i + 1: those behind the chosen tokens
        full = model(alone[:, :-1]).logits[:, prompt.shape[1] - 1:]
    unshipped = _unshipped_logits(model, alone, prompt.shape[1]) if in_process else run.logits
    tol = TOLERANCE.get(dtype)
    return HandoverCheck(
        DTYPE_NAMES[dtype], torch.equal(run.tokens, alone),
        max_abs(run.logits, full), tol is None or close(run.logits, full, tol),
        run.logits.shape == unshipped.shape and torch.equal(run.logits, unshipped),
        run.kv_bytes, _formula(model.config, *prompt.shape, dtype), run.logits_bytes,
        run.overhead_bytes, run.payload_bytes)


@torch.no_grad()
def _unshipped_logits(model: Decoder, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The logits behind ``tokens[:, prompt_len:]`` from the hand-over's own calls (a prefill
    into a dynamic cache, then one decode step a token) on a cache that stays in this process."""
    cache = model.new_cache(tokens.shape[0], "dynamic")
    logits, cache = prefill(model, tokens[:, :prompt_len], cache)
    steps = [logits[:, -1:]]
    for t in range(prompt_len, tokens.shape[1] - 1):
        logits, cache = decode_step(model, tokens[:, t:t + 1], cache)
        steps.append(logits)
    return torch.cat(steps, dim=1)


def _formula(config: object, batch: int, seq_len: int, dtype: torch.dtype) -> int:
    """What ``seq_len`` positions of ``batch`` sequences cache in the dynamic cache the
    hand-over ships (every position of every layer, or an MLA latent)."""
    return config_cache(config, windows=False).kv_bytes(seq_len, batch, dtype)


def check_dtypes(model: Decoder, prompt: torch.Tensor, max_new_tokens: int,
                 dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
                 **kwargs) -> list[HandoverCheck]:
    """:func:`check_handover` on a copy of ``model`` in each of ``dtypes``."""
    return [check_handover(copy.deepcopy(model).to(d), prompt, max_new_tokens, **kwargs)
            for d in dtypes]


PAYLOAD_DTYPES = (torch.float64, torch.bfloat16, torch.float16)
"""The dtypes the ``handover`` scenario also ships from its FP32 combination: every dtype a
payload may carry (:data:`kvdoc.serving.handover.pack`'s), each checked bit for bit."""

HANDOVER_PROMPT = 21
"""Prompt tokens of the ``handover`` scenario: past the grid's window of 16, so the positions a
window layer no longer reads are shipped too, and decoding starts past the window."""


@scenario("handover", {
    "handover": "prefill, cache packed and unpacked, decode vs generate; cached bytes vs "
                "formula"})
def handover_scenario(case, out: list) -> None:
    """The ``handover`` check on one combination of the grid (a
    :data:`~kvdoc.proofs.case.Scenario`): a prompt of the stream, past the grid's window
    (:data:`HANDOVER_PROMPT`), prefilled, packed, unpacked and decoded (in one process: the
    payload is the same bytes either way), against ``generate``; for the dynamic kind of the
    model implementation of every model (what a prefill worker ships is its dynamic cache), not
    applicable elsewhere. From the FP32 combination, also copies of the model in each of
    :data:`PAYLOAD_DTYPES`; a broken variant's packer comes in as ``case.caches["packer"]``."""
    if case.impl != "model" or case.kind != "dynamic":
        out.append(case.result("handover", None, 0.0,
                               "a model's own dynamic cache is what a prefill worker ships"))
        return
    n = HANDOVER_PROMPT
    extra = PAYLOAD_DTYPES if case.dtype == torch.float32 else ()
    checks = [check_handover(case.model, case.ids[:, :n], 4, packer=case.caches.get("packer",
                                                                                   pack))]
    checks += [check_handover(case.in_dtype(dt), case.ids[:, :n], 4,
                              packer=case.caches.get("packer", pack)) for dt in extra]
    for check in checks:  # each under its own dtype: a failure in FP64 is one of FP64
        result = case.result("handover", check.passed, check.logits_error,
                             f"prefill of {n}, packed ({check.payload_bytes} bytes), unpacked, "
                             "4 decode steps vs generate and bit for bit vs the unshipped "
                             f"cache; cached bytes {check.kv_bytes} == formula "
                             f"{check.formula_bytes}")
        out.append(dataclasses.replace(result, dtype=check.dtype))

