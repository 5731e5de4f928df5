"""The functions a page or the README tells a user to call, run on the grid, not only the
mechanism beneath them.

* ``generate_padded``: :func:`kvdoc.serving.batching.generate_padded` on prompts of different
  lengths from the case's stream (left-padded to one batch): each row's tokens equal to the
  prompt's solo :func:`kvdoc.core.model.generate`, its logits to one full forward of prompt and
  tokens within the dtype's tolerance; on the model's own cache (``generate_padded`` makes it),
  so on the dynamic kind of every model.

A broken variant replaces the function through :attr:`~kvdoc.proofs.scenarios.Case.caches`
under the key ``"generate_padded"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvdoc.core.model import generate
from kvdoc.serving.batching import generate_padded

from .compare import close, max_abs

if TYPE_CHECKING:
    from .scenarios import Case

PROMPTS = (7, 3, 5)
"""Prompt lengths of the rows (cycled over the batch): pads of 4 and 2 slots."""
NEW = 4
"""Tokens generated per row: a prefill and three decode steps."""


def _generate_padded(case: Case, out: list) -> None:
    if case.impl != "model" or case.kind != "dynamic" or case.ids.shape[0] < 2:
        out.append(case.result("generate_padded", None, 0.0, "generate_padded takes the model "
                               "and makes its own cache (the dynamic kind); 2 rows or more"))
        return
    run = case.caches.get("generate_padded", generate_padded)
    B = case.ids.shape[0]
    prompts = [case.ids[b, :PROMPTS[b % len(PROMPTS)]].tolist() for b in range(B)]
    got = run(case.model, prompts, NEW)
    ok, err = tuple(got.tokens.shape) == (B, NEW), 0.0
    for b, prompt in enumerate(prompts):
        alone = generate(case.model, torch.tensor([prompt], device=case.ids.device), NEW)
        want = case.full(alone[:, :-1])[0, len(prompt) - 1:]  # the logits behind each choice
        ok = (ok and torch.equal(got.tokens[b], alone[0, len(prompt):])
              and close(got.logits[b], want, case.tol))
        err = max(err, max_abs(got.logits[b], want))
    out.append(case.result("generate_padded", ok, err,
                           f"prompts of {[len(p) for p in prompts]} tokens, {NEW} new each: "
                           "tokens vs generate() alone, logits vs one full forward"))


CHECKS = {"generate_padded": "generate_padded's rows vs each prompt's solo generate() (tokens) "
                             "and one full forward (logits)"}
"""The checks of this module, with what each compares."""
SCENARIOS = {"generate_padded": _generate_padded}
"""Scenario name -> function appending :class:`~kvdoc.proofs.scenarios.CheckResult` s."""
