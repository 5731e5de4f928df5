"""The checks of the functions a user calls to generate, on the grid.

* ``prefill_decode``: ``prefill`` of 7 tokens, then ``decode_step`` per token (ids ``[B]`` and
  ``[B, 1]`` in turn) to the stream's end; ``prefill`` without a cache too.
* ``generate``: every token ``generate`` picks is the argmax of one full forward over its output
  (a near tie within the tolerance may go either way).
* ``speculative``: ``speculative_generate`` with a one-layer draft, its tokens vs that argmax.
* ``generate_padded``: prompts of different lengths left-padded to one batch, each row's tokens
  equal its prompt's solo ``generate``, its logits one full forward's (the model makes its own,
  dynamic cache); a broken variant's comes in as ``case.caches["generate_padded"]``.
"""

from __future__ import annotations

import torch

from kvdoc.core.model import decode_step, generate, prefill
from kvdoc.serving.batching import generate_padded
from kvdoc.serving.speculative import speculative_generate, truncated_draft

from .case import Case, scenario
from .compare import close, max_abs

PROMPTS = (7, 3, 5)
NEW = 4


DECODE_CUT = 20
"""Where the full batch stops in ``prefill_decode`` and ``generate`` when the stream checks made
the same one-token calls to the end at that batch (batch 1 runs the whole stream)."""


def _decode_batches(case: Case) -> list[torch.Tensor]:
    batches = case.both_batches()
    if len(batches) > 1 and 1 in case.chunks:
        batches[0] = batches[0][:, :DECODE_CUT]
    return batches


@scenario("prefill_decode", {
    "prefill_decode": "prefill, then decode_step per token, vs the full forward"})
def _prefill_decode(case: Case, out: list) -> None:
    prompt, ok, err = 7, True, 0.0
    for ids in _decode_batches(case):
        full = case.full(ids)
        logits, cache = prefill(case.call, ids[:, :prompt], case.new_cache(ids.shape[0]))
        steps = [logits]
        for t in range(prompt, ids.shape[1] - 1):
            token = ids[:, t] if t % 2 else ids[:, t:t + 1]  # decode_step takes [B] and [B, 1]
            logits, cache = decode_step(case.call, token, cache)
            steps.append(logits)
        got, want = torch.cat(steps, dim=1), full[:, prompt - 1:-1]
        ok = ok and close(got, want, case.tol) and cache.seq_len == ids.shape[1] - 1
        err = max(err, max_abs(got, want))
        if case.impl == "model" and case.kind == "dynamic":  # prefill makes its own (dynamic) cache
            own, own_cache = prefill(case.model, ids[:, :prompt])
            want = full[:, prompt - 1:prompt]
            ok = ok and close(own, want, case.tol) and own_cache.seq_len == prompt
            err = max(err, max_abs(own, want))
    out.append(case.result("prefill_decode", ok, err,
                           f"prefill {prompt}, then decode_step; batch {case.ids.shape[0]} and 1"))


@scenario("generate", {"generate": "generate()'s picks vs the argmax of one full forward"})
def _generate(case: Case, out: list) -> None:
    if case.impl != "model":
        out.append(case.result("generate", None, 0.0, "generate() takes the model"))
        return
    ok, gap = True, 0.0
    for ids in _decode_batches(case):
        prompt = ids[:, :5]
        new = ids.shape[1] - prompt.shape[1]
        tokens = generate(case.model, prompt, new, cache=case.new_cache(prompt.shape[0]))
        if tuple(tokens.shape) != tuple(ids.shape) or not torch.equal(tokens[:, :5], prompt):
            out.append(case.result("generate", False, float("inf"),
                                   f"returned shape {tuple(tokens.shape)}"))
            return
        passed, worst = _greedy(case, tokens, 5)
        ok, gap = ok and passed, max(gap, worst)
    out.append(case.result("generate", ok, gap,
                           f"{new} tokens at batch 1 vs argmax of one full forward; "
                           f"also batch {case.ids.shape[0]}"))


def _greedy(case: Case, tokens: torch.Tensor, prompt: int) -> tuple[bool, float]:
    """Whether every token after ``prompt`` is the argmax of one full forward (a near tie may go
    either way), and the largest logit gap."""
    logits = case.full(tokens)[:, prompt - 1:-1]  # position t predicts token t + 1
    best = logits.max(dim=-1).values
    chosen = logits.gather(-1, tokens[:, prompt:, None]).squeeze(-1)
    worst = float((best - chosen).max().item())  # 0 when every pick is the argmax
    return worst <= 2 * case.tol * (1 + float(best.abs().max().item())), worst


@scenario("speculative", {
    "speculative": "speculative decoding's tokens (draft, verify, crop) vs that argmax"})
def _speculative(case: Case, out: list) -> None:
    if case.impl != "model" or not case.new_cache(1).keeps_every_position:
        out.append(case.result("speculative", None, 0.0, "speculative_generate takes the model "
                               "and a cache that keeps every position (it crops)"))
        return
    new_cache = case.caches.get(case.kind, case.cache.new)
    prompt, k = case.ids[:1, :5], 3
    # past 32 positions (long-stream bugs), short of the stream's end: the verify call reaches
    # k positions past the last token
    new = min(40, case.ids.shape[1] - 5 - k)
    run = speculative_generate(case.model, truncated_draft(case.model, 1), prompt, new, k=k,
                               cache=lambda model, capacity: new_cache(model, 1, capacity))
    ok, gap = _greedy(case, run.tokens, 5)
    ok = ok and run.tokens.shape[1] == 5 + new and sum(run.accepted) + run.rounds == new
    out.append(case.result("speculative", ok, gap,
                           f"{new} tokens, a 1-layer draft proposing {k} a round, "
                           f"{sum(run.accepted)} kept; vs argmax of one full forward"))


@scenario("generate_padded", {
    "generate_padded": "generate_padded's rows vs each prompt's solo generate() (tokens) and one "
                       "full forward (logits)"})
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
