"""Replay kvdoc's prefix-cache workloads through SGLang's own ``RadixCache`` beside kvdoc's.

SGLang's radix tree is taken from its released wheel (unpacked under ``.peer/`` by
``scripts/peer_check.py``, which ``make peer-check`` runs first); nothing of it is copied into
kvdoc. Only ``radix_cache`` and the modules it is built from run as released; every other
``sglang`` module it imports (memory pools, metrics, kernels) is an empty stand-in, and its
memory pool is :meth:`RadixCache.create_simulated`'s: no pool at all. Memory is ample, so
neither tree evicts: what is compared is what each tree matches and holds.

Each request is served by kvdoc (:func:`kvdoc.serving.prefix_workload.run_workload`, whole
blocks, a small random model). The same request goes to SGLang's tree as its scheduler sends
it: a match of the prompt short of its last token (``Req._compute_max_prefix_len``), page
aligned, then, when the request finishes, an insert of the ids the request's K/V covers (the
prompt and every generated token but the last), page aligned. The check: for every request of
every workload, seed and page size, the two trees match the same number of tokens, and
afterwards hold the same number. Exit status 1 if any differs.

    .venv/bin/python scripts/peer_replay.py                 # the check
    .venv/bin/python scripts/peer_replay.py --granularity token   # kvdoc matching inside a
                                                            # block: differs at pages of 4
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import sys
import types
from array import array
from pathlib import Path

import torch

from kvdoc import Decoder, GPTConfig
from kvdoc.serving.prefix_workload import chat_workload, few_shot_workload, run_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_check import PEERS, ROOT, fetch

SGLANG_TAG = "v0.5.23"
RUN_AS_RELEASED = {"sglang", "sglang.srt", "sglang.srt.mem_cache",
                   "sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.base_prefix_cache",
                   "sglang.srt.mem_cache.evict_policy", "sglang.srt.mem_cache.cache_init_params",
                   "sglang.srt.mem_cache.utils", "sglang.srt.mem_cache.events"}


class _StandIn(types.ModuleType):
    """An ``sglang`` module not run: each name imported from it is an empty class."""

    __path__: list[str] = []

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        stand_in = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, stand_in)
        return stand_in


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "sglang" and name not in RUN_AS_RELEASED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        pass


def load_sglang(tree: Path) -> types.ModuleType:
    """SGLang's ``radix_cache`` module, from the unpacked wheel at ``tree``."""
    sys.path.insert(0, str(tree))
    sys.meta_path.insert(0, _StandIns())
    import sglang.srt.mem_cache.radix_cache as radix_cache
    return radix_cache


def replay(sgl: types.ModuleType, model: Decoder, turns, block_size: int,
           granularity: str) -> list[str]:
    """What differs between kvdoc's tree and SGLang's on ``turns`` (empty: nothing)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    def key(ids):
        return sgl.RadixKey(token_ids=array("q", ids), extra_key=None)

    run = run_workload(model, turns, num_blocks=4096, block_size=block_size,
                       granularity=granularity)
    theirs = sgl.RadixCache.create_simulated(page_size=block_size)
    wrong = []
    for i, served in enumerate(run.served):
        prompt = served.tokens[:served.prompt_len]
        found = theirs.match_prefix(MatchPrefixParams(key=key(prompt[:-1]))).device_prefix_len
        if found != served.matched:
            wrong.append(f"request {i}: kvdoc matched {served.matched} of {len(prompt)} "
                         f"tokens, SGLang {found}")
        theirs.insert(InsertParams(key=key(served.tokens[:-1]).page_aligned(block_size)))
    held = run.tree.blocks_held() * block_size
    if theirs.total_size() != held:
        wrong.append(f"held afterwards: kvdoc {held} tokens, SGLang {theirs.total_size()}")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--granularity", choices=("block", "token"), default="block",
                        help="kvdoc's match granularity (default block, as SGLang's pages)")
    parser.add_argument("--offline", action="store_true", help="use only what .peer/ holds")
    args = parser.parse_args(argv)
    peer = next(p for p in PEERS if p.package == "sglang")
    sgl = load_sglang(fetch(peer, SGLANG_TAG, ROOT / ".peer", args.offline))
    torch.manual_seed(0)
    model = Decoder(GPTConfig()).eval()
    workloads = {"few-shot": few_shot_workload, "chat": chat_workload,
                 # each prompt again, now held whole (some end on a page boundary)
                 "repeated": lambda seed: few_shot_workload(seed) * 2}
    runs = failed = 0
    for name, workload in workloads.items():
        for seed in range(3):
            for block_size in (1, 4):
                turns = workload(seed)
                wrong = replay(sgl, model, turns, block_size, args.granularity)
                runs, failed = runs + 1, failed + bool(wrong)
                for line in wrong:
                    print(f"DIFFERS {name} seed {seed} pages of {block_size}: {line}")
    print(f"{runs} workload runs through kvdoc's and SGLang {SGLANG_TAG}'s radix trees "
          f"(kvdoc matching by {args.granularity}): {failed} differ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
