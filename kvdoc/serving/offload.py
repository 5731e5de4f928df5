"""Offloaded blocks: a small "device" pool of K/V blocks backed by a host tier and a disk tier.

A full block is named by a *chained* hash of the previous block's key and its own token ids
(:func:`hash_block`), so a key names the whole prefix, as vLLM V1 keys its prefix cache
(``hash_block_tokens``, v0.33.0): K/V depend on every earlier token. :class:`TieredStore`
keeps blocks (``[L, 1, H_kv, block_size, D_k + D_v]``) on the "device", least recently used
evicted to the host, then to the disk; a hit moves the block back to the device. :func:`serve`
reloads the leading full prompt blocks found (never the last prompt position), prefills the
rest, and stores every full block after decoding; a cache holding more than K/V rows (a
recurrent state) is refused.

>>> import tempfile
>>> from kvdoc.core.model import Decoder, GPTConfig, generate
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> turn = torch.arange(1, 10)
>>> with tempfile.TemporaryDirectory() as folder:
...     store = TieredStore(device_blocks=1, host_blocks=1, folder=folder)
...     runs = serve(model, [turn, torch.cat((turn, torch.tensor([3, 4])))], 3, store, 4)
>>> [r.tiers for r in runs]          # the second turn reloads both blocks of the first
[('computed', 'computed'), ('host', 'host')]
>>> torch.equal(runs[1].tokens, generate(model, runs[1].prompt[None], 3)[0])
True
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvdoc.core.cache import DynamicCache, check_int
from kvdoc.core.model import Decoder, decode_step, generate, prefill
from kvdoc.serving.requests import greedy

ROOT = hashlib.sha256(b"kvdoc-offload-root").digest()
"""The parent key of a sequence's first block (vLLM's ``NONE_HASH``)."""

TIERS = ("device", "host", "disk")
"""Where a block can be found, fastest first."""

HashFn = Callable[[bytes | None, Sequence[int]], bytes]


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """SHA-256 of the parent key (:data:`ROOT` for the first block) and the block's token ids.

    >>> a, b = hash_block(None, [1, 2]), hash_block(hash_block(None, [9, 9]), [1, 2])
    >>> a == b, a == hash_block(None, [1, 2])      # same tokens, different prefix
    (False, True)
    """
    digest = hashlib.sha256(parent if parent is not None else ROOT)
    digest.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
    return digest.digest()


def block_hashes(tokens: Sequence[int], block_size: int,
                 hash_fn: HashFn = hash_block) -> list[bytes]:
    """The chained keys of every full block of ``tokens`` (a partial last block has none).

    >>> len(block_hashes(list(range(10)), 4))
    2
    """
    check_int("block_size", block_size)
    keys, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_fn(parent, list(tokens[start:start + block_size]))
        keys.append(parent)
    return keys


class TieredStore:
    """Blocks by key on the device, the host and a disk folder; lookups counted per tier."""

    def __init__(self, device_blocks: int, host_blocks: int, folder: str) -> None:
        self.device_blocks = check_int("device_blocks", device_blocks)
        self.host_blocks = check_int("host_blocks", host_blocks)
        if not os.path.isdir(folder):
            raise ValueError(f"disk tier folder {folder!r} does not exist")
        self.folder = folder
        self.device: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.host: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits: Counter[str] = Counter()
        self.misses = 0
        self.disk_writes = 0

    def path(self, key: bytes) -> str:
        """The disk tier's file for ``key``."""
        return os.path.join(self.folder, key.hex() + ".pt")

    def tier(self, key: bytes) -> str | None:
        """Where ``key``'s block is now (fastest tier first), or ``None``."""
        if key in self.device:
            return "device"
        if key in self.host:
            return "host"
        return "disk" if os.path.exists(self.path(key)) else None

    def lookup(self, key: bytes) -> tuple[torch.Tensor, str] | None:
        """``(block, tier it was found in)``, the block now on the device; ``None`` if absent."""
        tier = self.tier(key)
        if tier is None:
            self.misses += 1
            return None
        self.hits[tier] += 1
        if tier == "device":
            self.device.move_to_end(key)
            return self.device[key], tier
        if tier == "host":
            block = self.host.pop(key)
        else:  # weights_only: a block file holds one tensor, nothing to execute
            block = torch.load(self.path(key), weights_only=True)
        self.put(key, block)
        return block, tier

    def put(self, key: bytes, block: torch.Tensor) -> None:
        """Store ``block`` on the device (most recently used), evicting down the tiers."""
        self.device[key] = block
        self.device.move_to_end(key)
        while len(self.device) > self.device_blocks:
            old, evicted = self.device.popitem(last=False)
            self.host[old] = evicted
        while len(self.host) > self.host_blocks:
            old, evicted = self.host.popitem(last=False)
            if not os.path.exists(self.path(old)):
                torch.save(evicted.clone(), self.path(old))
                self.disk_writes += 1


class Served(NamedTuple):
    """A request run by :func:`serve`: ``prompt``, ``tokens`` (prompt and greedy tokens), the
    first token's logits, and per full prompt block the tier it came from, or ``"computed"``."""

    prompt: torch.Tensor
    tokens: torch.Tensor
    first_logits: torch.Tensor
    tiers: tuple[str, ...]


ROW_LAYERS = ("DynamicLayer", "WindowLayer")
"""The layers of ``model.new_cache`` a block of K/V rows restores (every other kind is refused)."""


def _blocks_to_cache(blocks: list[torch.Tensor], model: Decoder) -> DynamicCache:
    if not blocks:
        weight = model.wte.weight
        return DynamicCache.empty(model.config, 1, weight.dtype, weight.device)
    kv = torch.cat(blocks, dim=3)  # [L, 1, H_kv, T, D_k + D_v]
    return DynamicCache([tuple(t.clone() for t in kv[i].split(list(spec.widths), dim=-1))
                         for i, spec in enumerate(model.config.cache_layout)])


def _check_request(model: Decoder, prompt: torch.Tensor, max_new_tokens: int) -> None:
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"a request is a non-empty 1-D tensor of token ids, "
                         f"got shape {tuple(prompt.shape)}")
    check_int("max_new_tokens", max_new_tokens)
    model.check_input(prompt[None], None)
    kinds = sorted({type(la).__name__ for la in model.new_cache(1).layers} - set(ROW_LAYERS))
    if kinds:
        raise ValueError(f"offload reloads blocks of K/V rows; {type(model).__name__}'s cache "
                         f"holds {', '.join(kinds)} layers, which a block of rows cannot restore "
                         "(a recurrent state after the block, indexer keys, compressed entries)")
    if prompt.numel() + max_new_tokens > model.config.n_positions:
        raise ValueError(f"prompt of {prompt.numel()} + {max_new_tokens} new tokens exceeds "
                         f"the model's {model.config.n_positions} positions")


@torch.no_grad()
def serve(model: Decoder, prompts: Sequence[torch.Tensor], max_new_tokens: int,
          store: TieredStore, block_size: int, hash_fn: HashFn = hash_block) -> list[Served]:
    """Greedy-decode each prompt in turn, reusing ``store``'s blocks (all checked first)."""
    check_int("block_size", block_size)
    for prompt in prompts:
        _check_request(model, prompt, max_new_tokens)
    served = []
    for prompt in prompts:
        keys = block_hashes(prompt.tolist(), block_size, hash_fn)
        usable = (prompt.numel() - 1) // block_size  # the last position is always fed
        blocks: list[torch.Tensor] = []
        tiers: list[str] = []
        for key in keys[:usable]:  # the leading run of blocks found: stop at the first miss
            found = store.lookup(key)
            if found is None:
                break
            blocks.append(found[0])
            tiers.append(found[1])
        cache = _blocks_to_cache(blocks, model)
        logits, cache = prefill(model, prompt[None, len(blocks) * block_size:], cache)
        first = logits[0, -1]
        tokens, _, cache = greedy(logits, cache, prompt[None], max_new_tokens,
                                  lambda token, cache, _: decode_step(model, token, cache))
        rows = torch.stack([torch.cat(layer.read(cache.seq_len), dim=-1)
                            for layer in cache.layers])  # [L, 1, H_kv, T, D_k + D_v]
        for i, key in enumerate(block_hashes(tokens[0, :cache.seq_len].tolist(), block_size,
                                             hash_fn)):
            if store.tier(key) is None:
                store.put(key, rows[:, :, :, i * block_size:(i + 1) * block_size].clone())
        served.append(Served(prompt, tokens[0], first,
                             tuple(tiers) + ("computed",) * (len(keys) - len(blocks))))
    return served


class Roofline(NamedTuple):
    """A reload-or-recompute estimate's figures (passed in): peak FLOP/s, HBM and link B/s."""

    peak_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float


class Estimate(NamedTuple):
    """:func:`reload_or_recompute`'s answer, and the link bandwidth where both tie."""

    reload_s: float
    recompute_s: float
    break_even_bytes_per_s: float

    @property
    def reload_wins(self) -> bool:
        return self.reload_s < self.recompute_s


def reload_or_recompute(*, n_params: float, n_layer: int, n_head: int, n_kv_head: int,
                        head_dim: int, bytes_per_element: int, tokens: int, offset: int,
                        roof: Roofline) -> Estimate:
    """Reload ``tokens`` positions' K/V or recompute them after ``offset`` cached positions?

    Recomputing costs ``2 x n_params`` FLOPs a token plus ``4 x L x H x D x t`` of attention at
    position ``t``, and reads the weights once; reloading moves ``2 x L x tokens x H_kv x D x
    s`` bytes of K/V. An estimate: no kernel efficiency, no overlap of transfer and compute.

    >>> roof = Roofline(peak_flops=1e15, hbm_bytes_per_s=4e12, link_bytes_per_s=5e10)
    >>> e = reload_or_recompute(n_params=8e9, n_layer=32, n_head=32, n_kv_head=8,
    ...                         head_dim=128, bytes_per_element=2, tokens=16, offset=0,
    ...                         roof=roof)
    >>> e.reload_wins                          # 16 tokens: reading 16 GB of weights dominates
    True
    """
    for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_kv_head", n_kv_head),
                        ("head_dim", head_dim), ("bytes_per_element", bytes_per_element),
                        ("tokens", tokens)):
        check_int(name, value)
    if offset < 0 or n_params <= 0 or min(roof) <= 0:
        raise ValueError(f"need offset >= 0, n_params > 0 and positive roofline figures, got "
                         f"offset={offset}, n_params={n_params}, {roof}")
    positions = range(offset + 1, offset + tokens + 1)
    flops = 2 * n_params * tokens + 4 * n_layer * n_head * head_dim * sum(positions)
    kv = 2 * n_layer * tokens * n_kv_head * head_dim * bytes_per_element
    recompute = max(flops / roof.peak_flops, n_params * bytes_per_element / roof.hbm_bytes_per_s)
    return Estimate(kv / roof.link_bytes_per_s, recompute, kv / recompute)


def multi_turn(model: Decoder, store: TieredStore, *, conversations: int = 3, turns: int = 3,
               system_len: int = 8, user_len: int = 5, max_new_tokens: int = 3,
               block_size: int = 4, seed: int = 0,
               hash_fn: HashFn = hash_block) -> list[Served]:
    """A multi-turn workload served from ``store``: conversations sharing a system prompt,
    turns interleaved, each the previous turn's tokens and ``user_len`` new ones; a last request
    repeats conversation 0's first prompt from its second block on, which a chained key keeps
    apart from the first."""
    for name, value in (("conversations", conversations), ("turns", turns),
                        ("system_len", system_len), ("user_len", user_len)):
        check_int(name, value)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    system = torch.randint(1, vocab, (system_len,), generator=g)
    history = [system] * conversations
    served, first = [], None
    for _ in range(turns):
        for c in range(conversations):
            prompt = torch.cat((history[c], torch.randint(1, vocab, (user_len,), generator=g)))
            (run,) = serve(model, [prompt], max_new_tokens, store, block_size, hash_fn)
            served.append(run)
            history[c] = run.tokens
            first = prompt if first is None else first
    if first.numel() > 2 * block_size:
        served += serve(model, [first[block_size:]], max_new_tokens, store, block_size,
                        hash_fn)
    return served


class OffloadCheck(NamedTuple):
    """Every request against its run without offloading (tokens against ``generate``, first
    logits against a prefill); full prompt blocks by where they came from."""

    requests: int
    tokens_equal: bool
    max_logit_diff: float
    logits_close: bool
    blocks: dict[str, int]

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.logits_close


@torch.no_grad()
def check_offload(model: Decoder, served: Sequence[Served], max_new_tokens: int,
                  tolerance: float = 1e-5) -> OffloadCheck:
    """Compare each :class:`Served` with its prompt run in one piece (``1e-5``: sums differ)."""
    equal, close, diff = True, True, 0.0
    for run in served:
        equal &= torch.equal(run.tokens, generate(model, run.prompt[None], max_new_tokens)[0])
        want = prefill(model, run.prompt[None]).logits[0, -1]
        diff = max(diff, float((run.first_logits - want).abs().max()))
        close &= torch.allclose(run.first_logits, want, atol=tolerance, rtol=tolerance)
    blocks = Counter(t for run in served for t in run.tiers)
    return OffloadCheck(len(served), bool(equal), diff, bool(close),
                        {t: blocks[t] for t in (*TIERS, "computed")})
