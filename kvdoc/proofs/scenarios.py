"""The scenarios of the verification suite: what is checked on each combination of the grid.

Each scenario compares against one full forward of the same model unless said otherwise;
tolerances are :data:`kvdoc.proofs.verify.TOLERANCE` (``atol = rtol``, 1e-5 in FP32, 1e-10 in FP64).

* ``logits``, ``kv``, ``lifecycle`` (scenario ``stream``): a stream of
  :data:`kvdoc.proofs.grid.STREAM_LENGTH` tokens (past positions 32 and 64) fed in chunks of each of
  :data:`kvdoc.proofs.grid.CHUNKS` tokens, none of which divides it except 1 (and once more with batch
  1, in the middle chunk size): the logits of every
  position, each layer's cached K/V ``[B, H_kv, T, D_h]`` against the K/V the full forward
  projects, and what a cache held before each call (bitwise).
* ``causality``: changing the last token leaves every earlier position unchanged, on both paths.
* ``last_only``: ``last_only=True`` returns the last position, full and cached.
* ``prefill_decode``: ``kvdoc.core.model.prefill`` of 7 tokens, then ``decode_step`` per token
  (ids ``[B]`` and ``[B, 1]`` in turn); ``prefill`` without a cache too.
* ``generate``: every token ``kvdoc.core.model.generate`` picks is the greedy argmax of one full
  forward over its output (a near tie within the tolerance counts as either token).
* ``crop``: fill, crop to a shorter length, continue with other tokens.
* ``branch``: two continuations from one prefix cache; each equals its own full forward, and
  the prefix cache is unchanged (a cache written in place is cropped back between branches).
* ``failure``: the last layer raises mid-call; the cache is exactly as before (length and
  content), and continuing afterwards is right.
* ``reference``: the model's independent reference (:mod:`kvdoc.proofs.references`), full and cached.

A scenario appends ``(check, passed, error, detail)`` tuples; ``passed`` is None when it does not
apply. ``kvdoc.core.model``'s functions are looked up when a scenario runs, never at import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvdoc.core import model as _model  # looked up at call time, so a patched prefill/generate is the one checked
from .broken import stale_prefix
from kvdoc.core.cache import KVCache
from .grid import CacheSpec, ModelSpec
from .verify import TOLERANCE, _changed, _close, _max_abs, _snapshot, full_forward_kv, run_cached

SPARE = 8
"""Positions of capacity beyond the stream that a cache is built with (for kinds that take one)."""


@dataclass
class Case:
    """One combination of the grid, with its model (in its dtype), cached call and streams."""

    model_name: str
    kind: str
    impl: str
    dtype: torch.dtype
    spec: ModelSpec
    cache: CacheSpec
    model: nn.Module
    call: Callable
    ids: torch.Tensor
    alt: torch.Tensor
    chunks: Sequence[int]
    stale: bool

    @property
    def tol(self) -> float:
        return TOLERANCE[self.dtype]

    def new_cache(self, batch: int | None = None) -> KVCache:
        # spare capacity: a cache that reads past its filled rows then reads rows never written
        return self.cache.new(self.model, batch or self.ids.shape[0], self.ids.shape[1] + SPARE)

    def full(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)[0]


def _feed(call: Callable, cache: KVCache, tokens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, KVCache]:
    """Feed ``tokens`` ``[B, C]`` after ``cache`` in calls of ``chunk`` tokens: all logits and the last cache."""
    out = []
    for s in range(0, tokens.shape[1], chunk):
        logits, cache = call(tokens[:, s:s + chunk], cache)
        out.append(logits)
    return torch.cat(out, dim=1), cache


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> tuple:
    return (name, _close(got, want, tol), _max_abs(got, want), what)


def _kv_error(model: nn.Module, ids: torch.Tensor, cache: KVCache, tol: float) -> tuple[bool, float] | None:
    """Cached K/V against the full forward's projections (None if the model has no GPT-2 ``c_attn``)."""
    if not all(hasattr(getattr(b, "attn", None), "c_attn") for b in getattr(model, "h", [None])):
        return None
    _, full_kv = full_forward_kv(model, ids)
    held = cache.held()  # a window cache holds only the last positions
    ok, err = True, 0.0
    for i, pair in enumerate(full_kv):
        for got, ref in zip(cache.layer(i), pair):
            ref = ref[:, :, held.start:held.stop]
            ok, err = ok and _close(got, ref, tol), max(err, _max_abs(got, ref))
    return ok, err


def _stream(case: Case, out: list) -> None:
    B, T = case.ids.shape
    first = stale_prefix(case.ids, case.model.config.vocab_size) if case.stale else None
    runs = [(B, chunk) for chunk in case.chunks] + ([(1, case.chunks[len(case.chunks) // 2])] if B > 1 else [])
    logit_ok, logit_err, life, kv = True, 0.0, 0.0, (True, 0.0)
    for rows, chunk in runs:
        ids = case.ids[:rows]
        full = case.full(ids)
        run = run_cached(case.call, ids, chunk, first_chunk_ids=None if first is None else first[:rows],
                         cache=case.new_cache(rows), in_place=case.cache.in_place)
        logit_ok = logit_ok and _close(run.logits, full, case.tol) and run.cache.seq_len == T
        logit_err, life = max(logit_err, _max_abs(run.logits, full)), max(life, run.lifecycle_error)
        found = _kv_error(case.model, ids, run.cache, case.tol)
        kv = None if found is None or kv is None else (kv[0] and found[0], max(kv[1], found[1]))
    what = ", ".join(f"{c}" + (f" (batch {r})" if r != B else "") for r, c in runs)
    out.append(("logits", logit_ok, logit_err, f"{T} tokens, batch {B}, in chunks of {what}"))
    out.append(("kv", None if kv is None else kv[0], 0.0 if kv is None else kv[1], "each layer's K/V"))
    out.append(("lifecycle", life == 0.0, life, "what a cache held before a call"))


def _causality(case: Case, out: list) -> None:
    ids, chunk = case.ids, case.chunks[-1]
    edited = ids.clone()
    edited[:, -1] = (ids[:, -1] + 1) % case.model.config.vocab_size
    before = [case.full(ids), _feed(case.call, case.new_cache(), ids, chunk)[0]]
    after = [case.full(edited), _feed(case.call, case.new_cache(), edited, chunk)[0]]
    err = max(_max_abs(a[:, :-1], b[:, :-1]) for a, b in zip(after, before))
    ok = all(_close(a[:, :-1], b[:, :-1], case.tol) for a, b in zip(after, before))
    out.append(("causality", ok, err, "last token edited, earlier positions compared"))


def _last_only(case: Case, out: list) -> None:
    ids, split = case.ids, case.ids.shape[1] // 2
    full = case.full(ids)
    whole = case.call(ids, None, last_only=True)[0]
    _, cache = _feed(case.call, case.new_cache(), ids[:, :split], case.chunks[-1])
    cached, cache = case.call(ids[:, split:], cache, last_only=True)
    ok = _close(whole, full[:, -1:], case.tol) and _close(cached, full[:, -1:], case.tol)
    out.append(("last_only", ok and cache.seq_len == ids.shape[1],
                max(_max_abs(whole, full[:, -1:]), _max_abs(cached, full[:, -1:])), "full and cached"))


def _batches(case: Case) -> list[torch.Tensor]:
    """The stream at its full batch and, if that is larger, at batch 1 (bugs that squeeze a dim of 1)."""
    return [case.ids] + ([case.ids[:1]] if case.ids.shape[0] > 1 else [])


def _prefill_decode(case: Case, out: list) -> None:
    prompt, ok, err = 7, True, 0.0
    for ids in _batches(case):
        full = case.full(ids)
        logits, cache = _model.prefill(case.call, ids[:, :prompt], case.new_cache(ids.shape[0]))
        steps = [logits]
        for t in range(prompt, ids.shape[1] - 1):
            token = ids[:, t] if t % 2 else ids[:, t:t + 1]  # decode_step takes [B] and [B, 1]
            logits, cache = _model.decode_step(case.call, token, cache)
            steps.append(logits)
        got, want = torch.cat(steps, dim=1), full[:, prompt - 1:-1]
        ok = ok and _close(got, want, case.tol) and cache.seq_len == ids.shape[1] - 1
        err = max(err, _max_abs(got, want))
        if case.impl == "model" and case.kind == "dynamic":  # prefill makes its own (dynamic) cache
            own, own_cache = _model.prefill(case.model, ids[:, :prompt])
            ok = ok and _close(own, full[:, prompt - 1:prompt], case.tol) and own_cache.seq_len == prompt
            err = max(err, _max_abs(own, full[:, prompt - 1:prompt]))
    out.append(("prefill_decode", ok, err, f"prefill {prompt}, then decode_step; batch {case.ids.shape[0]} and 1"))


def _generate(case: Case, out: list) -> None:
    if case.impl != "model" or case.kind not in ("dynamic", "static", "window"):
        out.append(("generate", None, 0.0, "generate() takes the model and a kind it knows"))
        return
    ok, gap = True, 0.0
    for ids in _batches(case):
        prompt = ids[:, :5]
        new = ids.shape[1] - prompt.shape[1]
        tokens = _model.generate(case.model, prompt, new, cache=case.kind)
        if tuple(tokens.shape) != tuple(ids.shape) or not torch.equal(tokens[:, :5], prompt):
            out.append(("generate", False, float("inf"), f"returned shape {tuple(tokens.shape)}"))
            return
        logits = case.full(tokens)[:, 4:-1]  # position t predicts token t + 1
        best = logits.max(dim=-1).values
        chosen = logits.gather(-1, tokens[:, 5:, None]).squeeze(-1)
        worst = float((best - chosen).max().item())  # 0 when every pick is the argmax
        ok = ok and worst <= 2 * case.tol * (1 + float(best.abs().max().item()))  # a near tie may go either way
        gap = max(gap, worst)
    out.append(("generate", ok, gap, f"{new} tokens vs argmax of one full forward; batch {case.ids.shape[0]} and 1"))


def _crop(case: Case, out: list) -> None:
    ids, T = case.ids, case.ids.shape[1]
    fill, keep = T - T // 4, T // 2 - 5
    _, cache = _feed(case.call, case.new_cache(), ids[:, :fill], case.chunks[-1])
    if not hasattr(cache, "crop"):
        out.append(("crop", None, 0.0, "the cache has no crop"))
        return
    cache = cache.crop(keep)
    target = torch.cat((ids[:, :keep], case.alt[:, keep:]), dim=1)
    logits, cache = _feed(case.call, cache, target[:, keep:], 5)
    name, ok, err, _ = _compare("crop", logits, case.full(target)[:, keep:], case.tol, "")
    out.append((name, ok and cache.seq_len == T, err, f"fill {fill}, crop to {keep}, continue"))


def _branch(case: Case, out: list) -> None:
    ids, T = case.ids, case.ids.shape[1]
    P = T // 2
    _, prefix = _feed(case.call, case.new_cache(), ids[:, :P], case.chunks[-1])
    before = _snapshot(prefix)
    ok, err, changed = True, 0.0, 0.0
    for tail in (ids[:, P:], case.alt[:, P:]):
        logits, _ = _feed(case.call, prefix, tail, 5)
        _, good, e, _ = _compare("", logits, case.full(torch.cat((ids[:, :P], tail), dim=1))[:, P:], case.tol, "")
        ok, err = ok and good, max(err, e)
        if case.cache.in_place:
            prefix = prefix.crop(P)  # the documented way back to the prefix of a cache written in place
        if prefix.seq_len != P:
            changed = float("inf")
        changed = max(changed, _changed(before, prefix, P))
    out.append(("branch", ok and changed == 0.0, max(err, changed), f"two continuations of a {P}-token prefix"))


class InjectedFailure(RuntimeError):
    """Raised inside a layer by the ``failure`` scenario."""


def _layers(model: nn.Module) -> Sequence[nn.Module]:
    return getattr(model, "h", None) or getattr(model, "layers", None) or []


def _failure(case: Case, out: list) -> None:
    ids, P = case.ids, case.ids.shape[1] // 2
    layers = _layers(case.model)
    if len(layers) == 0:
        out.append(("failure", None, 0.0, "no layer list (model.h or model.layers) to inject into"))
        return
    _, cache = _feed(case.call, case.new_cache(), ids[:, :P], case.chunks[-1])
    before, length = _snapshot(cache), cache.seq_len

    def fail(module, args):
        raise InjectedFailure("injected failure in the last layer")

    handle = layers[-1].register_forward_pre_hook(fail)
    try:
        case.call(ids[:, P:P + 5], cache)
        raised = False
    except InjectedFailure:
        raised = True
    finally:
        handle.remove()
    same_shape = cache.seq_len == length and all(tuple(now.shape) == tuple(old.shape)
                                                 for i, pair in enumerate(before.layers)
                                                 for old, now in zip(pair, cache.layer(i)))
    changed = _changed(before, cache, length) if same_shape else float("inf")
    logits, _ = case.call(ids[:, P:P + 5], cache)
    _, good, err, _ = _compare("", logits, case.full(ids)[:, P:P + 5], case.tol, "")
    detail = f"last layer raises on a call after {P} positions" if raised else "the injected failure never fired"
    out.append(("failure", raised and changed == 0.0 and good, max(changed, err), detail))


def _reference(case: Case, out: list) -> None:
    if case.spec.reference is None:
        out.append(("reference", None, 0.0, "no independent reference for this model"))
        return
    want = case.spec.reference(case.model)(case.ids)
    full = case.full(case.ids)
    cached, _ = _feed(case.call, case.new_cache(), case.ids, case.chunks[-1])
    ok = _close(full, want, case.tol) and _close(cached, want, case.tol)
    out.append(("reference", ok, max(_max_abs(full, want), _max_abs(cached, want)), case.spec.reference_name))


SCENARIOS: dict[str, Callable[[Case, list], None]] = {
    "stream": _stream, "causality": _causality, "last_only": _last_only, "prefill_decode": _prefill_decode,
    "generate": _generate, "crop": _crop, "branch": _branch, "failure": _failure, "reference": _reference}
"""Scenario name -> function that appends ``(check, passed, error, detail)`` tuples."""

CHECKS = ("logits", "kv", "lifecycle", "causality", "last_only", "prefill_decode", "generate", "crop",
          "branch", "failure", "reference")
"""Every check name, in report order."""

SCENARIO_CHECK = {"stream": "logits"}
"""The check a scenario's exception is reported under, where it differs from the scenario's name."""

WHAT: dict[str, str] = {
    "logits": "cached vs full logits, every position, whole vocabulary",
    "kv": "each layer's cached K and V vs the full forward's projections",
    "lifecycle": "what a cache held before a call, after it (bitwise)",
    "causality": "earlier positions after the last token changes, both paths",
    "last_only": "last_only=True vs the full forward's last position",
    "prefill_decode": "prefill, then decode_step per token, vs the full forward",
    "generate": "generate()'s picks vs the argmax of one full forward",
    "crop": "crop a filled cache, continue with other tokens",
    "branch": "two continuations of one prefix cache; the prefix unchanged",
    "failure": "a layer raises mid-call: caches unchanged, continuing is right",
    "reference": "full and cached vs an independent implementation",
}
"""What each check compares, for tables."""
