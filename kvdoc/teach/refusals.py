"""What kvdoc refuses: a catalogue of bad inputs to the public API and the command line.

Each :class:`Refusal` is one bad call and the error it must raise; :func:`attempt` makes it
against fresh :class:`Fixtures` and reports whether it was refused as catalogued with every
cache left exactly as it was. ``tests/test_bad_inputs.py`` and the page "What kvdoc refuses"
share the catalogue.

>>> outcome = attempt(CATALOGUE[0])
>>> outcome.ok, outcome.raised
(True, 'ValueError')
>>> len(CATALOGUE) >= 20
True
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvdoc.core.cache import DynamicCache, KVCache, StaticCache
from kvdoc.core.model import Decoder, GPTConfig, decode_step, generate, offset_causal_mask, prefill
from kvdoc.interop.hf_config import gpt2_config
from kvdoc.interop.hf_weights import decoder_from_gpt2

# what a catalogued call may name besides the fixtures
_NAMES = {f.__name__: f for f in (GPTConfig, DynamicCache, StaticCache, offset_causal_mask,
                                   decode_step, prefill, generate, gpt2_config, decoder_from_gpt2)}
_NAMES["torch"] = torch


class CommandError(Exception):
    """``python -m kvdoc ...`` exited non-zero; the message is what it printed on stderr."""


def run_cli(*argv: str) -> str:
    """Run ``python -m kvdoc *argv`` (a new process, this interpreter); return its stdout.

    Raises:
        CommandError: the command exited non-zero (argparse's usage errors included).

    >>> run_cli("frobnicate")
    Traceback (most recent call last):
    ...
    kvdoc.teach.refusals.CommandError: exit 2: python -m kvdoc: error: ... 'frobnicate' ...
    """
    # a process of its own: the command line sits above this layer, and runs as users run it
    done = subprocess.run([sys.executable, "-m", "kvdoc", *argv], capture_output=True,
                          text=True, check=False)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines()
                 if line and not line.startswith((" ", "usage:"))]  # the error, not the usage
        raise CommandError(f"exit {done.returncode}: " + " ".join(lines))
    return done.stdout


@dataclass
class Fixtures:
    """Fresh objects for one attempt; every cache here must be unchanged after a refusal: the
    default decoder (seed 0, float32), a prompt ``ids`` ``[1, 4]``, a dynamic and a static
    cache (capacity 8) holding it, and a ``foreign`` cache filled by a model with 2 K/V heads."""

    model: Decoder
    ids: torch.Tensor
    dynamic: DynamicCache
    static: StaticCache
    foreign: DynamicCache

    @classmethod
    def make(cls) -> Fixtures:
        torch.manual_seed(0)
        model = Decoder(GPTConfig()).eval()
        other = Decoder(GPTConfig(n_kv_head=2)).eval()
        ids = torch.tensor([[3, 1, 4, 1]])
        with torch.no_grad():
            dynamic = model(ids, model.new_cache(1)).cache
            static = model(ids, model.new_cache(1, "static", capacity=8)).cache
            foreign = other(ids, other.new_cache(1)).cache
        return cls(model, ids, dynamic, static, foreign)

    def caches(self) -> dict[str, KVCache]:
        return {"dynamic": self.dynamic, "static": self.static, "foreign": self.foreign}


def _snapshot(cache: KVCache) -> tuple[int, list[torch.Tensor]]:
    return cache.seq_len, [t.detach().clone() for t in cache.tensors()]


def _same(cache: KVCache, snap: tuple[int, list[torch.Tensor]]) -> bool:
    length, tensors = snap
    now = cache.tensors()
    return cache.seq_len == length and len(now) == len(tensors) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(now, tensors, strict=True))


@dataclass(frozen=True)
class Refusal:
    """One bad input and how kvdoc must refuse it: a stable ``key``, the ``area`` of kvdoc
    called, what is ``bad`` in words, the ``call`` as code over the :class:`Fixtures`' names (the
    call made: the catalogue shows what runs), the ``error`` it must raise with ``fragment`` in
    its message; ``run``, the call as a function, only where ``call`` is not plain code."""

    key: str
    area: str
    bad: str
    call: str
    error: type[Exception]
    fragment: str
    run: Callable[[Fixtures], object] | None = field(default=None, repr=False, compare=False)

    def make(self, fx: Fixtures) -> object:
        """Make the call with ``fx``'s objects."""
        if self.run is not None:
            return self.run(fx)
        return eval(self.call, {**_NAMES, **vars(fx)})  # the catalogue's own code, no input


@dataclass(frozen=True)
class Outcome:
    """What :func:`attempt` saw. ``ok``: the catalogued refusal, with caches unchanged."""

    refusal: Refusal
    raised: str | None
    message: str
    matches: bool
    caches_unchanged: bool

    @property
    def ok(self) -> bool:
        return self.matches and self.caches_unchanged

    def explain(self) -> str:
        """Why the outcome is not ok (empty when it is)."""
        r = self.refusal
        if self.raised is None:
            return (f"{r.key}: {r.call} was accepted; "
                    f"expected {r.error.__name__} with {r.fragment!r}")
        if not self.matches:
            return (f"{r.key}: {r.call} raised {self.raised}: {self.message!r}; "
                    f"expected {r.error.__name__} with {r.fragment!r}")
        if not self.caches_unchanged:
            return f"{r.key}: {r.call} was refused but changed a cache passed to it"
        return ""


def attempt(refusal: Refusal) -> Outcome:
    """Make the bad call with fresh fixtures; report how it was refused and whether caches held."""
    fx = Fixtures.make()
    snaps = {name: _snapshot(cache) for name, cache in fx.caches().items()}
    raised, message, matches = None, "", False
    try:
        refusal.make(fx)
    except Exception as exc:
        raised, message = type(exc).__name__, str(exc)
        matches = isinstance(exc, refusal.error) and refusal.fragment in message
    unchanged = all(_same(cache, snaps[name]) for name, cache in fx.caches().items())
    return Outcome(refusal, raised, message, matches, unchanged)


def check_all() -> list[Outcome]:
    """:func:`attempt` every entry of :data:`CATALOGUE`."""
    return [attempt(r) for r in CATALOGUE]


def _interop_shape_mismatch(fx: Fixtures) -> object:
    from transformers import GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(gpt2_config(GPTConfig()))
    return decoder_from_gpt2(gpt2.state_dict(), GPTConfig(n_inner=128))


def _cli(key: str, bad: str, command: str, fragment: str) -> Refusal:
    """A refusal of ``python -m kvdoc COMMAND``: the call shown is the call made."""
    return Refusal(key, "CLI", bad, f"python -m kvdoc {command}".rstrip(), CommandError, fragment,
                   lambda fx: run_cli(*command.split()))


_r, VE = Refusal, ValueError  # short names: the catalogue is one call a line where it can be
CATALOGUE: list[Refusal] = [
    # --- the configuration ------------------------------------------------------------------
    _r("config-zero-layers", "GPTConfig", "no layers", "GPTConfig(n_layer=0)", VE,
       "n_layer must be a positive integer"),
    _r("config-negative-heads", "GPTConfig", "a negative head count", "GPTConfig(n_head=-4)", VE,
       "n_head must be a positive integer"),
    _r("config-float-width", "GPTConfig", "a width that is a float", "GPTConfig(n_embd=64.0)", VE,
       "n_embd must be a positive integer"),
    _r("config-bool-vocab", "GPTConfig", "a bool where a size belongs",
       "GPTConfig(vocab_size=True)", VE, "vocab_size must be a positive integer"),
    _r("config-width-heads", "GPTConfig", "a width the heads do not divide",
       "GPTConfig(n_embd=60, n_head=8)", VE, "n_embd=60 is not divisible by n_head=8"),
    _r("config-gqa-groups", "GPTConfig", "query heads not a multiple of K/V heads",
       "GPTConfig(n_kv_head=3)", VE, "n_head=4 is not divisible by n_kv_head=3"),
    _r("config-epsilon", "GPTConfig", "a LayerNorm epsilon of zero",
       "GPTConfig(layer_norm_epsilon=0.0)", VE, "layer_norm_epsilon must be positive"),
    # --- the model's input ------------------------------------------------------------------------
    _r("ids-1d", "Decoder", "ids without a batch dimension", "model(torch.tensor([3, 1, 4]))", VE,
       "idx must be a [B, C] tensor"),
    _r("ids-list", "Decoder", "a Python list instead of a tensor", "model([[3, 1, 4]])", VE,
       "got list"),
    _r("ids-float", "Decoder", "float token ids", "model(torch.zeros(1, 3))", VE,
       "int64 or int32 token ids, got dtype torch.float32"),
    _r("ids-bool", "Decoder", "bool token ids", "model(torch.ones(1, 3, dtype=torch.bool))", VE,
       "int64 or int32 token ids, got dtype torch.bool"),
    _r("ids-int16", "Decoder", "token ids of a type the embedding cannot index with",
       "model(torch.ones(1, 3, dtype=torch.int16))", VE, "int32 token ids, got dtype torch.int16"),
    _r("ids-empty", "Decoder", "no tokens", "model(torch.zeros(1, 0, dtype=torch.long), dynamic)",
       VE, "empty input"),
    _r("ids-past-vocab", "Decoder", "a token id past the vocabulary",
       "model(torch.tensor([[5, 97]]), dynamic)", VE,
       "token id 97 is outside the vocabulary 0..96"),
    _r("ids-negative", "Decoder", "a negative token id", "model(torch.tensor([[-1]]), static)", VE,
       "token id -1 is outside the vocabulary"),
    _r("ids-device", "Decoder", "ids on another device than the model", "model(ids.to('meta'))", VE,
       "idx is on meta, model is on cpu"),
    _r("ids-too-long", "Decoder", "more tokens than learned positions",
       "model(torch.zeros(1, 513, dtype=torch.long))", VE, "513 positions, model has 512"),
    _r("cache-past-positions", "Decoder", "a continuation that runs past the last position",
       "model(torch.zeros(1, 509, dtype=torch.long), dynamic)", VE,
       "4 cached + 509 new = 513 positions"),
    # --- caches ---------------------------------------------------------------------------------
    _r("cache-not-a-cache", "caches", "K/V tensors where a cache belongs",
       "model(ids, dynamic.tensors())", VE, "cache must be a KVCache, got list"),
    _r("cache-batch", "caches", "a cache of batch 1 continued with batch 2",
       "model(torch.zeros(2, 1, dtype=torch.long), dynamic)", VE,
       "batch size 1 in the cache, 2 in the call"),
    _r("cache-other-model", "caches", "a cache filled by another model (2 K/V heads, not 4)",
       "model(ids, foreign)", VE, "cache was built for another model"),
    _r("cache-other-depth", "caches", "a cache for a 3-layer model",
       "model(ids, DynamicCache.empty(GPTConfig(n_layer=3), 1))", VE,
       "cache was built for another model"),
    _r("cache-dtype", "caches", "a float64 cache for a float32 model",
       "model(ids, DynamicCache.empty(model.config, 1, torch.float64))", VE,
       "dtype torch.float64 in the cache, torch.float32 in the call"),
    _r("cache-device", "caches", "a cache on another device than the model",
       "model(ids, DynamicCache.empty(model.config, 1, device='meta'))", VE,
       "device meta in the cache, cpu in the call"),
    _r("static-over-capacity", "caches", "5 more positions into a static cache with room for 4",
       "model(torch.zeros(1, 5, dtype=torch.long), static)", VE, "static cache over capacity"),
    _r("cache-kind", "caches", "an unknown cache kind", "model.new_cache(1, 'paged')", VE,
       "unknown cache kind 'paged'"),
    _r("cache-zero-batch", "caches", "a cache for zero sequences", "model.new_cache(0)", VE,
       "batch_size must be a positive integer, got 0"),
    _r("static-negative-capacity", "caches", "a negative capacity",
       "StaticCache(model.config, 1, capacity=-8)", VE,
       "capacity must be a positive integer, got -8"),
    _r("static-zero-capacity", "caches", "a static cache with room for nothing",
       "model.new_cache(1, 'static', capacity=0)", VE,
       "capacity must be a positive integer, got 0"),
    _r("crop-longer", "caches", "cropping a cache to more than it holds", "dynamic.crop(10)", VE,
       "cannot crop a cache of 4 positions to 10"),
    _r("crop-negative", "caches", "cropping to a negative length", "static.crop(-1)", VE,
       "cannot crop a cache of 4 positions to -1"),
    _r("cache-kv-shapes", "caches", "K and V of different shapes",
       "DynamicCache([(K, V[:, :, :2])]) with K, V = dynamic.layer(0)",
       VE, "K and V must both be [B, H, T, width]",
       lambda fx: DynamicCache([(fx.dynamic.layer(0)[0], fx.dynamic.layer(0)[1][:, :, :2])])),
    _r("cache-no-layers", "caches", "a cache with no layers", "DynamicCache([])", VE,
       "a cache needs at least one layer"),
    # --- masks ------------------------------------------------------------------------------------
    _r("mask-negative-past", "masks", "a negative cached length", "offset_causal_mask(-1, 2)", VE,
       "past_len must be a non-negative integer, got -1"),
    _r("mask-no-queries", "masks", "zero new queries", "offset_causal_mask(3, 0)", VE,
       "new_len must be a positive integer, got 0"),
    _r("mask-float-length", "masks", "a float length", "offset_causal_mask(2.0, 1)", VE,
       "past_len must be a non-negative integer, got 2.0"),
    # --- generation -------------------------------------------------------------------------------
    _r("decode-two-tokens", "generation", "two tokens in one decode step",
       "decode_step(model, torch.tensor([[1, 2]]), dynamic)", VE,
       "decode_step takes one token per row"),
    _r("prefill-past-vocab", "generation", "a prompt with an id past the vocabulary",
       "prefill(model, torch.tensor([[1, 200]]), static)", VE,
       "token id 200 is outside the vocabulary"),
    _r("generate-nothing", "generation", "asking for no new tokens", "generate(model, ids, 0)", VE,
       "max_new_tokens must be a positive integer, got 0"),
    _r("generate-absurd", "generation", "asking for more tokens than positions",
       "generate(model, ids, 10**6)", VE, "= 1000004 positions, model has 512"),
    _r("generate-cache-kind", "generation", "an unknown cache kind",
       "generate(model, ids, 3, cache='paged')", VE, "unknown cache kind 'paged'"),
    _r("generate-filled-cache", "generation", "a cache that already holds positions",
       "generate(model, ids, 3, cache=static)", VE, "generate() fills an empty cache"),
    # --- transformers interop ---------------------------------------------------------------------
    _r("interop-gqa", "interop", "a grouped-query config for GPT-2, which has none",
       "gpt2_config(GPTConfig(n_kv_head=2))", VE, "GPT-2 has no grouped-query attention"),
    _r("interop-bare-state-dict", "interop", "a bare state dict without a config",
       "decoder_from_gpt2(model.state_dict())", VE, "pass config="),
    _r("interop-empty", "interop", "an empty state dict", "decoder_from_gpt2({}, GPTConfig())", VE,
       "empty state dict"),
    _r("interop-shapes", "interop", "GPT-2 weights for another MLP width",
       "decoder_from_gpt2(hf.state_dict(), GPTConfig(n_inner=128))", VE, "checkpoint shape",
       _interop_shape_mismatch),
    # --- the command line -------------------------------------------------------------------------
    _cli("cli-unknown-command", "an unknown subcommand", "train", "invalid choice: 'train'"),
    _cli("cli-no-command", "no subcommand", "", "the following arguments are required: COMMAND"),
    _cli("cli-memory-model", "an unknown model name", "memory --model gpt-9 --seq-len 10",
         "unknown model 'gpt-9'"),
    _cli("cli-memory-negative", "a negative length", "memory --model llama-3-8b --seq-len -5",
         "expected a positive integer, got '-5'"),
    _cli("cli-memory-dtype", "an unknown dtype",
         "memory --layers 2 --kv-heads 4 --head-dim 16 --seq-len 8 --dtype float7",
         "unknown dtype 'float7'"),
    _cli("cli-memory-missing", "sizes missing", "memory --layers 2 --seq-len 8",
         "missing --kv-heads, --head-dim"),
    _cli("cli-verify-variant", "an unknown broken variant", "verify --variant nope",
         "no broken variant 'nope'"),
    _cli("cli-bench-lengths", "a prompt length that is not a number", "bench --prefix-lens 4,x",
         "expected comma-separated integers, got '4,x'"),
]
