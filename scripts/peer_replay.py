"""Replay kvdoc's prefix-cache workloads through SGLang's and vLLM's own code beside kvdoc's.

The peers' code comes from their releases (SGLang's wheel, vLLM's source distribution, unpacked
under ``.peer/`` by ``scripts/peer_check.py``, which ``make peer-check`` runs first); nothing of
it is copied into kvdoc. The modules in :data:`RUN_AS_RELEASED` run as released; every other
module of the package they import (memory pools, metrics, kernels, configs) is an empty
stand-in. What runs: SGLang 0.5.23's ``RadixCache`` (no pool, ``create_simulated``), and vLLM
0.33's V1 ``BlockPool`` with ``FullAttentionManager.find_longest_cache_hit`` over chained block
hashes, each driven as its scheduler drives it (:class:`SGLangTree`, :class:`VLLMPool`).
Memory is ample, so nothing is evicted: what is compared is what each one matches and holds.

Each request is served by kvdoc (:func:`kvdoc.serving.prefix_workload.run_workload`, whole
blocks, a small random model) and sent to the peer. The check: for every request of every
workload, seed and page size, kvdoc and the peer reuse the same number of prompt tokens, and
afterwards hold the same number. Exit status 1 if any differs.

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
    last token (``Req._compute_max_prefix_len``), page aligned; at finish an insert of the ids
    the request's K/V covers, page aligned. No pool (``create_simulated``)."""

    def __init__(self, page: int) -> None:
        from sglang.srt.mem_cache import base_prefix_cache, radix_cache
        self.params, self.radix = base_prefix_cache, radix_cache
        self.tree, self.page = radix_cache.RadixCache.create_simulated(page_size=page), page

    def _key(self, ids):
        return self.radix.RadixKey(token_ids=array("q", ids), extra_key=None)

    def serve(self, prompt, held) -> int:
        found = self.tree.match_prefix(self.params.MatchPrefixParams(key=self._key(prompt[:-1])))
        self.tree.insert(self.params.InsertParams(key=self._key(held).page_aligned(self.page)))
        return found.device_prefix_len

    def tokens_held(self) -> int:
        return self.tree.total_size()


class VLLMPool:
    """vLLM V1's ``BlockPool`` and ``FullAttentionManager.find_longest_cache_hit`` as its
    ``KVCacheManager`` drives them: chained block hashes (``hash_block_tokens``, SHA-256 of
    pickled keys), a hit of at most the prompt short of its last token, whole blocks; the
    request's full blocks cached, then freed (they stay cached in the free queue)."""

    def __init__(self, page: int, blocks: int = 4096) -> None:
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


def replay(peer: type, model: Decoder, turns, block_size: int, granularity: str) -> list[str]:
    """What differs between kvdoc's tree and ``peer``'s on ``turns`` (empty: nothing)."""
    run = run_workload(model, turns, num_blocks=4096, block_size=block_size,
                       granularity=granularity)
    theirs, wrong = peer(block_size), []
    for i, served in enumerate(run.served):
        prompt = served.tokens[:served.prompt_len]
        found = theirs.serve(prompt, served.tokens[:-1])  # the last token is never fed
        if found != served.matched:
            wrong.append(f"request {i}: kvdoc matched {served.matched} of {len(prompt)} "
                         f"tokens, {peer.__name__} {found}")
    held = run.tree.blocks_held() * block_size
    if theirs.tokens_held() != held:
        wrong.append(f"held afterwards: kvdoc {held} tokens, {peer.__name__} "
                     f"{theirs.tokens_held()}")
    return wrong


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
                 "repeated": lambda seed: few_shot_workload(seed) * 2}
    failed = 0
    for peer, tag in ((SGLangTree, SGLANG), (VLLMPool, VLLM)):
        runs = differ = 0
        for name, workload in workloads.items():
            for seed in range(3):
                for block_size in (1, 4):
                    wrong = replay(peer, model, workload(seed), block_size, args.granularity)
                    runs, differ = runs + 1, differ + bool(wrong)
                    for line in wrong:
                        print(f"DIFFERS {name} seed {seed} pages of {block_size}: {line}")
        print(f"{runs} workload runs through kvdoc's tree and {peer.__name__} ({tag}), kvdoc "
              f"matching by {args.granularity}: {differ} differ")
        failed += differ
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
