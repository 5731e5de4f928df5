"""The checks of the verification suite, and the scenarios that make them on one combination.

Each check compares against one full forward of the same model unless :data:`CHECKS` says
otherwise; tolerances are :data:`kvdoc.proofs.compare.TOLERANCE` (``atol = rtol``, 1e-5 in FP32,
1e-10 in FP64).

* ``stream`` makes ``logits``, ``kv``, ``kv_shape``, ``causality`` and ``lifecycle`` for every
  batch size and chunk size of the case: a stream of :data:`kvdoc.proofs.grid.STREAM_LENGTH`
  tokens (past positions 32 and 64) fed in chunks of each of :data:`kvdoc.proofs.grid.CHUNKS`
  tokens, none of which divides it except 1. Causality edits the last token: the full forward
  and the cached path must keep every earlier position (for chunks of two or more tokens the
  last call, the only one that sees the last token, is rerun with it edited from the cache as
  it was before that call; with one token per call, no earlier call ever sees the last token).
* ``last_only``: ``last_only=True`` returns the last position, full and cached.
* ``prefill_decode``: ``kvdoc.core.model.prefill`` of 7 tokens, then ``decode_step`` per token
  (ids ``[B]`` and ``[B, 1]`` in turn) to the stream's end at batch 1 (at the full batch to
  :data:`DECODE_CUT` tokens, when the stream checks made one-token calls there to the end);
  ``prefill`` without a cache too.
* ``generate``: every token ``kvdoc.core.model.generate`` picks is the greedy argmax of one full
  forward over its output (a near tie within the tolerance counts as either token); batch 1
  and the full batch, cut as in ``prefill_decode``.
* ``crop``, ``branch``, ``failure`` and ``failure_after``, ``fresh``, ``weights``: what a cache
  and a model go through between calls (:mod:`kvdoc.proofs.lifecycle`).
* ``reference``: the model's independent reference (:mod:`kvdoc.proofs.references`), full and
  cached.
* ``counted``: the byte and FLOP figures of :mod:`kvdoc.measure` against a filled cache's
  tensors and counted operations (:mod:`kvdoc.proofs.counted`).
* ``generate_padded``: the function a user calls for a padded batch, each row vs its prompt
  alone (:mod:`kvdoc.proofs.entry_points`).
* ``bytes``, ``edges``, ``padded``: the cache invariants of :mod:`kvdoc.proofs.invariants`;
  ``int8``: the int8 cache's contract (:mod:`kvdoc.proofs.int8_contract`); ``fp8``: the FP8
  cache's (:mod:`kvdoc.proofs.fp8_contract`).
* ``scheduling``: static, continuous and chunked-prefill schedules of a short arrival trace
  (:func:`kvdoc.proofs.scheduling.check_policies`), preemption by recompute on a small pool
  (:func:`~kvdoc.proofs.scheduling.check_preemption`) and seeded forks of one prompt
  (:func:`~kvdoc.proofs.scheduling.check_forks`), each request vs its solo run; on the paged
  kind of every model (the scheduler builds its own pool).
* ``prefix-cache``: a few-shot workload through a radix tree
  (:func:`kvdoc.proofs.prefix_cache.prefix_cache_scenario`), each request vs itself alone; on
  the paged kind.
* ``handover``: a prefill's cache packed, unpacked and decoded from
  (:func:`kvdoc.proofs.handover.check_handover`); on the dynamic kind of every model (a latent
  model ships its latent).
* ``schedule``, ``eviction``, ``full-match``, ``speculative-distribution``,
  ``preempted-stream``: policies against their specification and sampling against its
  distribution (:mod:`kvdoc.proofs.policies`); on the paged kind.

A scenario appends :class:`CheckResult` s (made by :meth:`Case.result`); ``passed`` is None when
a check does not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kvdoc.core.cache import KVCache
from kvdoc.core.model import decode_step, generate, prefill
from kvdoc.serving.speculative import speculative_generate, truncated_draft

from . import fp8_contract, int8_contract, invariance, invariants, lifecycle, policies, precision
from .broken.decoders import stale_prefix
from .compare import DTYPE_NAMES, TOLERANCE, CachedRun, close, full_forward_kv, max_abs, run_cached
from .counted import CHECK as COUNTED
from .counted import scenario as counted
from .entry_points import CHECKS as ENTRY_CHECKS
from .entry_points import SCENARIOS as ENTRY_POINTS
from .grid import CacheSpec, ModelSpec
from .handover import handover_scenario
from .prefix_cache import prefix_cache_scenario
from .scheduling import scheduling_scenario

SPARE = 8
"""Positions of capacity beyond the stream that a cache is built with (for kinds that take one)."""

CHECKS: dict[str, str] = {
    "logits": "cached vs full logits, every position, whole vocabulary",
    "kv": "each layer's cached K and V vs the full forward's projections",
    "kv_shape": "each layer's cached K and V are [B, H_kv, T, D_h] (MLA: c_KV and k_rope)",
    "causality": "earlier positions after the last token changes, both paths",
    "lifecycle": "what a cache held before a call, after it (bitwise)",
    "last_only": "last_only=True vs the full forward's last position",
    "prefill_decode": "prefill, then decode_step per token, vs the full forward",
    "generate": "generate()'s picks vs the argmax of one full forward",
    "speculative": "speculative decoding's tokens (draft, verify, crop) vs that argmax",
    **lifecycle.CHECKS,  # crop, branch, failure, failure_after, fresh, weights
    "reference": "full and cached vs an independent implementation",
}
"""Every check by name, in report order, with what it compares."""
CHECKS.update({"bytes": invariants.CHECKS["bytes"], "int8": int8_contract.CHECK,
               "fp8": fp8_contract.CHECK,
               **invariants.CHECKS})  # cache invariants, the int8 and FP8 contracts, edges
CHECKS.update({
    "scheduling": "static, continuous, chunked-prefill, preempting and forking runs: each "
                  "request vs its solo run",
    "prefix-cache": "requests served through a radix prefix cache vs each request alone",
    "handover": "prefill, cache packed and unpacked, decode vs generate; cached bytes vs formula",
})
CHECKS.update(policies.CHECKS)  # policies vs their specification, sampling vs its distribution


@dataclass(frozen=True)
class CheckResult:
    """One check on one combination. ``passed`` is None when the check does not apply.

    ``batch`` and ``chunk`` are set for the checks of one stream run (``chunk`` is None for
    the other checks); ``error`` is the largest difference (``inf`` for a shape mismatch, NaN,
    or code that raised).
    """

    check: str
    model: str
    kind: str
    impl: str
    dtype: str
    passed: bool | None
    error: float
    detail: str
    batch: int | None = None
    chunk: int | None = None


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
    batches: Sequence[int]
    chunks: Sequence[int]
    stale: bool
    fresh: Callable[[], nn.Module]
    """A copy of the model as it was built, before any call ran on it (a new copy each call)."""
    implementation: Callable[[nn.Module], Callable]
    """How the cached call is made from a model (``grid.IMPLEMENTATIONS[impl]``)."""
    shared: dict = field(default_factory=dict)
    """What every case of this model, dtype and stream computes alike (the reference's logits)."""
    caches: Mapping[str, Callable[[nn.Module, int, int], KVCache]] = field(default_factory=dict)
    """Cache factories a broken variant puts in place of the real ones, by kind (or ``"int8"``,
    ``"fp8"``)."""
    in_dtype: Callable[[torch.dtype], nn.Module] | None = None
    """The model under test built afresh in another dtype (a broken variant built from the
    correct model in that dtype, as in the run itself)."""

    @property
    def tol(self) -> float:
        return TOLERANCE[self.dtype]

    def result(self, check: str, passed: bool | None, error: float, detail: str,
               batch: int | None = None, chunk: int | None = None) -> CheckResult:
        return CheckResult(check, self.model_name, self.kind, self.impl, DTYPE_NAMES[self.dtype],
                           passed, error, detail, batch, chunk)

    def new_cache(self, batch: int | None = None) -> KVCache:
        # spare capacity: a cache that reads past its filled rows then reads rows never written
        new = self.caches.get(self.kind, self.cache.new)
        return new(self.model, batch or self.ids.shape[0], self.capacity)

    def feed(self, tokens: torch.Tensor, chunk: int, cache: KVCache | None = None,
             first: torch.Tensor | None = None) -> CachedRun:
        """``tokens`` fed through the cached call after ``cache`` (default a new one)."""
        cache = self.new_cache(tokens.shape[0]) if cache is None else cache
        return run_cached(self.call, tokens, chunk, first_chunk_ids=first, cache=cache,
                          in_place=self.cache.in_place)

    def full(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)[0]

    @property
    def capacity(self) -> int:
        """What a new cache of this case is built to hold: the stream and :data:`SPARE`."""
        return self.ids.shape[1] + SPARE

    def both_batches(self) -> list[torch.Tensor]:
        """The stream at its full batch and, if larger, at batch 1 (bugs that squeeze a dim of
        1)."""
        return [self.ids] + ([self.ids[:1]] if self.ids.shape[0] > 1 else [])


def _cached_shapes(config, batch: int, length: int) -> tuple[tuple[int, ...], ...]:
    """What each layer caches: K and V ``[B, H_kv, T, D_h]``, or the shapes the config states
    (an MLA config's ``c_KV`` and ``k_rope``, :meth:`kvdoc.core.mla.MLAConfig.cached_shapes`)."""
    if hasattr(config, "cached_shapes"):
        return tuple(config.cached_shapes(batch, length))
    shape = (batch, config.n_kv_head, length, config.head_dim)
    return shape, shape


def _stream(case: Case, out: list) -> None:
    T, vocab = case.ids.shape[1], case.model.config.vocab_size
    cfg = case.model.config
    for batch in case.batches:
        ids = case.ids[:batch]
        edited = ids.clone()
        edited[:, -1] = (ids[:, -1] + 1) % vocab
        full, full_kv = full_forward_kv(case.model, ids)  # refuses a layout it cannot probe
        full_edited = case.full(edited)
        full_causal = max_abs(full_edited[:, :-1], full[:, :-1])
        full_causal_ok = close(full_edited[:, :-1], full[:, :-1], case.tol)
        first, first_edited = ((stale_prefix(ids, vocab), stale_prefix(edited, vocab)) if case.stale
                               else (None, None))
        for chunk in case.chunks:
            # the last call, the only one that sees the last token, starts at `last`: the cache
            # before it is kept, so the causality rerun repeats that call alone
            last = (T - 1) // chunk * chunk if chunk > 1 else 0
            if last:
                head = case.feed(ids[:, :last], chunk, first=first)
                fork = head.cache
                tail = case.feed(ids[:, last:], chunk, head.cache)
                run = CachedRun(torch.cat((head.logits, tail.logits), dim=1), tail.cache,
                                max(head.lifecycle_error, tail.lifecycle_error))
            else:
                run = case.feed(ids, chunk, first=first)

            def add(check, passed, error, detail, batch=batch, chunk=chunk):
                out.append(case.result(check, passed, error, detail, batch, chunk))

            add("logits", close(run.logits, full, case.tol) and run.cache.seq_len == T,
                max_abs(run.logits, full), f"{T} tokens in chunks of {chunk}")
            # a window cache (a hybrid cache's window layers) holds only the last positions
            held = [run.cache.held(i) for i in range(cfg.n_layer)]
            got = [run.cache.layer(i) for i in range(cfg.n_layer)]
            want = _cached_shapes(cfg, batch, len(held[0]))
            shapes_ok = all(tuple(tuple(t.shape) for t in pair)
                            == _cached_shapes(cfg, batch, len(h))
                            for pair, h in zip(got, held, strict=True))
            add("kv_shape", shapes_ok, 0.0 if shapes_ok else float("inf"),
                f"each layer's two cached tensors {' and '.join(str(list(w)) for w in want)}")
            pairs = [(g, r[:, :, h.start:h.stop])
                     for gp, rp, h in zip(got, full_kv, held, strict=True)
                     for g, r in zip(gp, rp, strict=True)]
            add("kv", all(close(g, r, case.tol) for g, r in pairs),
                max((max_abs(g, r) for g, r in pairs), default=0.0), "each layer's K/V")
            add("lifecycle", run.lifecycle_error == 0.0, run.lifecycle_error,
                "what a cache held before a call")
            causal_ok, causal, logits = full_causal_ok, full_causal, run.logits
            if chunk > 1:  # with one token per call the last token reaches no earlier call
                if last and case.cache.in_place:  # the last call wrote into the kept cache
                    fork = run.cache.crop(last)
                # the stream's own cache goes first: a paged pool is sized for one stream
                run = tail = got = None
                if last and fork is not None:  # earlier calls never see the last token
                    again = case.feed(edited[:, last:], chunk, fork).logits[:, :-1]
                    before = logits[:, last:-1]
                else:
                    again = case.feed(edited, chunk, first=first_edited).logits[:, :-1]
                    before = logits[:, :-1]
                causal_ok = causal_ok and close(again, before, case.tol)
                causal = max(causal, max_abs(again, before))
            add("causality", causal_ok, causal, "last token edited, earlier positions compared")


def _last_only(case: Case, out: list) -> None:
    ids, split = case.ids, case.ids.shape[1] // 2
    full = case.full(ids)
    whole = case.call(ids, None, last_only=True)[0]
    cache = case.feed(ids[:, :split], case.chunks[-1]).cache
    cached, cache = case.call(ids[:, split:], cache, last_only=True)
    ok = close(whole, full[:, -1:], case.tol) and close(cached, full[:, -1:], case.tol)
    err = max(max_abs(whole, full[:, -1:]), max_abs(cached, full[:, -1:]))
    ok = ok and cache.seq_len == ids.shape[1]
    out.append(case.result("last_only", ok, err, "full and cached"))


DECODE_CUT = 20
"""Tokens of the full-batch stream that ``prefill_decode`` and ``generate`` run, when the stream
checks already made one-token calls at that batch to the stream's end (the same calls)."""


def _decode_batches(case: Case) -> list[torch.Tensor]:
    """:meth:`Case.both_batches`, the full batch cut to :data:`DECODE_CUT` tokens where the
    stream checks ran one token per call at it (batch 1 always runs the whole stream)."""
    batches = case.both_batches()
    if len(batches) > 1 and 1 in case.chunks:
        batches[0] = batches[0][:, :DECODE_CUT]
    return batches


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
    """Whether every token after ``prompt`` is the argmax of one full forward (a near tie,
    within the dtype's tolerance, may go either way), and the largest logit gap."""
    logits = case.full(tokens)[:, prompt - 1:-1]  # position t predicts token t + 1
    best = logits.max(dim=-1).values
    chosen = logits.gather(-1, tokens[:, prompt:, None]).squeeze(-1)
    worst = float((best - chosen).max().item())  # 0 when every pick is the argmax
    return worst <= 2 * case.tol * (1 + float(best.abs().max().item())), worst


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


def _reference(case: Case, out: list) -> None:
    reference = case.caches.get("reference", case.spec.reference)  # a variant's loader
    if reference is None:
        out.append(case.result("reference", None, 0.0, "no independent reference for this model"))
        return
    want = case.shared.get("reference")
    if want is None:  # built from the weights, which every case of this model shares
        want = case.shared["reference"] = reference(case.model)(case.ids)
    full = case.full(case.ids)
    cached = case.feed(case.ids, case.chunks[-1]).logits
    ok = close(full, want, case.tol) and close(cached, want, case.tol)
    out.append(case.result("reference", ok, max(max_abs(full, want), max_abs(cached, want)),
                           case.spec.reference_name))


SCENARIOS: dict[str, Callable[[Case, list], None]] = {
    # early: cheap, and all that sees a wrong measure or entry point (the sweep stops there)
    "stream": _stream, "last_only": _last_only, "counted": counted,
    **ENTRY_POINTS,
    "prefill_decode": _prefill_decode,
    "generate": _generate, "speculative": _speculative, **lifecycle.SCENARIOS,
    "reference": _reference}
"""Scenario name -> function that appends :class:`CheckResult` s."""
SCENARIOS.update(invariants.SCENARIOS)
SCENARIOS["int8"] = int8_contract.scenario
SCENARIOS["fp8"] = fp8_contract.scenario
SCENARIOS.update({"scheduling": scheduling_scenario, "prefix-cache": prefix_cache_scenario,
                  "handover": handover_scenario})
CHECKS["invariance"], SCENARIOS["invariance"] = invariance.CHECK, invariance.scenario
CHECKS.update(precision.CHECKS)
SCENARIOS["bf16"] = precision.scenario  # the bf16 and fp16 checks, and their references
SCENARIOS.update(policies.SCENARIOS)

SCENARIO_CHECK = {"stream": "logits"}
"""The check a scenario's exception is reported under, where it differs from the scenario's name."""
CHECKS.update({"counted": COUNTED, **ENTRY_CHECKS})
