"""``python -m kvdoc prefix-report``: the prefix-cache hit rate of a file of prompts, by vLLM's
rule and by SGLang's, and why each request missed what it missed.

Both count prompt tokens found in the cache over prompt tokens; each request here is matched
against every prompt before it on its replica (ample memory, each request finished before the
next): its longest shared prefix, short of its last token, which both compute again; vLLM
rounds it down to whole blocks (``block_size``), SGLang matches token by token (``page_size``
1). Each request's reason names the cached request ``#k`` it matched: ``extends #k`` (a new
turn), ``repeats #k``, ``inside #k``, ``parts from #k at t`` (the latest prompt that went
further, and the token where the two part), or ``nothing cached``. A hybrid model, whose
recurrent states resume only from a saved snapshot, has its own: :func:`state_prefix_report`.

>>> a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]
>>> report = prefix_report([a, b, b], block_size=4)
>>> [(r.hits["vLLM"], r.hits["SGLang"], r.reason) for r in report.requests]
[(0, 0, 'nothing cached'), (4, 5, 'parts from #0 at 5'), (4, 5, 'repeats #1')]
>>> f"{report.hit_rate('vLLM'):.0%} {report.hit_rate('SGLang'):.0%}"
'44% 56%'
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .kv_bytes import check_int
from .layer_caches import LayerCache
from .tables import markdown_table

VLLM_BLOCK = 16
"""vLLM 0.33's default block size (``CacheConfig.DEFAULT_BLOCK_SIZE``)."""
BALANCE = 2
"""Prefix-aware routing keeps the load even: no replica more than this many requests ahead."""


class Prefixes:
    """Every prefix of the prompts added, as a trie in one dict: (parent, token) -> node; for
    each node, the last prompt added through it, and the last that ended there."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[int, int], int] = {}
        self.through: dict[int, int] = {0: -1}  # the root: no prompt
        self.ends: dict[int, int] = {}

    def add(self, tokens: Sequence[int], name: int) -> None:
        node = 0
        for t in tokens:
            node = self.nodes.setdefault((node, t), len(self.nodes) + 1)
            self.through[node] = name
        self.ends[node] = name

    def path(self, tokens: Sequence[int]) -> list[int]:
        """The nodes along ``tokens`` as far as they were added: ``path[i]`` holds ``i + 1``."""
        node, path = 0, []
        for t in tokens:
            node = self.nodes.get((node, t))
            if node is None:
                break
            path.append(node)
        return path

    def longest(self, tokens: Sequence[int]) -> tuple[int, int]:
        """Length of the longest prefix of ``tokens`` that was added, and its node."""
        path = self.path(tokens)
        return len(path), path[-1] if path else 0


@dataclass(frozen=True)
class Request:
    """One prompt: its replica, length, shared prefix, hits by rule, why it missed."""

    replica: int
    tokens: int
    shared: int  # the longest prefix shared with a prompt cached on its replica
    hits: dict[str, int]
    reason: str


@dataclass(frozen=True)
class Report:
    requests: list[Request]
    units: dict[str, int]  # rule -> the tokens its cache matches in whole (block or page)

    def hit_rate(self, rule: str) -> float:
        """Hit tokens over prompt tokens, as the rule's server counts them."""
        return sum(r.hits[rule] for r in self.requests) / sum(r.tokens for r in self.requests)

    def summary(self) -> str:
        """A table, a column per rule: hit rate, tokens found, missed tokens by reason."""
        found = {rule: sum(r.hits[rule] for r in self.requests) for rule in self.units}
        used = sum(min(r.shared, r.tokens - 1) for r in self.requests)  # all a rule could find
        after = sum(r.tokens - r.shared for r in self.requests if r.shared < r.tokens)
        last = sum(r.shared == r.tokens for r in self.requests)
        total = sum(r.tokens for r in self.requests)
        rows = [["hit rate", *(f"{self.hit_rate(rule):.1%}" for rule in self.units)],
                ["tokens found", *(f"{n} of {total}" for n in found.values())],
                ["missed: after a difference", *[after] * len(found)],
                ["missed: last token", *[last] * len(found)],
                ["missed: partial block", *(used - n for n in found.values())]]
        return markdown_table(["", *(f"{rule} ({'block' if rule == 'vLLM' else 'page'} {unit})"
                                     for rule, unit in self.units.items())], rows)

    def table(self) -> str:
        """A table, a row per request."""
        replicas = max(r.replica for r in self.requests) > 0  # a column only if several
        rows = [[i, *[r.replica][:replicas], r.tokens, *r.hits.values(), r.reason]
                for i, r in enumerate(self.requests)]
        return markdown_table(["#", *["replica"][:replicas], "tokens", *self.units,
                               "why the rest missed"], rows)


def prefix_report(prompts: Sequence[Sequence[int]], block_size: int = VLLM_BLOCK,
                  page_size: int = 1, replicas: int = 1, route: str = "round-robin") -> Report:
    """Match each prompt against those before it on its replica; ``route``: ``"round-robin"``,
    or ``"prefix"``: to the replica sharing the longest prefix (ties to the least used) among
    those that have served at most :data:`BALANCE` requests more than the least used."""
    if min(block_size, page_size, replicas) < 1 or route not in ("round-robin", "prefix"):
        raise ValueError(f"need block_size, page_size, replicas >= 1 and route 'round-robin' or "
                         f"'prefix'; got {block_size}, {page_size}, {replicas}, {route!r}")
    if not prompts or not all(prompts):
        raise ValueError("need at least one prompt, and no empty prompt")
    units = {"vLLM": block_size, "SGLang": page_size}
    caches, used, out = [Prefixes() for _ in range(replicas)], [0] * replicas, []
    for i, prompt in enumerate(prompts):
        if route == "prefix":  # among replicas at most BALANCE requests busier than the least
            ready = [k for k in range(replicas) if used[k] <= min(used) + BALANCE]
            at = max(ready, key=lambda k: (caches[k].longest(prompt)[0], -used[k], -k))
        else:
            at = i % replicas
        (shared, node), n, cache = caches[at].longest(prompt), len(prompt), caches[at]
        hits = {rule: min(shared, n - 1) // unit * unit for rule, unit in units.items()}
        if not used[at]:
            reason = "nothing cached"
        elif shared == 0:
            reason = "differs at token 0"
        elif shared == n:  # a retry, or a prompt inside a longer one
            reason = (f"repeats #{cache.ends[node]}" if node in cache.ends
                      else f"inside #{cache.through[node]}")
        elif cache.ends.get(node, -1) == cache.through[node]:  # a new turn after a whole prompt
            reason = f"extends #{cache.ends[node]}"
        else:  # the last prompt through here went on, differently: what in it differs?
            source = cache.through[node]
            reason = f"parts from #{source} at {shared}"
        if 0 < shared and hits["vLLM"] == 0:
            reason += ", under a block"
        caches[at].add(prompt, i)
        used[at] += 1
        out.append(Request(at, n, shared, hits, reason))
    return Report(out, units)


def read_prompts(path: str | Path, tokenizer: str | None = None) -> list[list[int]]:
    """The prompts of a file, one a line (blank lines and lines starting ``#`` skipped): token
    ids separated by spaces, or with ``tokenizer`` (a folder or name transformers finds on this
    machine, never downloaded) a JSON string or a JSON list of chat messages, tokenized with
    its chat template."""
    lines = [(k, line) for k, line in enumerate(Path(path).read_text().splitlines(), 1)
             if line.strip() and not line.startswith("#")]
    if tokenizer is None:
        try:
            return [[int(t) for t in line.split()] for _, line in lines]
        except ValueError:
            bad = next(k for k, line in lines if not all(t.isdigit() for t in line.split()))
            raise ValueError(f"{path}:{bad}: expected token ids separated by spaces (text "
                             "needs --tokenizer)") from None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    out = []
    for k, line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{k}: expected a JSON string or list ({err})") from None
        if isinstance(item, str):
            out.append(tok.encode(item, add_special_tokens=False))
        else:  # as a chat server renders messages: the template, then the assistant's turn
            out.append(list(tok.apply_chat_template(item, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m kvdoc prefix-report``."""
    parser.add_argument("file", help="prompts, one a line: token ids separated by spaces "
                                     "(or JSON text or chat messages, with --tokenizer)")
    parser.add_argument("--block-size", type=int, default=VLLM_BLOCK, metavar="N",
                        help=f"vLLM's block size (default {VLLM_BLOCK})")
    parser.add_argument("--page-size", type=int, default=1, metavar="N",
                        help="SGLang's page size (default 1: token by token)")
    parser.add_argument("--replicas", type=int, default=1, metavar="N",
                        help="servers, each with its own cache (default 1)")
    parser.add_argument("--route", default="round-robin", metavar="HOW",
                        help="round-robin (default) or prefix: to the replica sharing the "
                             f"longest prefix, none more than {BALANCE} requests ahead")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a tokenizer transformers finds locally; lines are then JSON")
    parser.add_argument("--summary", action="store_true", help="only the hit rates")


def main(args: argparse.Namespace) -> int:
    """Print the report; 2 (nothing on stdout) on a bad file or option."""
    try:
        report = prefix_report(read_prompts(args.file, args.tokenizer), args.block_size,
                               args.page_size, args.replicas, args.route)
    except (ImportError, OSError, ValueError) as err:  # no transformers, no file, bad text
        print(f"python -m kvdoc prefix-report: error: {err}", file=sys.stderr)
        return 2
    print(report.summary() if args.summary else f"{report.table()}\n\n{report.summary()}")
    return 0


# --- a hybrid model: its recurrent states resume only from a saved snapshot ---------------

KERNEL_ALIGNMENT = 16
"""Tokens an attention block is a multiple of in :func:`vllm_hybrid_block` (FlashAttention's
``MultipleOf(16)`` and vLLM's default block size)."""


@dataclass(frozen=True)
class StateReport:
    """Per request: prompt length, K/V-alone hit, hybrid hit; after the last request, the
    ``snapshots`` saved and ``cached_tokens``, the distinct prefix positions held."""

    tokens: list[int]
    kv_hits: list[int]
    hits: list[int]
    snapshots: int
    cached_tokens: int

    def hit_rate(self) -> float:
        """Hybrid hit tokens over prompt tokens."""
        return sum(self.hits) / sum(self.tokens)

    def kv_hit_rate(self) -> float:
        """Hit tokens over prompt tokens if every layer kept K/V rows."""
        return sum(self.kv_hits) / sum(self.tokens)


def state_prefix_report(prompts: Sequence[Sequence[int]], where: str = "last",
                        block: int = 16, branch: bool = False) -> StateReport:
    """The hit rates of a hybrid model, whose recurrent layers (Gated DeltaNet, Mamba-2) resume
    only where an earlier prefill saved their state, a *snapshot*: its hit is the deepest one
    inside the shared prefix (short of the last token). Each prompt is matched against all
    before it, as :func:`prefix_report` does, and saves snapshots past its own hit by the rules
    the server runs (:class:`~kvdoc.serving.snapshots.SnapshotStore`: ``where`` and ``block``;
    ``branch``, also where its K/V match ends).

    >>> system, a, b = list(range(40)), [50] * 30, [60] * 30
    >>> prompts = [system + a, system + b, system + [70] * 30]
    >>> [state_prefix_report(prompts, where, 16).hits for where in ("every", "last", "end")]
    [[0, 32, 32], [0, 0, 0], [0, 0, 0]]
    >>> state_prefix_report(prompts, "last", 16, branch=True).hits   # #1 saves 32 for #2
    [0, 0, 32]
    >>> state_prefix_report(prompts, "last", 16).kv_hits             # K/V alone, token by token
    [0, 40, 40]
    """
    from kvdoc.serving.snapshots import SnapshotStore  # imports torch: not when the command starts

    rule = SnapshotStore(where, check_int("block", block), branch)  # refuses an unknown where
    if not prompts or not all(prompts):
        raise ValueError("need at least one prompt, and no empty prompt")
    trie, saved = Prefixes(), set()  # saved: trie nodes (positions) holding a snapshot
    tokens, kv_hits, hits = [], [], []
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        path = trie.path(prompt)[: n - 1]  # the last token is always computed
        hit = max((d + 1 for d, node in enumerate(path) if node in saved), default=0)
        tokens.append(n)
        kv_hits.append(len(path))
        hits.append(hit)
        trie.add(prompt, i)
        here = trie.path(prompt)
        saved.update(here[p - 1] for p in rule.points(n, hit, len(path)) if p > 0)
    return StateReport(tokens, kv_hits, hits, len(saved), len(trie.nodes))


def vllm_state_bytes(layer: LayerCache, conv_kernel: int, element_bytes: int = 2) -> int:
    """One recurrent layer's state as vLLM 0.33 allocates it, from the memory command's
    :class:`~kvdoc.measure.layer_caches.LayerCache` (which counts transformers' layout: a conv
    window of ``conv_kernel`` taps, the state in FP32): a window of ``conv_kernel - 1`` taps and
    the state, both of ``element_bytes`` (the model's dtype: its ``mamba_cache_dtype`` and
    ``mamba_ssm_cache_dtype`` default to ``"auto"``).

    >>> from kvdoc.measure.layer_caches import gated_delta_layer
    >>> vllm_state_bytes(gated_delta_layer(16, 32, 128, 128, 4), 4)   # Qwen3-Next, BF16
    1097728
    """
    check_int("conv_kernel", conv_kernel, minimum=2)
    if layer.per_token or not layer.state32 or layer.state % conv_kernel:
        raise ValueError(f"need a recurrent layer whose conv state has {conv_kernel} taps, "
                         f"got {layer}")
    return element_bytes * (layer.state // conv_kernel * (conv_kernel - 1) + layer.state32)


def vllm_hybrid_block(state_bytes: int, kv_bytes_per_token: int,
                      alignment: int = KERNEL_ALIGNMENT) -> int:
    """The block size vLLM 0.33 gives a hybrid model: the smallest multiple of ``alignment``
    whose K/V page (``block x kv_bytes_per_token``, one attention layer) holds one recurrent
    layer's state (``state_bytes``), so that both kinds of page have one size. In
    ``mamba_cache_mode="align"`` the snapshots are taken at multiples of it.

    >>> # Qwen3-Next-80B-A3B in BF16: its state beside 2 x 2 x 256 K/V elements a token
    >>> vllm_hybrid_block(1097728, 2 * 2 * 256 * 2)
    544
    """
    check_int("state_bytes", state_bytes)
    check_int("kv_bytes_per_token", kv_bytes_per_token)
    check_int("alignment", alignment)
    return alignment * -(-state_bytes // (alignment * kv_bytes_per_token))
