"""Replay kvdoc's prefix-cache workloads through SGLang's and vLLM's own code beside kvdoc's.

The peers' code comes from their releases (SGLang's wheel, vLLM's source distribution, unpacked
under ``.peer/`` by ``scripts/peer_check.py``, which ``make peer-check`` runs first); nothing of
it is copied into kvdoc. The modules in :data:`RUN_AS_RELEASED` run as released; every other
module of the package they import (memory pools, metrics, kernels, configs) is an empty
stand-in. What runs: SGLang 0.5.23's ``RadixCache`` (no pool, ``create_simulated``), and vLLM
0.33's V1 ``BlockPool`` with ``FullAttentionManager.find_longest_cache_hit`` over chained block
hashes, each driven as its scheduler drives it (:class:`SGLangTree`, :class:`VLLMPool`).
What is compared is what each one matches and holds: with ample memory, and with pools of 4
and 2 times the blocks the largest request writes and of one block more (:func:`pools`), where
kvdoc's tree evicts as the peer does: whole leaves, least recently used first, beside SGLang;
one block at a time, the block freed longest ago first and a request's last block before its
first, beside vLLM. Under eviction SGLang as released differs from kvdoc's tree by one rule
(the part of an edge a match splits off is marked used); :class:`SGLangSplitKeepsTime` undoes
it, and with it every run must agree.

Each request is served by kvdoc (:func:`kvdoc.serving.prefix_workload.run_workload`, whole
blocks, a small random model) and sent to the peer. The check: for every request of every
workload, seed and page size, kvdoc and the peer reuse the same number of prompt tokens, and
afterwards hold the same number. Exit status 1 if any differs (SGLang as released under
eviction aside: its differences are printed, and its hit rates in the closing table).

    .venv/bin/python scripts/peer_replay.py                      # the check
    .venv/bin/python scripts/peer_replay.py --granularity token  # kvdoc matching inside a
                                                                 # block: differs at pages of 4
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.abc
import importlib.machinery
import pickle
import sys
import types
from array import array
from pathlib import Path

import torch

from kvdoc import Decoder, GPTConfig
from kvdoc.measure.prefix_report import prefix_report, read_prompts
from kvdoc.serving.prefix_workload import chat_workload, few_shot_workload, run_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_check import PEERS, ROOT, fetch

SGLANG, VLLM = "v0.5.23", "v0.33.0"
# The modules run as released; every other module of the package is a stand-in.
RUN_AS_RELEASED = {
    "sglang": {"sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.radix_cache",
               "sglang.srt.mem_cache.base_prefix_cache", "sglang.srt.mem_cache.evict_policy",
               "sglang.srt.mem_cache.cache_init_params", "sglang.srt.mem_cache.utils",
               "sglang.srt.mem_cache.events"},
    "vllm": {"vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils",
             "vllm.v1.core.block_pool", "vllm.v1.core.single_type_kv_cache_manager",
             "vllm.v1.core.kv_cache_metrics", "vllm.v1.kv_cache_interface",
             "vllm.v1.kv_cache_spec_registry", "vllm.v1.kv_cache_layout", "vllm.utils",
             "vllm.utils.math_utils"},
}


class _Empty(type):
    """A stand-in class: any attribute of it is another stand-in class (an enum member, a
    constant), and it takes any arguments."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Empty(name, (), {"__init__": lambda self, *a, **k: None})


class _StandIn(types.ModuleType):
    """A module not run: each name imported from it is a stand-in class."""

    __path__: list[str] = []

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        stand_in = getattr(_Empty("module", (), {}), name)
        setattr(self, name, stand_in)
        return stand_in


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        real = RUN_AS_RELEASED.get(name.split(".")[0])
        if real is not None and name not in real:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        pass


class SGLangTree:
    """SGLang's ``RadixCache`` as its scheduler drives it: a match of the prompt short of its
    last token (``Req._compute_max_prefix_len``), page aligned; with a pool of ``blocks``
    pages, the matched path locked while ``evict`` frees the pages the request writes beyond
    the free ones; at finish an insert of the ids the request's K/V covers, page aligned. No
    pool (``create_simulated``, an allocator whose ``free_segment`` does nothing): the pool is
    the count of tokens the tree holds."""

    evict = "leaf"  # what kvdoc's tree is run with beside it
    split_keeps_time = False  # True: the one difference from kvdoc's tree undone (_call)

    def __init__(self, page: int, blocks: int | None = None) -> None:
        from sglang.srt.mem_cache import base_prefix_cache, radix_cache
        self.params, self.radix = base_prefix_cache, radix_cache
        allocator = types.SimpleNamespace(device="cpu", free_segment=lambda *args, **kwargs: None)
        self.tree = radix_cache.RadixCache.create_simulated(mock_allocator=allocator,
                                                            page_size=page)
        self.page, self.capacity = page, None if blocks is None else blocks * page

    def _key(self, ids):
        return self.radix.RadixKey(token_ids=array("q", ids), extra_key=None)

    def _nodes(self) -> dict:
        out, stack = {}, [self.tree.root_node]
        while stack:
            node = stack.pop()
            out[node] = (node.parent, node.last_access_time)
            stack.extend(node.children.values())
        return out

    def _call(self, method, params):
        """``method(params)``; with :attr:`split_keeps_time`, the part of an edge that a match
        or an insert splits off below the point it stops at keeps its time of last use, as in
        kvdoc's tree (SGLang 0.5.23 marks it used in ``_match_prefix_helper`` and
        ``_insert_helper`` before splitting, though the request does not read it)."""
        before = self._nodes() if self.split_keeps_time else {}
        result = method(params)
        for node, (parent, used) in before.items():
            if node.parent is not parent:  # split: its upper part is a new parent
                node.last_access_time = used
        return result

    def serve(self, prompt, held) -> int:
        found = self._call(self.tree.match_prefix,
                           self.params.MatchPrefixParams(key=self._key(prompt[:-1])))
        if self.capacity is not None:
            node, S = found.last_device_node, self.page
            need = -(-len(held) // S) * S - found.device_prefix_len
            self.tree.inc_lock_ref(node)
            short = self.tree.total_size() + need - self.capacity
            if short > 0:
                self.tree.evict(self.params.EvictParams(num_tokens=short))
            self.tree.dec_lock_ref(node)
        self._call(self.tree.insert,
                   self.params.InsertParams(key=self._key(held).page_aligned(self.page)))
        return found.device_prefix_len

    def tokens_held(self) -> int:
        return self.tree.total_size()


class SGLangSplitKeepsTime(SGLangTree):
    """:class:`SGLangTree` with the part of an edge that a match or insert splits off keeping
    its time of last use, as kvdoc's tree does."""

    split_keeps_time = True


class VLLMPool:
    """vLLM V1's ``BlockPool`` and ``FullAttentionManager.find_longest_cache_hit`` as its
    ``KVCacheManager`` drives them: chained block hashes (``hash_block_tokens``, SHA-256 of
    pickled keys), a hit of at most the prompt short of its last token, whole blocks; the
    request's full blocks cached, then freed (they stay cached in the free queue, which a new
    block is taken from: the front first, so the block freed longest ago is evicted, a request's
    last block before its first). ``blocks`` usable blocks (the pool's null block besides)."""

    evict = "block"

    def __init__(self, page: int, blocks: int | None = None) -> None:
        blocks = 4096 if blocks is None else blocks + 1  # block 0 is the pool's null block
        from vllm.v1 import kv_cache_interface
        from vllm.v1.core import block_pool, kv_cache_utils, single_type_kv_cache_manager
        self.utils, self.manager = kv_cache_utils, single_type_kv_cache_manager.FullAttentionManager
        kv_cache_utils.init_none_hash(self._sha256)
        self.pool = block_pool.BlockPool(num_gpu_blocks=blocks, enable_caching=True,
                                         hash_block_size=page)
        self.spec = kv_cache_interface.FullAttentionSpec(block_size=page, num_kv_heads=1,
                                                         head_size=1, dtype=torch.float32)
        self.page, self.requests = page, 0

    @staticmethod
    def _sha256(value) -> bytes:
        return hashlib.sha256(pickle.dumps(value)).digest()

    def _hashes(self, ids) -> list:
        out, parent, S = [], None, self.page
        for i in range(len(ids) // S):
            parent = self.utils.hash_block_tokens(self._sha256, parent, ids[i * S:(i + 1) * S])
            out.append(parent)
        return out

    def serve(self, prompt, held) -> int:
        S = self.page
        found, hit = self.manager.find_longest_cache_hit(self._hashes(prompt), len(prompt) - 1,
                                                         [0], self.pool, self.spec, False, S)
        cached = found[0]
        self.pool.touch(cached)
        blocks = list(cached) + self.pool.get_new_blocks(-(-len(held) // S) - len(cached))
        self.requests += 1
        request = types.SimpleNamespace(request_id=str(self.requests),
                                        block_hashes=self._hashes(held))
        self.pool.cache_full_blocks(request, blocks, len(cached), len(held) // S, S, 0)
        self.pool.free_blocks(reversed(blocks))  # as a finished request frees: tail first
        return hit

    def tokens_held(self) -> int:
        return len(self.pool.cached_block_hash_to_block) * self.page


def load(package: str, tag: str, offline: bool) -> None:
    """Put the unpacked release of ``package`` on the path, behind its stand-ins."""
    peer = next(p for p in PEERS if p.package == package)
    sys.path.insert(0, str(fetch(peer, tag, ROOT / ".peer", offline)))
    if not any(isinstance(f, _StandIns) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandIns())


def replay(peer: type, model: Decoder, turns, block_size: int, granularity: str,
           blocks: int | None = None) -> tuple[list[str], float]:
    """What differs between kvdoc's tree and ``peer``'s on ``turns`` (empty: nothing), and the
    peer's hit rate (prompt tokens reused). With ``blocks``, both have that many blocks and
    kvdoc's tree evicts as the peer does (``peer.evict``); without, memory is ample."""
    run = run_workload(model, turns, num_blocks=blocks or 4096, block_size=block_size,
                       granularity=granularity, evict=peer.evict)
    theirs, wrong, reused = peer(block_size, blocks), [], 0
    for i, served in enumerate(run.served):
        prompt = served.tokens[:served.prompt_len]
        found = theirs.serve(prompt, served.tokens[:-1])  # the last token is never fed
        reused += found
        if found != served.matched:
            wrong.append(f"request {i}: kvdoc matched {served.matched} of {len(prompt)} "
                         f"tokens, {peer.__name__} {found}")
    held = run.tree.blocks_held() * block_size
    if theirs.tokens_held() != held:
        wrong.append(f"held afterwards: kvdoc {held} tokens, {peer.__name__} "
                     f"{theirs.tokens_held()}")
    return wrong, reused / run.prompt_tokens


def report_check(sizes: tuple[int, ...] = (1, 4, 16)) -> tuple[list[str], int]:
    """``python -m kvdoc prefix-report`` on the site's chat sample beside the peers: per request,
    its vLLM hit against vLLM's pool with blocks of each size, its SGLang hit against SGLang's
    tree with pages of each size (ample memory; each prompt held whole once served, as the
    report assumes). What differs, and how many hits were compared."""
    prompts = read_prompts(ROOT / "docs" / "_static" / "chat-prompts.txt")
    wrong, compared = [], 0
    for size in sizes:
        report = prefix_report(prompts, block_size=size, page_size=size)
        for rule, peer in (("vLLM", VLLMPool(size)), ("SGLang", SGLangTree(size))):
            for i, (prompt, request) in enumerate(zip(prompts, report.requests, strict=True)):
                found, compared = peer.serve(prompt, prompt), compared + 1
                if found != request.hits[rule]:
                    wrong.append(f"prefix-report, {rule} unit {size}, request {i}: kvdoc "
                                 f"{request.hits[rule]}, {type(peer).__name__} {found}")
    return wrong, compared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--granularity", choices=("block", "token"), default="block",
                        help="kvdoc's match granularity (default block, as the peers' pages)")
    parser.add_argument("--offline", action="store_true", help="use only what .peer/ holds")
    args = parser.parse_args(argv)
    load("sglang", SGLANG, args.offline)
    load("vllm", VLLM, args.offline)
    torch.manual_seed(0)
    model = Decoder(GPTConfig()).eval()
    workloads = {"few-shot": few_shot_workload, "chat": chat_workload,
                 # each prompt again, now held whole (some end on a page boundary)
                 "repeated": lambda seed: few_shot_workload(seed) * 2,
                 # enough requests, tasks and conversations that a small pool must choose
                 "few-shot, 4 tasks": lambda seed: few_shot_workload(seed, 24, tasks=4),
                 "chat, 4 conversations": lambda seed: chat_workload(seed, 4, 4)}
    wrong, compared = report_check()
    print(f"prefix-report on docs/_static/chat-prompts.txt: {compared} per-request hits "
          f"against SGLang's tree and vLLM's pool, {len(wrong)} differ")
    for line in wrong[:5]:
        print("DIFFERS:", line)
    failed, rates = len(wrong), {}
    for peer, tag in ((SGLangTree, SGLANG), (SGLangSplitKeepsTime, SGLANG), (VLLMPool, VLLM)):
        runs, differ = {"ample": 0, "small": 0}, {"ample": 0, "small": 0}
        for name, workload in workloads.items():
            for seed in range(3):
                for block_size in (1, 4):
                    turns = workload(seed)
                    for pool, blocks in pools(model, turns, block_size):
                        wrong, rate = replay(peer, model, turns, block_size, args.granularity,
                                             blocks)
                        rates.setdefault((name, block_size, pool), {}).setdefault(
                            peer.__name__, []).append(rate)
                        memory = "ample" if blocks is None else "small"
                        runs[memory] += 1
                        differ[memory] += bool(wrong)
                        for line in wrong[:1]:
                            print(f"DIFFERS from {peer.__name__}: {name} seed {seed} pages of "
                                  f"{block_size}, {blocks or 'ample'} blocks: {line}")
        for memory in ("ample", "small"):
            print(f"{runs[memory]} workload runs with {memory} memory through kvdoc's tree "
                  f"(matching by {args.granularity}, evicting by {peer.evict}) and "
                  f"{peer.__name__} ({tag}): {differ[memory]} differ")
        # SGLang as released differs from kvdoc's tree under eviction by one rule, which
        # SGLangSplitKeepsTime undoes: there every run must agree
        if peer is not SGLangTree:
            failed += differ["small"]
        failed += differ["ample"]
    print("\nMean hit rate over 3 seeds (prompt tokens reused). Whole leaves: kvdoc's tree, which "
          "SGLangSplitKeepsTime equals, and SGLang as released; single blocks: kvdoc's tree, "
          "which vLLM equals.")
    print("| workload | page | pool | whole leaves, kvdoc | SGLang as released | single blocks, "
          "kvdoc = vLLM |\n|---|---|---|---|---|---|")
    for (name, page, pool), by_peer in rates.items():
        cells = [sum(r) / len(r) for r in (by_peer[c.__name__] for c in
                                            (SGLangSplitKeepsTime, SGLangTree, VLLMPool))]
        print(f"| {name} | {page} | {pool} | " + " | ".join(f"{c:.1%}" for c in cells) + " |")
    return 1 if failed else 0


def pools(model: Decoder, turns, block_size: int) -> list[tuple[str, int | None]]:
    """Ample memory, then pools of 4 and 2 times the blocks the largest request writes, and of
    one block more than that (each smaller than what the workload leaves behind)."""
    ample = run_workload(model, turns, num_blocks=4096, block_size=block_size)
    largest = max(-(-(len(s.tokens) - 1) // block_size) for s in ample.served)
    sizes = {"4 x largest": 4 * largest, "2 x largest": 2 * largest, "largest + 1": largest + 1}
    return [("ample", None)] + [(k, n) for k, n in sizes.items()
                                if n < ample.tree.blocks_held()]


if __name__ == "__main__":
    sys.exit(main())
