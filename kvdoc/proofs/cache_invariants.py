"""Cache invariants and edges, scenarios of the grid:

* ``bytes``: after every call of a short stream, ``nbytes()`` equals the bytes of the tensors
  found in the cache object itself (:func:`held_tensors`, not ``tensors()``) and the kind's
  formula (each layer's ``expected_nbytes``); a paged pool's figures agree with its tensors;
  every layer's shapes and a kind's own lengths agree with the positions it holds (a window
  layer its last ``W``; a state layer none, its bytes those of the empty cache).
* ``edges``: a chunk of ``W + 4`` tokens on a model with a window ``W``; on a cache a call leaves
  unchanged, two live branches of one prefix, before a window of 16 fills and after, both off the
  paged block size of 4 (copy-on-write of a shared, partly filled block).
* ``padded``: a left-padded batch, prefill and decode steps with the pad mask and per-row
  positions: every row equals its prompt run alone (a model with state layers, which would fold
  the pads in, must refuse the call and leave its cache).
* ``evicted``: a prefix cache's eviction judged by what is served after it. Two prompts that
  share a prefix go through a :class:`~kvdoc.serving.radix.RadixCache` over a pool too small for
  both (the paged kind, the model's own call), so serving the second evicts from the first (a
  whole leaf, or its tail blocks); then a prompt that follows the first into the middle of a
  block is served from what the tree kept, and its tokens and logits must equal one full
  forward, for matches of any length and of whole blocks. Bookkeeping that keeps the right
  counts but the wrong rows passes every decision and fails here; a hybrid model's saved
  states (:mod:`kvdoc.serving.snapshots`) may not outlive the rows before them.

>>> from kvdoc.proofs.suite import run_suite
>>> report = run_suite(models=("llama",), kinds=("paged",), impls=("model",),
...                    dtypes=(torch.float32,), scenarios=("evicted",))
>>> report.passed, [r.detail.split(":")[0] for r in report.results]
(True, ['evict=leaf, token matches', 'evict=block, token matches', 'evict=block, block matches'])
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kvdoc.core.cache import CacheLayer, KVCache, StaticCache
from kvdoc.core.feed import feed
from kvdoc.core.state import StateLayer, state_layers
from kvdoc.serving.batching import left_pad, padded_mask, padded_positions
from kvdoc.serving.paged import BlockPool, PagedCache, paged_cache
from kvdoc.serving.radix import RadixCache, serve_prompt
from kvdoc.serving.snapshots import takes_states

from .case import Case, scenario
from .compare import Snapshot, close, max_abs

BYTES_CHUNKS = (5, 1, 13)
"""Chunks of the ``bytes`` scenario: past the Mistral window (16) and several paged blocks (4)."""
BRANCH_PREFIXES = (9, 23)
"""Prefixes of the ``edges`` branches: before and after a window of 16 fills, neither a
multiple of the paged block size (4)."""


def _objects(obj: object, seen: set[int]) -> Iterator[object]:
    """``obj`` and everything reachable through its attributes, lists, tuples and dicts, walking
    into caches, cache layers and kvdoc's own objects (a pool, a wrapper's inner cache), not into
    a model or a library's objects."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, (list, tuple)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif hasattr(obj, "__dict__") and (isinstance(obj, (KVCache, CacheLayer))
                                       or type(obj).__module__.startswith("kvdoc")):
        children = list(vars(obj).values())
    else:
        children = []
    for child in children:
        yield from _objects(child, seen)


def held_tensors(cache: object) -> list[torch.Tensor]:
    """Every tensor the cache object holds, found in its attributes, a view of one found once.

    >>> from kvdoc import GPTConfig
    >>> len(held_tensors(StaticCache(GPTConfig(), batch_size=1, capacity=4)))  # K, V x 2 layers
    4
    """
    found = [t for t in _objects(cache, set()) if isinstance(t, torch.Tensor)]
    ids = {id(t) for t in found}
    return [t for t in found if t._base is None or id(t._base) not in ids]


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _pool_problems(pool: BlockPool, tables: list[list[int]]) -> list[str]:
    problems = []
    tensors = held_tensors(pool)  # found by walking the pool, not by its own list of stores
    block = pool.block_nbytes
    if pool.nbytes() != tensor_bytes(tensors) or block * pool.num_blocks != tensor_bytes(tensors):
        problems.append(f"pool reports {pool.nbytes()} bytes ({block} a block), "
                        f"its tensors hold {tensor_bytes(tensors)}")
    if pool.num_free + pool.num_used != pool.num_blocks:
        problems.append(f"{pool.num_free} free + {pool.num_used} used != {pool.num_blocks} blocks")
    held = {b for t in tables for b in t}
    if any(pool.refs(b) < 1 for b in held):
        problems.append("a block in a table is not held")
    return problems


def shape_problems(cache: KVCache) -> list[str]:
    """What disagrees between the cache's lengths and its tensors' shapes."""
    problems = []
    held, T = cache.held(), cache.seq_len
    if held.stop != T or held.start < 0:
        problems.append(f"held() is {held} for seq_len {T}")
    for i, layer in enumerate(cache.layers):
        w = layer.window  # a window layer holds the last W positions, every other all T
        if cache.held(i) != range(0 if w is None else max(0, T - w), T):
            problems.append(f"layer {i} (window {w}) holds {cache.held(i)} after {T}")
        rows = len(cache.held(i))
        # two tensors [B, heads, rows, width]: K and V, or a latent's c_KV and k_rope; a state
        # layer's [B, *shape], one size at every position
        wants = ([(cache.batch_size, *shape) for _, shape in layer.spec.shapes]
                 if isinstance(layer, StateLayer) else
                 [(cache.batch_size, layer.heads, rows, width) for width in layer.widths])
        for t, want in zip(cache.layer(i), wants, strict=True):
            if tuple(t.shape) != want or t.dtype != cache.dtype:
                problems.append(f"layer {i}: {tuple(t.shape)} {t.dtype}, want {want} {cache.dtype}")
                break
        if hasattr(layer, "shape_problems"):  # a layer composed of parts (an indexed one)
            problems += [f"layer {i}: {p}" for p in layer.shape_problems(T)]
    if isinstance(cache, StaticCache) and not T <= cache.capacity:
        problems.append(f"{T} positions in a capacity of {cache.capacity}")
    if isinstance(cache, PagedCache):
        blocks = math.ceil(T / cache.block_size)
        if any(len(t) != blocks for t in cache.tables):
            problems.append(f"tables of {[len(t) for t in cache.tables]} blocks for {T} positions")
        problems += _pool_problems(cache.pool, cache.tables)
    return problems


def byte_problems(cache: KVCache) -> list[str]:
    """What disagrees between the cache's byte figures, its tensors and its formula."""
    reported, found = cache.nbytes(), tensor_bytes(held_tensors(cache))
    problems = [] if reported == found else [f"nbytes() {reported}, its tensors hold {found}"]
    formula = cache.expected_nbytes()  # refuses a layer kind that states no formula
    if formula != reported:
        problems.append(f"nbytes() {reported}, the formula gives {formula}")
    return problems + shape_problems(cache)


def _state_bytes(cache: KVCache) -> list[int]:
    return [layer.nbytes() for layer in cache.layers if isinstance(layer, StateLayer)]


@scenario("bytes", {
    "bytes": "nbytes() and a pool's figures vs the tensors held and the formula; held rows "
             "and lengths vs the tensors' shapes; a recurrent state's bytes never grow"})
def _bytes(case: Case, out: list) -> None:
    cache, fed = case.new_cache(), sum(BYTES_CHUNKS)
    problems = byte_problems(cache)
    empty = _state_bytes(cache)  # a state layer's bytes: the same at every position

    def check(start: int, n: int, before: KVCache, after: KVCache) -> None:
        problems.extend(f"after {start + n}: {p}" for p in byte_problems(after))
        if _state_bytes(after) != empty:
            problems.append(f"after {start + n}: state layers hold {_state_bytes(after)} bytes, "
                            f"{empty} when empty")

    cache = feed(case.call, case.ids[:, :fed], cache, BYTES_CHUNKS, hook=check).cache
    detail = problems[0] if problems else (f"empty and after {len(BYTES_CHUNKS)} calls "
                                           f"({fed} positions): {cache.nbytes()} bytes")
    out.append(case.result("bytes", not problems, 0.0 if not problems else math.inf, detail))


# --- window and block edges -------------------------------------------------------------------

def _long_chunk(case: Case) -> tuple[bool, float, str]:
    W = case.model.config.sliding_window
    chunks = (3, W + 4, 1)
    ids = case.ids[:, :sum(chunks)]
    run = case.feed(ids, list(chunks))
    result = case.compared("edges", [(run.logits, case.full(ids))], "",
                           run.cache.seq_len == ids.shape[1])
    return result.passed, result.error, f"chunks {list(chunks)} past a window of {W}"


def _live_branches(case: Case, P: int) -> tuple[bool, float]:
    # two branches of one P-token prefix fed in turn (a chunk of 5 each, which copies a shared
    # block, then a step each, which reads it): both right, the prefix unchanged
    ids, alt = case.ids, case.alt
    prefix = case.feed(ids[:, :P], P).cache
    before = Snapshot.of(prefix)
    tails = (ids[:, P:P + 6], alt[:, P:P + 6])
    heads, logits = [prefix, prefix], [[], []]
    for start, stop in ((0, 5), (5, 6)):
        for b in (0, 1):
            got, heads[b] = case.call(tails[b][:, start:stop], heads[b])
            logits[b].append(got)
    pairs = [(torch.cat(logits[b], dim=1),
              case.full(torch.cat((ids[:, :P], tails[b]), dim=1))[:, P:]) for b in (0, 1)]
    changed = before.changed(prefix)
    result = case.compared("edges", pairs, "", changed == 0.0, changed)
    return result.passed, result.error


@scenario("edges", {
    "edges": "a chunk longer than the window; two live branches before and after the window "
             "fills, off the block size"})
def _edges(case: Case, out: list) -> None:
    ok, err, parts = True, 0.0, []
    W = getattr(case.model.config, "sliding_window", None)  # an MLA config has none
    if W is not None:
        passed, e, detail = _long_chunk(case)
        ok, err = ok and passed, max(err, e)
        parts.append(detail)
    if not case.cache.in_place:  # branches of a cache written in place cannot both live
        # before a window fills and, for a window cache, after; both off the paged block size
        windowed = not case.new_cache(1).keeps_every_position
        prefixes = BRANCH_PREFIXES if windowed else BRANCH_PREFIXES[:1]
        for P in prefixes:
            passed, e = _live_branches(case, P)
            ok, err = ok and passed, max(err, e)
        parts.append(f"two live branches of {' and '.join(map(str, prefixes))} tokens")
    if not parts:
        out.append(case.result("edges", None, 0.0, "no window, and a cache written in place"))
        return
    out.append(case.result("edges", ok, err, "; ".join(parts)))


# --- padded batches -------------------------------------------------------------------------

def _padding_refused(case: Case) -> object:
    """A model with state layers folds every row of a call into its state, pads included: a
    padded call (``attn_mask``, ``positions``) must be refused, its cache left as it was."""
    cache = case.feed(case.ids[:, :5], 5).cache
    before, refused = Snapshot.of(cache), False
    mask = torch.ones(cache.batch_size, 1, 6, dtype=torch.bool)
    try:
        case.call(case.ids[:, 5:6], cache, attn_mask=mask)
    except ValueError:
        refused = True
    changed = before.changed(cache) if cache.seq_len == 5 else math.inf
    return case.result("padded", refused and changed == 0.0, changed,
                       "state layers: a padded call refused, the cache unchanged")


PROMPTS = (7, 3, 5)  # the padded batch's prompt lengths, cycled over its rows
STEPS = 3  # decode steps after the padded prefill


def padded_run(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], bool]:
    """A left-padded batch of the case's rows through its cached call, prefill then
    :data:`STEPS` decode steps: each row's logits from its first real slot on, the row's own
    tokens (prompt and continuation), the prompt lengths, and whether the cache's length is
    the slots fed."""
    B = case.ids.shape[0]
    lengths = [PROMPTS[b % len(PROMPTS)] for b in range(B)]
    rows = [case.ids[b, :lengths[b] + STEPS] for b in range(B)]
    batch = left_pad([r[:n].tolist() for r, n in zip(rows, lengths, strict=True)])
    ids, pad = batch.ids.to(case.ids.device), batch.pad.to(case.ids.device)
    cache, start, got = case.new_cache(B), 0, []
    for s in range(STEPS + 1):
        step = ids if s == 0 else torch.stack([r[lengths[b] + s - 1] for b, r in enumerate(rows)])
        step = step.view(B, -1)
        C = step.shape[1]
        logits, cache = case.call(step, cache, positions=padded_positions(pad, start, C),
                                  attn_mask=padded_mask(pad, start, C))
        got.append(logits)
        start += C
    got_all = torch.cat(got, dim=1)  # [B, L + STEPS, V]: row b's real slots from pad[b] on
    return ([got_all[b:b + 1, int(pad[b]):] for b in range(B)], rows, lengths,
            cache.seq_len == ids.shape[1] + STEPS)


@scenario("padded", {
    "padded": "a left-padded batch, prefill and decode steps: each row vs its prompt alone"})
def _padded(case: Case, out: list) -> None:
    if case.ids.shape[0] < 2:
        out.append(case.result("padded", None, 0.0, "a padded batch needs 2 rows or more"))
        return
    if state_layers(case.new_cache(1)):
        out.append(_padding_refused(case))
        return
    got, rows, lengths, length_ok = padded_run(case)
    # each row against itself alone: its prompt and continuation, no padding
    pairs = [(g, case.full(r[None])) for g, r in zip(got, rows, strict=True)]
    out.append(case.compared("padded", pairs, f"prompts of {lengths} tokens, left-padded, then "
                             f"{STEPS} decode steps", length_ok))


# --- evictions -------------------------------------------------------------------------------

EVICT_BLOCK = 4
SHARED, OWN, NEW = 8, 10, 3
"""Tokens of the prefix both prompts share, of each prompt's own part, generated after each."""
DIVERGE = 6
"""Where the re-served prompt leaves the first one, within its own part: position 14, inside
the block of positions 12 to 15."""
BLOCKS = 7
"""The pool: the first request keeps 5 blocks, the second needs 4 more than the 2 it shares."""


EVICT_SETTINGS = (("leaf", "token"), ("block", "token"), ("block", "block"))
"""``(evict, granularity)`` the scenario runs: whole leaves or tail blocks evicted, matches
ending inside a block or at whole blocks only."""


def _reserved(case: Case, evict: str, granularity: str,
              tree_cls: type[RadixCache]) -> tuple[bool, float, str]:
    weight = case.model.wte.weight
    pool = BlockPool(case.model.config, BLOCKS, EVICT_BLOCK, weight.dtype, weight.device)
    # a hybrid model resumes only where a state was saved: at every block boundary here
    states = {"states": "every"} if takes_states(paged_cache(pool, 1)) else {}
    tree = tree_cls(pool, granularity, evict=evict, **states)
    row = case.ids[0].tolist()
    shared, first = row[:SHARED], row[SHARED:SHARED + OWN]
    other = case.alt[0, :OWN].tolist()
    serve_prompt(case.model, tree, shared + first, NEW)
    serve_prompt(case.model, tree, shared + other, NEW)  # makes room by evicting from the first
    if not tree.evicted_blocks:
        return False, float("inf"), f"evict={evict}: nothing was evicted, nothing checked"
    # from the blocks left: the first prompt up to a position inside a block, then other
    # tokens, so a token-granular match shares (and copies) a partly matched block
    again = serve_prompt(case.model, tree, shared + first[:DIVERGE] + other[DIVERGE:], NEW)
    tokens = torch.tensor([again.tokens], device=weight.device)
    full = case.full(tokens[:, :-1])[:, again.matched:]
    want = full.argmax(dim=-1)[0].tolist()
    picked = list(again.tokens[again.prompt_len:])
    # a pick is the full forward's argmax, or within the tolerance of it (a near tie)
    gap = full.max(dim=-1).values - full.gather(-1, tokens[:, again.matched + 1:, None])[..., 0]
    # a saved state is no use without the rows before it: eviction drops both
    orphans = [] if tree.states is None else [
        key for key in tree.states.saved if tree.match(key)[0] < len(key)]
    ok = (close(again.logits, full, case.tol) and again.matched > 0 and not orphans
          and (picked == want[-NEW:] or float(gap[0, -NEW:].max()) <= 2 * case.tol))
    return ok, max_abs(again.logits, full), (
        f"evict={evict}, {granularity} matches: {tree.evicted_blocks} blocks evicted, "
        f"{again.matched} positions re-served from the blocks left, {full.shape[1]} computed"
        + ("" if tree.states is None else f"; {len(tree.states.saved)} saved states, "
           f"{len(orphans)} without their rows"))


@scenario("evicted", {"evicted": "after evictions (whole leaves, tail blocks), a prompt "
                                 "re-served from the blocks left vs one full forward"})
def _evicted(case: Case, out: list) -> None:
    if case.kind != "paged" or case.impl != "model":
        out.append(case.result("evicted", None, 0.0, "the radix tree's pool: the paged kind, "
                               "the model's own call"))
        return
    tree_cls = case.caches.get("radix", RadixCache)  # a variant's tree
    for evict, granularity in EVICT_SETTINGS:
        ok, error, detail = _reserved(case, evict, granularity, tree_cls)
        out.append(case.result("evicted", ok, error, detail))
