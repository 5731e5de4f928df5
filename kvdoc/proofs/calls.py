"""The calls a user makes and what comes between them, as scenarios of the grid: prefill and
decode steps, ``generate`` and speculative decoding against one full forward
(picks: its argmax, a near tie within the tolerance either way); crop (refused where a layer
cannot go back, then a state layer's snapshot restored instead), branch, a call that raises
midway; a model no call has run on (a table built on the first call and grown wrongly shows only
there); weights changed in place after the call was built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from kvdoc.core.cache import KVCache
from kvdoc.core.model import decode_step, generate, prefill
from kvdoc.core.state import restore, snapshot, state_layers
from kvdoc.serving.speculative import speculative_generate, truncated_draft

from .case import Case, CheckResult, scenario
from .compare import Snapshot, close, held_rows, max_abs, run_cached

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
    prompt, pairs, lengths_ok = 7, [], True
    for ids in _decode_batches(case):
        full = case.full(ids)
        logits, cache = prefill(case.call, ids[:, :prompt], case.new_cache(ids.shape[0]))
        steps = [logits]
        for t in range(prompt, ids.shape[1] - 1):
            token = ids[:, t] if t % 2 else ids[:, t:t + 1]  # decode_step takes [B] and [B, 1]
            logits, cache = decode_step(case.call, token, cache)
            steps.append(logits)
        pairs.append((torch.cat(steps, dim=1), full[:, prompt - 1:-1]))
        lengths_ok = lengths_ok and cache.seq_len == ids.shape[1] - 1
        if case.impl == "model" and case.kind == "dynamic":  # prefill makes its own (dynamic) cache
            own, own_cache = prefill(case.model, ids[:, :prompt])
            pairs.append((own, full[:, prompt - 1:prompt]))
            lengths_ok = lengths_ok and own_cache.seq_len == prompt
    out.append(case.compared("prefill_decode", pairs, f"prefill {prompt}, then decode_step; "
                             f"batch {case.ids.shape[0]} and 1", lengths_ok))


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


def rounds_of_a_perfect_draft(new: int, k: int) -> list[int]:
    """The proposals each round accepts when the draft always agrees with the target: ``k``,
    or what the tokens still to produce leave room for (a round also adds the target's own).

    >>> rounds_of_a_perfect_draft(10, 3), rounds_of_a_perfect_draft(1, 3)
    ([3, 3, 1], [0])
    """
    accepted = []
    while new > 0:
        accepted.append(min(k, new - 1))
        new -= accepted[-1] + 1
    return accepted


def _same_state(case: Case, cache: KVCache, model: nn.Module, kept: torch.Tensor,
                new_cache) -> tuple[bool, float]:
    """Whether ``cache`` holds what a fresh cache of ``model`` fed ``kept`` holds: its length,
    and each layer's tensors within the tolerance."""
    _, fresh = model(kept, new_cache(model, 1, kept.shape[1] + 8))
    if cache.seq_len != fresh.seq_len:
        return False, math.inf
    pairs = [(a, b) for i in range(fresh.n_layer)
             for a, b in zip(cache.layer(i), fresh.layer(i), strict=True)]
    if any(a.shape != b.shape for a, b in pairs):
        return False, math.inf
    return (all(close(a, b, case.tol) for a, b in pairs),
            max((max_abs(a, b) for a, b in pairs), default=0.0))


@scenario("speculative", {
    "speculative": "speculative decoding's tokens (draft, verify, crop) vs that argmax",
    "speculative_state": "after the rounds and their rejections, each model's cache vs a fresh "
                         "one fed the tokens kept",
    "speculative_perfect": "the target as its own draft: every proposal accepted"})
def _speculative(case: Case, out: list) -> None:
    if case.impl != "model" or not case.new_cache(1).keeps_every_position:
        out.append(case.result("speculative", None, 0.0, "speculative_generate takes the model "
                               "and a cache that keeps every position (it crops)"))
        return
    new_cache = case.caches.get(case.kind, case.cache.new)
    speculate = case.caches.get("speculative", speculative_generate)  # a variant's rollback
    prompt, k = case.ids[:1, :5], 3
    # past 32 positions (long-stream bugs), short of the stream's end: the verify call reaches
    # k positions past the last token
    new = min(40, case.ids.shape[1] - 5 - k)

    def factory(model, capacity):
        return new_cache(model, 1, capacity)

    draft = truncated_draft(case.model, 1)
    run = speculate(case.model, draft, prompt, new, k=k, cache=factory)
    ok, gap = _greedy(case, run.tokens, 5)
    ok = ok and run.tokens.shape[1] == 5 + new and sum(run.accepted) + run.rounds == new
    out.append(case.result("speculative", ok, gap,
                           f"{new} tokens, a 1-layer draft proposing {k} a round, "
                           f"{sum(run.accepted)} kept; vs argmax of one full forward"))
    # what the rounds leave is what the next round reads: a rejected proposal's row kept in
    # the draft costs only acceptance, never a token, so only the state shows it
    kept = run.tokens[:, :-1]
    states = [_same_state(case, c, m, kept, new_cache)
              for c, m in ((run.target_cache, case.model), (run.draft_cache, draft))]
    out.append(case.result("speculative_state", all(s for s, _ in states),
                           max(e for _, e in states),
                           f"target's and draft's caches after {run.rounds} rounds "
                           f"({run.rounds - run.accepted.count(k)} with a rejection or a "
                           "short last round) vs fresh caches fed the kept tokens"))
    if case.kind != "dynamic":  # acceptance is the loop's, not a cache kind's: once a model
        return
    perfect = speculate(case.model, case.model, prompt, new, k=k, cache=factory)
    want = rounds_of_a_perfect_draft(new, k)
    out.append(case.result("speculative_perfect", perfect.accepted == want,
                           float(sum(want) - sum(perfect.accepted)),
                           f"accepted {sum(perfect.accepted)} of {sum(want)} proposals over "
                           f"{perfect.rounds} rounds"))


@scenario("crop", {"crop": "crop a filled cache, continue with other tokens"})
def _crop(case: Case, out: list) -> None:
    ids, T = case.ids, case.ids.shape[1]
    fill, keep = T - T // 4, T // 2 - 5
    cache = case.feed(ids[:, :fill], case.chunks[-1]).cache
    if cache.held().start > 0:  # a window layer past its window: the rows a crop needs are gone
        before, refused = Snapshot.of(cache), False
        try:
            cache.crop(keep)
        except ValueError:
            refused = True
        changed = before.changed(cache) if cache.seq_len == fill else math.inf
        result = case.result("crop", refused and changed == 0.0, changed,
                             f"fill {fill}, a crop to {keep} refused, the cache unchanged")
        out.append(_restored(case, keep, fill, result) if state_layers(cache) else result)
        return
    # a shared-prefix cache's pool holds the filled one or the cropped one
    out.append(_continued(case, cache.crop(keep), keep, f"fill {fill}, crop to {keep}, continue"))


def _continued(case: Case, cache: KVCache, keep: int, detail: str, also: bool = True,
               error: float = 0.0) -> CheckResult:
    """``crop``: the other tokens fed after ``cache`` (``keep`` positions) vs the full forward."""
    target = torch.cat((case.ids[:, :keep], case.alt[:, keep:]), dim=1)
    run = case.feed(target[:, keep:], 5, cache)
    return case.compared("crop", [(run.logits, case.full(target)[:, keep:])], detail,
                         also and run.cache.seq_len == case.ids.shape[1], error)


def _restored(case: Case, keep: int, fill: int, refused: CheckResult) -> CheckResult:
    """After a refused crop of state layers: a snapshot taken at ``keep`` restores the cache
    filled to ``fill``, and the other tokens continue from it as from a fresh prefix."""
    cache = case.feed(case.ids[:, :keep], case.chunks[-1]).cache
    snap = snapshot(cache)
    cache = restore(case.feed(case.ids[:, keep:fill], 5, cache).cache, snap)
    return _continued(case, cache, keep, refused.detail + f"; a snapshot at {keep} restored, "
                      "continued", bool(refused.passed), refused.error)


@scenario("branch", {
    "branch": "two continuations of one prefix cache; the prefix unchanged"})
def _branch(case: Case, out: list) -> None:
    ids, T = case.ids, case.ids.shape[1]
    P = T // 2
    prefix = case.feed(ids[:, :P], case.chunks[-1]).cache
    before = Snapshot.of(prefix)
    pairs, changed = [], 0.0
    for tail in (ids[:, P:], case.alt[:, P:]):
        logits = case.feed(tail, 5, prefix).logits
        pairs.append((logits, case.full(torch.cat((ids[:, :P], tail), dim=1))[:, P:]))
        if case.cache.in_place:
            prefix = prefix.crop(P)  # the way back to the prefix of a cache written in place
        if prefix.seq_len != P:
            changed = float("inf")
        changed = max(changed, before.changed(prefix, P))
    out.append(case.compared("branch", pairs, f"two continuations of a {P}-token prefix",
                             changed == 0.0, changed))


class InjectedFailure(RuntimeError):
    """Raised inside a forward by the ``failure`` scenario."""


def _failure_points(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(check, where, module)``: where the ``failure`` scenario raises, in forward order."""
    layers: Sequence[nn.Module] = getattr(model, "h", None) or getattr(model, "layers", None) or []
    if len(layers) == 0:
        return []
    inside = {"the first layer": layers[0], "the last layer": layers[-1]} if len(layers) > 1 else {
        "the only layer": layers[0]}
    after = {"the last layer's MLP": getattr(layers[-1], "mlp", None),
             "the final norm": getattr(model, "ln_f", None),
             "the LM head": getattr(model, "lm_head", None)}
    return ([("failure", where, m) for where, m in inside.items()]
            + [("failure_after", where, m) for where, m in after.items() if m is not None])


@scenario("failure", {
    "failure": "a layer raises mid-call: caches unchanged, continuing is right",
    "failure_after": "raises after the last attention (MLP, final norm, LM head): caches "
                     "unchanged"})
def _failure(case: Case, out: list) -> None:
    ids, P = case.ids, case.ids.shape[1] // 2
    points = _failure_points(case.model)
    if not points:
        for check in ("failure", "failure_after"):
            out.append(case.result(check, None, 0.0,
                                   "no layer list (model.h or model.layers) to inject into"))
        return

    def prefix() -> tuple[KVCache, Snapshot]:
        cache = case.feed(ids[:, :P], case.chunks[-1]).cache
        return cache, Snapshot.of(cache)

    def fail(module, args):
        raise InjectedFailure("injected failure")

    cache, before = prefix()
    found: dict[str, list[tuple[str, float]]] = {}  # check -> (where, change) per point
    for check, where, module in points:
        handle = module.register_forward_pre_hook(fail)
        try:
            case.call(ids[:, P:P + 5], cache)
            changed = float("inf")  # the injected failure never fired
        except InjectedFailure:
            same_shape = cache.seq_len == P and all(
                tuple(now.shape) == tuple(old.shape)
                for i, pair in enumerate(before.layers)
                for old, now in zip(pair, held_rows(cache, i), strict=True))
            changed = before.changed(cache, P) if same_shape else float("inf")
        except Exception:  # what the code under test raised instead: a failure too
            changed = float("inf")
        finally:
            handle.remove()
        found.setdefault(check, []).append((where, changed))
        if changed != 0.0:  # the next point starts from a cache as it should be
            cache, before = prefix()
    logits, _ = case.call(ids[:, P:P + 5], cache)
    want = case.full(ids)[:, P:P + 5]
    right = close(logits, want, case.tol)
    for check, tried in found.items():
        bad = [where for where, changed in tried if changed != 0.0]
        detail = (f"cache changed or no failure: {', '.join(bad)}" if bad else
                  f"injected in {', '.join(w for w, _ in tried)} after {P} positions")
        out.append(case.result(check, not bad and right,
                               max(max(c for _, c in tried), max_abs(logits, want)), detail))


@scenario("fresh", {
    "fresh": "the cached path on a model no call has run on yet, vs the full forward"})
def _fresh(case: Case, out: list) -> None:
    model = case.fresh()  # no call has run on it: nothing built on a first call exists yet
    call = case.implementation(model)
    pairs, ok, lifecycle = [], True, 0.0
    for ids in case.both_batches():  # batch 1 after the full batch: the copy is no longer fresh
        T = ids.shape[1]
        lengths = [3, 1, 1, 1, 1, 13, T - 20]  # each call reaches past every earlier one
        cache = case.cache.new(model, ids.shape[0], case.capacity)
        run = run_cached(call, ids, lengths, cache=cache, in_place=case.cache.in_place)
        pairs.append((run.logits, case.full(ids)))  # against another copy of the model
        ok = ok and run.cache.seq_len == T and run.lifecycle_error == 0.0
        lifecycle = max(lifecycle, run.lifecycle_error)
    out.append(case.compared("fresh", pairs, f"a copy no call ran on: calls of {lengths}; batch "
                             f"{case.ids.shape[0]} and 1", ok, lifecycle))


@scenario("weights", {
    "weights": "weights changed in place after the call was built: vs the changed model"})
def _weights(case: Case, out: list) -> None:
    model, ids = case.model, case.ids[:, :12]
    params = list(model.parameters())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(21)

    def shift_two():  # in place, as an optimiser step does
        for p in (params[len(params) // 2], params[-1]):
            p.add_(0.05)

    def load_other():
        model.load_state_dict({
            k: v * (1 + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype).to(v.device))
            if v.is_floating_point() else v for k, v in saved.items()})

    pairs = []
    try:
        # the call has run (a prompt, then a step), and made any copy it makes, before the change
        case.feed(ids[:, :3], [2, 1])
        for change in (shift_two, load_other):
            change()
            pairs.append((case.feed(ids, [5] + [1] * (ids.shape[1] - 5)).logits, case.full(ids)))
    finally:
        model.load_state_dict(saved)
    out.append(case.compared("weights", pairs, "add_ on two parameters, then load_state_dict of "
                             "other weights; a prompt of 5, then one-token steps"))
