"""The checks that the cached path computes the full forward's function, on one combination,
within :data:`kvdoc.proofs.compare.TOLERANCE`: the stream's checks for every batch and chunk
size of the case (the stream past positions 32 and 64, fed in chunks none of which divides it
but 1), ``last_only=True``, and the model's independent reference, full and cached. Causality
edits the last token: only the last call sees it, so it is rerun from the cache kept before it;
and with the second half of the stream replaced, every layer's full-forward K and V of the first
half must stay bit for bit the same (what keeps a cache's stored rows valid).
"""

from __future__ import annotations

import torch

from kvdoc.core.state import StateSpec

from .broken.decoders import stale_prefix
from .case import Case, scenario
from .compare import CachedRun, close, full_forward_kv, max_abs


def _state(config, layer: int) -> StateSpec | None:
    spec = getattr(config, "cache_layout", ())[layer]
    return spec if isinstance(spec, StateSpec) else None


def _cached_shapes(config, batch: int, length: int,
                   layer: int = 0) -> tuple[tuple[int, ...], ...]:
    """What layer ``layer`` caches: K and V ``[B, H_kv, T, D_h]``, the shapes the config states,
    or a state layer's ``[B, *shape]`` whatever the length."""
    if _state(config, layer) is not None:
        return tuple((batch, *shape) for _, shape in _state(config, layer).shapes)
    if hasattr(config, "cached_shapes"):
        return tuple(config.cached_shapes(batch, length))
    shape = (batch, config.n_kv_head, length, config.head_dim)
    return shape, shape


@scenario("stream", {
    "logits": "cached vs full logits, every position, whole vocabulary",
    "kv": "each layer's cached K and V vs the full forward's projections",
    "kv_shape": "each layer's cached K and V are [B, H_kv, T, D_h] (MLA: c_KV and k_rope)",
    "causality": "earlier positions after the last token changes, both paths; earlier K/V "
                 "bitwise after later tokens change",
    "lifecycle": "what a cache held before a call, after it (bitwise)"}, raises_as="logits")
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
        later, half = ids.clone(), T // 2  # later tokens replaced: earlier K/V must not move
        later[:, half:] = (ids[:, half:] + 1) % vocab
        kept = [(a[:, :, :half], b[:, :, :half])  # a state folds the later tokens in
                for i, (pa, pb) in enumerate(zip(full_kv, full_forward_kv(case.model, later)[1],
                                                 strict=True)) if _state(cfg, i) is None
                for a, b in zip(pa, pb, strict=True)]
        full_causal_ok = full_causal_ok and all(torch.equal(a, b) for a, b in kept)
        full_causal = max(full_causal, *(max_abs(a, b) for a, b in kept))
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
                            == _cached_shapes(cfg, batch, len(h), i)
                            for i, (pair, h) in enumerate(zip(got, held, strict=True)))
            add("kv_shape", shapes_ok, 0.0 if shapes_ok else float("inf"),
                f"each layer's two cached tensors {' and '.join(str(list(w)) for w in want)}")
            # a state layer: its state, to the one the full forward's inputs fold to
            pairs = [(g, r if _state(cfg, i) else r[:, :, h.start:h.stop])
                     for i, (gp, rp, h) in enumerate(zip(got, full_kv, held, strict=True))
                     for g, r in zip(gp, rp, strict=True)]
            add("kv", all(close(g, r, case.tol) for g, r in pairs),
                max((max_abs(g, r) for g, r in pairs), default=0.0), "each layer's K/V")
            add("lifecycle", run.lifecycle_error == 0.0, run.lifecycle_error,
                "what a cache held before a call")
            causal_ok, causal, logits = full_causal_ok, full_causal, run.logits
            if chunk > 1:  # with one token per call the last token reaches no earlier call
                if last and run.cache is fork:  # the last call wrote into the kept cache
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
            add("causality", causal_ok, causal, "last token edited, earlier positions compared; "
                "second half replaced, first half's K/V bitwise")


@scenario("last_only", {"last_only": "last_only=True vs the full forward's last position"})
def _last_only(case: Case, out: list) -> None:
    ids, split = case.ids, case.ids.shape[1] // 2
    last = case.full(ids)[:, -1:]
    whole = case.call(ids, None, last_only=True)[0]
    cache = case.feed(ids[:, :split], case.chunks[-1]).cache
    cached, cache = case.call(ids[:, split:], cache, last_only=True)
    out.append(case.compared("last_only", [(whole, last), (cached, last)], "full and cached",
                             cache.seq_len == ids.shape[1]))


@scenario("reference", {"reference": "full and cached vs an independent implementation"})
def _reference(case: Case, out: list) -> None:
    reference = case.caches.get("reference", case.spec.reference)  # a variant's loader
    if reference is None:
        out.append(case.result("reference", None, 0.0, "no independent reference for this model"))
        return
    want = case.shared.get("reference")
    if want is None:  # built from the weights, which every case of this model shares
        want = case.shared["reference"] = reference(case.model)(case.ids)
    cached = case.feed(case.ids, case.chunks[-1]).logits
    out.append(case.compared("reference", [(case.full(case.ids), want), (cached, want)],
                             case.spec.reference_name))

