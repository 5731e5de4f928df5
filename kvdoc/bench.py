"""What the cache saves: counted work, a FLOP model, timings, growth with length, the bandwidth floor.

Everything here measures one fixed token stream, batch 1, FP32, on the CPU, with a fixed
thread count (one by default), the model in ``eval()`` and under ``torch.inference_mode()``:

* **prefill**: ``P`` prompt tokens in one call, filling a cache;
* **full recompute**, ``G`` steps: step ``j`` (1-based) runs the whole prefix of ``P + j``
  tokens again, projecting either every position to the vocabulary (``full_all``, the naive
  baseline) or only the last (``full_last``);
* **cached continuation**, ``G`` steps of one token each, from the prefix cache, with the
  :class:`~kvdoc.cache.DynamicCache` (``dynamic``) and the :class:`~kvdoc.cache.StaticCache`
  (``static``);
* **transformers**: transformers' ``GPT2LMHeadModel`` on the same weights with its own cache,
  the reference a user would otherwise pick.

Each path is warmed up, then sampled ``samples`` times with the order of the paths rotated
between rounds; :func:`run_bench` returns every raw sample (milliseconds) with the settings,
the environment and a timestamp, plus the counts, the FLOP model, the growth fit and the
memory-bandwidth roofline of a GPT-2-small-sized model. ``python -m kvdoc bench`` prints the
ratios and writes the JSON. Nothing here asserts a speed: timings are measurements, not facts.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib.metadata
import json
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .config import GPTConfig
from .model import Decoder

PATHS = ("prefill", "full_all", "full_last", "dynamic", "static", "transformers")
"""Timed paths, in the order of the first sampling round."""

GPT2_SMALL = GPTConfig(vocab_size=50257, n_positions=1024, n_layer=12, n_head=12, n_embd=768, n_inner=3072)
"""GPT-2 small's shape; with the LM head tied to ``wte`` it has 124,439,808 parameters."""


# --------------------------------------------------------------------------- settings and results


@dataclass(frozen=True)
class BenchSettings:
    """What to measure. The defaults are the CLI's; pages and tests pass smaller ones.

    Args:
        prefix_lens: prompt lengths ``P`` (each ``P + new_tokens`` must fit the model).
        new_tokens: ``G``, fixed tokens consumed after the prompt.
        samples: timed samples per path (after ``warmup`` untimed runs).
        warmup: untimed runs per path before sampling.
        threads: torch intra-op threads during the measurement (restored afterwards).
        seed: seeds the weights and the token stream.
        model: the model timed for the table, counts and growth (default: the 145,280-parameter one).
        transformers: also time transformers' GPT-2 (needs ``transformers``).
        growth_lengths: total lengths ``T`` at which one step of each path is timed.
        growth_samples: samples per path and length for the growth fit.
        roofline: also run the memory-bandwidth floor on ``roofline_model``.
        roofline_model: the model for the floor (default: GPT-2 small's shape, tied head, random init).
        roofline_context: prompt length before the timed decode steps of the floor.
        roofline_steps: decode steps per roofline sample.
        roofline_samples: samples per roofline path.
        bandwidth_mib: size of the tensor whose reduction measures memory bandwidth.
    """

    prefix_lens: tuple[int, ...] = (16, 64, 128, 256)
    new_tokens: int = 16
    samples: int = 15
    warmup: int = 3
    threads: int = 1
    seed: int = 0
    model: GPTConfig = field(default_factory=GPTConfig)
    transformers: bool = True
    growth_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    growth_samples: int = 15
    roofline: bool = True
    roofline_model: GPTConfig = GPT2_SMALL
    roofline_context: int = 128
    roofline_steps: int = 8
    roofline_samples: int = 7
    bandwidth_mib: int = 512

    def __post_init__(self) -> None:
        for name in ("new_tokens", "samples", "threads", "growth_samples", "roofline_steps",
                     "roofline_samples", "bandwidth_mib", "roofline_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative integer, got {self.warmup!r}")
        object.__setattr__(self, "prefix_lens", tuple(self.prefix_lens))
        object.__setattr__(self, "growth_lengths", tuple(self.growth_lengths))
        if not self.prefix_lens:
            raise ValueError("prefix_lens is empty")
        for p in self.prefix_lens:
            if not isinstance(p, int) or p < 1 or p + self.new_tokens > self.model.n_positions:
                raise ValueError(f"prefix length {p!r} + {self.new_tokens} new tokens does not fit "
                                 f"1 .. {self.model.n_positions} positions")
        for t in self.growth_lengths:
            if not isinstance(t, int) or t < 2 or t > self.model.n_positions:
                raise ValueError(f"growth length {t!r} must lie in 2 .. {self.model.n_positions}")
        if self.roofline_context + self.roofline_steps > self.roofline_model.n_positions:
            raise ValueError("roofline_context + roofline_steps exceeds the roofline model's positions")


@dataclass
class BenchResult:
    """Everything one run measured; :meth:`to_json` is what ``--json`` writes.

    ``timings[P][path]`` holds the raw samples in milliseconds (a whole ``G``-step run for the
    decode paths, one call for prefill); ``ratios`` holds the headline figures (higher is better).
    """

    settings: BenchSettings
    environment: dict[str, Any]
    timestamp: str
    timings: dict[int, dict[str, list[float]]]
    kv_kib: dict[int, float]
    max_abs_diff: dict[int, dict[str, float]]
    counts: dict[int, dict[str, int]]
    flops: dict[int, dict[str, float]]
    growth: dict[str, Any]
    roofline: dict[str, Any] | None
    ops: dict[str, int]
    ratios: dict[str, float]

    def p50(self, prefix_len: int, path: str) -> float:
        """Median of a path's samples at one prefix length, in ms."""
        return percentile(self.timings[prefix_len][path], 50)

    def p95(self, prefix_len: int, path: str) -> float:
        """95th percentile of a path's samples at one prefix length, in ms."""
        return percentile(self.timings[prefix_len][path], 95)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: configuration, environment, timestamp, raw samples, summaries, ratios."""
        settings = asdict(self.settings)
        summary = {str(p): {path: {"p50_ms": self.p50(p, path), "p95_ms": self.p95(p, path)}
                            for path in paths} for p, paths in self.timings.items()}
        return {
            "ratios": self.ratios,
            "config": settings,
            "environment": self.environment,
            "timestamp": self.timestamp,
            "summary": summary,
            "samples_ms": {str(p): paths for p, paths in self.timings.items()},
            "final_kv_kib": {str(p): v for p, v in self.kv_kib.items()},
            "max_abs_logit_diff": {str(p): v for p, v in self.max_abs_diff.items()},
            "counts": {str(p): v for p, v in self.counts.items()},
            "flops": {str(p): v for p, v in self.flops.items()},
            "growth": self.growth,
            "roofline": self.roofline,
            "aten_ops_per_step": self.ops,
        }


def percentile(samples: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation) of ``samples`` as a Python float.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.5
    """
    values = list(samples)
    if not values:
        raise ValueError("no samples")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def environment() -> dict[str, Any]:
    """CPU model, Python, torch and transformers versions, and torch's current thread count."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        tf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a docs/test dependency
        tf_version = None
    return {"cpu": cpu, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": tf_version, "threads": torch.get_num_threads()}


# --------------------------------------------------------------------------- counted work and FLOPs


def projected_positions_full(prefix_len: int, new_tokens: int) -> int:
    """Positions full recompute pushes through each layer over ``G`` steps: ``G P + G (G + 1) / 2``.

    >>> projected_positions_full(256, 16)
    4232
    """
    return new_tokens * prefix_len + new_tokens * (new_tokens + 1) // 2


class RowCounter:
    """Forward hooks that count the rows (positions) passing through chosen linear layers.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig()).eval()
    >>> with RowCounter(model) as rows:
    ...     _ = model(torch.tensor([[1, 2, 3]]))
    >>> rows.counts
    {'c_attn': 3, 'lm_head': 3}
    """

    def __init__(self, model: Decoder) -> None:
        self.model = model
        self.counts = {"c_attn": 0, "lm_head": 0}
        self._handles: list[Any] = []

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Linear, inputs: Any, output: torch.Tensor) -> None:
            self.counts[name] += output.numel() // module.out_features  # rows = B * positions
        return hook

    def __enter__(self) -> RowCounter:
        self._handles = [self.model.h[0].attn.c_attn.register_forward_hook(self._hook("c_attn")),
                         self.model.lm_head.register_forward_hook(self._hook("lm_head"))]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


def step_flops(config: GPTConfig, past: int, new: int, last_only: bool = False) -> dict[str, float]:
    """Multiply-add FLOPs (2 per MAC) of one forward: ``new`` tokens after ``past`` cached ones.

    ``linear`` covers ``c_attn``, ``c_proj`` and the MLP of every layer (~ ``C d^2``);
    ``attention`` the scores ``Q K^T`` and the weighted sum with ``V`` (~ ``C T d``, with
    ``T = past + new``; masked entries are counted, as dense attention computes them);
    ``lm_head`` the vocabulary projection of the projected rows. Norms, GELU and softmax are left out.

    >>> f = step_flops(GPTConfig(), past=0, new=1)
    >>> f["attention"] == 2 * 2 * 1 * 1 * 64 * 2       # 2 layers, QK^T and PV, 1 query, 1 key
    True
    """
    d, t = config.n_embd, past + new
    per_token_linear = d * (d + 2 * config.kv_dim) + d * d + 2 * d * config.n_inner
    linear = 2.0 * config.n_layer * new * per_token_linear
    attention = 2.0 * config.n_layer * 2 * new * t * d  # H heads x D_h = d, for QK^T and for PV
    lm_head = 2.0 * (1 if last_only else new) * d * config.vocab_size
    return {"linear": linear, "attention": attention, "lm_head": lm_head,
            "total": linear + attention + lm_head}


def run_flops(config: GPTConfig, prefix_len: int, new_tokens: int) -> dict[str, float]:
    """Total FLOPs of the ``G`` decode steps after a ``P``-token prompt, for each path.

    Keys: ``full_all``, ``full_last`` (step ``j`` recomputes ``P + j`` positions) and ``cached``
    (one position per step over ``P + j - 1`` cached ones), plus their ``linear`` and
    ``attention`` parts.
    """
    out: dict[str, float] = {}
    for name, kwargs in (("full_all", {"last_only": False}), ("full_last", {"last_only": True})):
        parts = [step_flops(config, 0, prefix_len + j, **kwargs) for j in range(1, new_tokens + 1)]
        for part in ("linear", "attention", "lm_head", "total"):
            out[f"{name}_{part}" if part != "total" else name] = sum(p[part] for p in parts)
    parts = [step_flops(config, prefix_len + j - 1, 1) for j in range(1, new_tokens + 1)]
    for part in ("linear", "attention", "lm_head", "total"):
        out[f"cached_{part}" if part != "total" else "cached"] = sum(p[part] for p in parts)
    return out


def count_ops(call: Callable[[], Any]) -> dict[str, int]:
    """ATen operators dispatched while ``call()`` runs, by name (what a step costs in dispatches).

    >>> ops = count_ops(lambda: torch.ones(2) + 1)
    >>> ops["aten.add.Tensor"]
    1
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = {}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            counts[str(func)] = counts.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    with Counter():
        call()
    return counts


def ops_per_step(model: Decoder, hf: Any, prefix_len: int, seed: int = 0) -> dict[str, int]:
    """ATen operators of one decode step after ``prefix_len`` cached positions, per path.

    ``full_all`` is one full-recompute step over ``prefix_len + 1`` positions.
    """
    ids = _token_stream(model.config, prefix_len + 1, seed)
    prompt, token = ids[:, :prefix_len], ids[:, prefix_len:]
    out = {"full_all": sum(count_ops(lambda: model(ids)).values())}
    for kind in ("dynamic", "static"):
        cache = model(prompt, model.new_cache(1, kind, capacity=prefix_len + 1))[1]
        out[kind] = sum(count_ops(lambda: model(token, cache)).values())
    if hf is not None:
        hf_cache = hf(prompt, use_cache=True).cache
        out["transformers"] = sum(count_ops(lambda: hf(token, cache=hf_cache, use_cache=True)).values())
    return out


# --------------------------------------------------------------------------- timing machinery

Prepare = Callable[[], Callable[[], Any]]
"""Untimed setup that returns the zero-argument call to time."""


def time_paths(paths: dict[str, Prepare], samples: int, warmup: int,
               tick: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Time each path ``samples`` times after ``warmup`` runs, rotating the order every round.

    Returns the raw samples in milliseconds, per path. ``tick`` is called after each timed call.

    >>> out = time_paths({"a": lambda: (lambda: None), "b": lambda: (lambda: None)}, samples=3, warmup=1)
    >>> sorted(out), [len(v) for v in out.values()]
    (['a', 'b'], [3, 3])
    """
    names = list(paths)
    for name in names:
        for _ in range(warmup):
            paths[name]()()
    out: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    for s in range(samples):
        k = s % len(names)
        for name in names[k:] + names[:k]:  # rotate: no path always runs first or last
            call = paths[name]()
            t0 = time.perf_counter()
            call()
            out[name].append((time.perf_counter() - t0) * 1e3)
            if tick is not None:
                tick()
    return out


def _token_stream(config: GPTConfig, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def build_models(config: GPTConfig, seed: int, transformers: bool, tie: bool = False) -> tuple[Decoder, Any]:
    """A kvdoc decoder and, if asked, transformers' GPT-2 with the same random weights (both eval).

    kvdoc's decoder is initialised (seeded); transformers' model is created without initialising
    (on the meta device) and receives the decoder's weights, with ``c_attn``, ``c_proj`` and
    ``c_fc`` transposed into GPT-2's ``Conv1D`` layout. That skips a second random
    initialisation, which costs seconds at GPT-2 small's size. With ``tie`` the LM head shares
    ``wte``'s weight, as in GPT-2's checkpoints. Raises ``RuntimeError`` if the two models'
    logits disagree on a short input.
    """
    torch.manual_seed(seed)
    model = Decoder(config).eval()
    if tie:
        model.lm_head.weight = model.wte.weight
    if not transformers:
        return model, None
    with warnings.catch_warnings():  # transformers imports tqdm.auto, which warns inside a notebook
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import GPT2LMHeadModel

    from .interop import gpt2_config

    hf_config = gpt2_config(config)
    hf_config.tie_word_embeddings = tie
    with torch.device("meta"):
        hf = GPT2LMHeadModel(hf_config)
    hf = hf.to_empty(device="cpu")
    ours = model.state_dict()
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {}
    for key in hf.state_dict():
        name = key.removeprefix("transformer.")
        state[key] = ours[name].t() if name.endswith(conv1d) else ours[name]
    hf.load_state_dict(state)
    if tie:
        hf.tie_weights()
    hf.eval()
    with torch.inference_mode():
        ids = _token_stream(config, 5, seed)
        diff = float((hf(ids).logits - model(ids).logits).abs().max())
    if not diff < 1e-4:
        raise RuntimeError(f"transformers' GPT-2 and kvdoc disagree after copying weights: {diff:.3e}")
    return model, hf


def _decode_paths(model: Decoder, hf: Any, ids: torch.Tensor, prefix_len: int, steps: int,
                  full: bool) -> tuple[dict[str, Prepare], dict[str, Callable[[], torch.Tensor]]]:
    """The timed paths for one prefix, and for each one a call returning its stacked logits."""
    P, G = prefix_len, steps
    prompt = ids[:, :P]

    def full_run(last_only: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            return torch.cat([model(ids[:, :P + j], last_only=last_only).logits[:, -1:]
                              for j in range(1, G + 1)], 1)
        return run

    dyn_prefix = model(prompt, model.new_cache(1, "dynamic"))[1]
    static = model(prompt, model.new_cache(1, "static", capacity=P + G))[1]

    def cached_run(start: Callable[[], Any]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            cache, out = start(), []
            for j in range(G):
                logits, cache = model(ids[:, P + j:P + j + 1], cache)
                out.append(logits)
            return torch.cat(out, 1)
        return run

    static_run = cached_run(lambda: static)
    runs: dict[str, Callable[[], torch.Tensor]] = {"dynamic": cached_run(lambda: dyn_prefix)}
    prepare: dict[str, Prepare] = {}
    if full:
        def prefill_prepare() -> Callable[[], Any]:
            cache = model.new_cache(1, "dynamic")
            return lambda: model(prompt, cache, last_only=True)
        prepare["prefill"] = prefill_prepare
        runs["full_all"], runs["full_last"] = full_run(False), full_run(True)
        prepare["full_all"] = lambda: runs["full_all"]
        prepare["full_last"] = lambda: runs["full_last"]
    prepare["dynamic"] = lambda: runs["dynamic"]

    def static_prepare() -> Callable[[], Any]:
        static.crop(P)  # back to the prompt, untimed
        return static_run
    prepare["static"] = static_prepare

    if hf is not None:
        hf_cache = hf(prompt, use_cache=True).cache

        def hf_run() -> torch.Tensor:
            out = []
            for j in range(G):
                step = hf(ids[:, P + j:P + j + 1], cache=hf_cache, use_cache=True)
                out.append(step.logits)
            return torch.cat(out, 1)

        def hf_prepare() -> Callable[[], Any]:
            # transformers' cache grows in place; crop takes the (negative) number of positions to drop
            hf_cache.crop(P - hf_cache.get_seq_length())  # back to the prompt, untimed
            return hf_run
        prepare["transformers"] = hf_prepare
        runs["transformers"] = lambda: hf_prepare()()
    runs["static"] = lambda: static_prepare()()
    return prepare, runs


# --------------------------------------------------------------------------- the four measurements


def _bench_prefix(model: Decoder, hf: Any, settings: BenchSettings, prefix_len: int,
                  tick: Callable[[], None]) -> tuple[dict[str, list[float]], float, dict[str, float], dict[str, int]]:
    G = settings.new_tokens
    ids = _token_stream(model.config, prefix_len + G, settings.seed + prefix_len)
    prepare, runs = _decode_paths(model, hf, ids, prefix_len, G, full=True)
    reference = model(ids).logits[:, prefix_len:]  # [1, G, V]: one full forward of the whole stream
    diffs = {name: float((run() - reference).abs().max()) for name, run in runs.items()}
    counts: dict[str, int] = {}
    for name in ("full_all", "full_last", "dynamic", "static"):
        with RowCounter(model) as rows:
            runs[name]()
        counts[f"{name}_c_attn"], counts[f"{name}_lm_head"] = rows.counts["c_attn"], rows.counts["lm_head"]
    counts["formula_full"] = projected_positions_full(prefix_len, G)
    counts["formula_cached"] = G
    final = model(ids, model.new_cache(1, "dynamic"))[1]
    samples = time_paths(prepare, settings.samples, settings.warmup, tick)
    return samples, final.nbytes() / 1024, diffs, counts


def _bench_growth(model: Decoder, settings: BenchSettings, tick: Callable[[], None]) -> dict[str, Any]:
    """Per-step time at total length ``T``: full recompute of ``T`` positions vs one cached step."""
    per_len: dict[str, dict[str, list[float]]] = {}
    for T in settings.growth_lengths:
        ids = _token_stream(model.config, T, settings.seed + 7919 + T)
        prepare, _ = _decode_paths(model, None, ids, T - 1, 1, full=True)
        prepare = {"full_all": prepare["full_all"], "dynamic": prepare["dynamic"], "static": prepare["static"]}
        per_len[str(T)] = time_paths(prepare, settings.growth_samples, settings.warmup, tick)
    lengths = np.log(np.asarray(settings.growth_lengths, dtype=float))
    upper = len(lengths) // 2  # the longer half (at least two points), where fixed costs matter least
    slopes: dict[str, float | None] = {}
    slopes_upper: dict[str, float | None] = {}
    for path in ("full_all", "dynamic", "static"):
        p50 = np.log([percentile(per_len[str(T)][path], 50) for T in settings.growth_lengths])
        slopes[path] = float(np.polyfit(lengths, p50, 1)[0]) if len(lengths) >= 2 else None
        slopes_upper[path] = float(np.polyfit(lengths[upper:], p50[upper:], 1)[0]) if len(lengths) >= 4 else None
    return {"lengths": list(settings.growth_lengths), "samples_ms": per_len, "slopes": slopes,
            "slopes_upper": slopes_upper, "upper_from": settings.growth_lengths[upper],
            "p50_ms": {path: [percentile(per_len[str(T)][path], 50) for T in settings.growth_lengths]
                       for path in ("full_all", "dynamic", "static")}}


def measure_bandwidth(mib: int, samples: int = 7) -> dict[str, Any]:
    """Memory read bandwidth from ``sum`` over a ``mib``-MiB FP32 tensor at the current thread count.

    >>> bw = measure_bandwidth(4, samples=2)
    >>> bw["bytes"] == 4 * 2**20 and bw["gb_per_s"] > 0
    True
    """
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()  # warm: page the tensor in
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    nbytes = x.numel() * x.element_size()
    del x
    return {"bytes": nbytes, "samples_s": times, "gb_per_s": nbytes / percentile(times, 50) / 1e9}


def step_bytes(model: Decoder, context: int) -> int:
    """Bytes one decode step must read at ``context`` cached positions: weights plus K/V.

    Every block's weights, ``ln_f`` and the LM head matrix, one row of ``wte`` and ``wpe``,
    and K and V of every layer over ``context + 1`` positions (FP32 or whatever the dtype is).
    """
    cfg, size = model.config, model.wte.weight.element_size()
    params = {id(p): p for p in model.parameters()}
    embeddings = {id(model.wte.weight), id(model.wpe.weight)}
    weights = sum(p.numel() for i, p in params.items() if i not in embeddings)
    if model.lm_head.weight is model.wte.weight:  # tied: the head reads the whole table
        weights += model.wte.weight.numel()
    weights += 2 * cfg.n_embd  # one embedding row each
    kv = 2 * cfg.n_layer * (context + 1) * cfg.kv_dim
    return (weights + kv) * size


def _bench_roofline(settings: BenchSettings, tick: Callable[[], None], build_threads: int) -> dict[str, Any]:
    timed_threads = torch.get_num_threads()
    torch.set_num_threads(build_threads)  # random init of 124M parameters is not what is measured
    try:
        model, hf = build_models(settings.roofline_model, settings.seed, settings.transformers, tie=True)
    finally:
        torch.set_num_threads(timed_threads)
    C, S = settings.roofline_context, settings.roofline_steps
    ids = _token_stream(model.config, C + S, settings.seed + 1)
    prepare, _ = _decode_paths(model, hf, ids, C, S, full=False)
    # Bandwidth is one more path of the rotation, so it sees the same machine state as decode.
    x = torch.ones(settings.bandwidth_mib * 2**20 // 4, dtype=torch.float32)
    prepare["bandwidth"] = lambda: x.sum
    samples = time_paths(prepare, settings.roofline_samples, min(settings.warmup, 1), tick)
    bw_times = [t / 1e3 for t in samples.pop("bandwidth")]
    nbytes = x.numel() * x.element_size()
    del x
    bandwidth = {"bytes": nbytes, "kernel": "torch.sum over a float32 tensor", "samples_s": bw_times,
                 "gb_per_s": nbytes / percentile(bw_times, 50) / 1e9}
    mean_bytes = sum(step_bytes(model, C + j) for j in range(S)) / S
    floor_ms = mean_bytes / (bandwidth["gb_per_s"] * 1e9) * 1e3
    per_token = {path: percentile(v, 50) / S for path, v in samples.items()}
    fraction = {path: floor_ms / t for path, t in per_token.items()}
    out = {"model": asdict(settings.roofline_model), "parameters": model.num_parameters(),
           "context": C, "steps": S, "samples_ms": samples, "bandwidth": bandwidth,
           "bytes_per_step": mean_bytes, "floor_ms_per_token": floor_ms,
           "p50_ms_per_token": per_token, "fraction": fraction}
    del model, hf
    gc.collect()
    return out


def run_bench(settings: BenchSettings | None = None, progress: bool = False) -> BenchResult:
    """Run every measurement once and return the raw results and the headline ratios.

    Sets ``torch``'s thread count to ``settings.threads`` and restores it afterwards.
    ``progress`` shows a tqdm bar on stderr.

    >>> s = BenchSettings(prefix_lens=(4,), new_tokens=2, samples=2, warmup=0, transformers=False,
    ...                   growth_lengths=(4, 8), growth_samples=1, roofline=False)
    >>> r = run_bench(s)
    >>> r.counts[4]["full_all_lm_head"] == projected_positions_full(4, 2) == 2 * 4 + 3
    True
    >>> sorted(r.ratios)
    ['cached_vs_full_all_positions', 'cached_vs_full_last_position', 'static_vs_dynamic']
    """
    settings = settings or BenchSettings()
    from tqdm import tqdm

    n_paths = 4 + int(settings.transformers)
    total = (len(settings.prefix_lens) * settings.samples * (n_paths + 1)
             + len(settings.growth_lengths) * settings.growth_samples * 3
             + (settings.roofline_samples * (3 + int(settings.transformers)) if settings.roofline else 0))
    threads = torch.get_num_threads()
    bar = tqdm(total=total, disable=not progress, file=sys.stderr, unit="sample", desc="kvdoc bench")
    try:
        torch.set_num_threads(settings.threads)
        with torch.inference_mode():
            model, hf = build_models(settings.model, settings.seed, settings.transformers)
            env = environment()
            stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            timings, kv_kib, diffs, counts, flops = {}, {}, {}, {}, {}
            for P in settings.prefix_lens:
                bar.set_postfix_str(f"P={P}")
                timings[P], kv_kib[P], diffs[P], counts[P] = _bench_prefix(model, hf, settings, P, bar.update)
                flops[P] = run_flops(settings.model, P, settings.new_tokens)
            ops = ops_per_step(model, hf, max(settings.prefix_lens), settings.seed)
            bar.set_postfix_str("growth")
            growth = _bench_growth(model, settings, bar.update)
            del model, hf
            roofline = None
            if settings.roofline:
                bar.set_postfix_str("roofline")
                roofline = _bench_roofline(settings, bar.update, threads)
    finally:
        torch.set_num_threads(threads)
        bar.close()
    result = BenchResult(settings, env, stamp, timings, kv_kib, diffs, counts, flops, growth, roofline, ops, {})
    result.ratios = ratios(result)
    return result


def ratios(result: BenchResult) -> dict[str, float]:
    """Headline figures at the largest prefix length, each a speed-up or fraction (higher is better).

    ``cached_vs_*``: the other path's p50 over the faster kvdoc cache's p50 for the ``G`` steps;
    ``bandwidth_fraction``: the bandwidth floor over kvdoc's faster cached decode time per token
    (1 would read weights and K/V at the measured bandwidth); ``*_transformers`` the same for
    transformers' GPT-2.
    """
    P = max(result.timings)
    best = min(result.p50(P, "dynamic"), result.p50(P, "static"))
    out = {"cached_vs_full_all_positions": result.p50(P, "full_all") / best,
           "cached_vs_full_last_position": result.p50(P, "full_last") / best,
           "static_vs_dynamic": result.p50(P, "dynamic") / result.p50(P, "static")}
    if "transformers" in result.timings[P]:
        out["cached_vs_transformers"] = result.p50(P, "transformers") / best
    if result.roofline is not None:
        fraction = result.roofline["fraction"]
        out["bandwidth_fraction"] = max(fraction["dynamic"], fraction["static"])
        if "transformers" in fraction:
            out["bandwidth_fraction_transformers"] = fraction["transformers"]
            out["bandwidth_fraction_vs_transformers"] = out["bandwidth_fraction"] / fraction["transformers"]
    return {k: float(v) for k, v in out.items()}


# --------------------------------------------------------------------------- tables and figures


@dataclass(frozen=True)
class Table:
    """A small table of strings: ``str()`` gives Markdown (for the CLI), ``_repr_html_`` HTML (for pages).

    >>> print(Table(["a (ms)", "b"], [["1.0", "x"]]))
    | a (ms) | b |
    |---:|---:|
    | 1.0 | x |
    """

    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        """The table as GitHub-flavoured Markdown."""
        lines = ["| " + " | ".join(self.header) + " |", "|" + "|".join("---:" for _ in self.header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in self.rows])

    def __str__(self) -> str:
        return self.markdown()

    def _repr_html_(self) -> str:
        from html import escape

        head = "".join(f"<th style='text-align:right'>{escape(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td style='text-align:right'>{escape(c)}</td>" for c in r) + "</tr>"
                       for r in self.rows)
        return f"<table class='table'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def timings_table(result: BenchResult) -> Table:
    """Table: per prefix, prefill p50, full recompute and cached p50 / p95 (ms for all G steps), final K/V KiB."""
    header = ["prefix P", "prefill p50 (ms)", "full, all positions p50 / p95 (ms)",
              "full, last position p50 / p95 (ms)", "dynamic cache p50 / p95 (ms)",
              "static cache p50 / p95 (ms)"]
    has_tf = all("transformers" in v for v in result.timings.values())
    if has_tf:
        header.append("transformers cached p50 / p95 (ms)")
    header.append("final K/V (KiB)")
    rows = []
    for P in result.timings:
        row = [str(P), f"{result.p50(P, 'prefill'):.3f}"]
        paths = ["full_all", "full_last", "dynamic", "static"] + (["transformers"] if has_tf else [])
        row += [f"{result.p50(P, p):.3f} / {result.p95(P, p):.3f}" for p in paths]
        row.append(f"{result.kv_kib[P]:g}")
        rows.append(row)
    return Table(header, rows)


def counts_table(result: BenchResult) -> Table:
    """Table: rows counted by hooks on layer 0's ``c_attn`` and on ``lm_head``, against the closed forms."""
    header = ["prefix P", "full recompute: c_attn rows (counted)", "G P + G(G+1)/2",
              "full, all positions: lm_head rows", "full, last position: lm_head rows",
              "cached: c_attn rows (counted)", "cached: lm_head rows", "G"]
    rows = [[str(P), f"{c['full_all_c_attn']:,}", f"{c['formula_full']:,}", f"{c['full_all_lm_head']:,}",
             f"{c['full_last_lm_head']:,}", f"{c['static_c_attn']:,}", f"{c['static_lm_head']:,}",
             f"{c['formula_cached']:,}"] for P, c in result.counts.items()]
    return Table(header, rows)


def flops_table(result: BenchResult) -> Table:
    """Table: modelled MFLOPs of the G steps per path, split into linear layers, attention and LM head."""
    header = ["prefix P", "path", "linear (MFLOP)", "attention (MFLOP)", "LM head (MFLOP)", "total (MFLOP)"]
    rows = []
    for P, f in result.flops.items():
        for path, label in (("full_all", "full, all positions"), ("full_last", "full, last position"),
                            ("cached", "cached")):
            rows.append([str(P), label] + [f"{f[f'{path}_{part}'] / 1e6:.2f}"
                                           for part in ("linear", "attention", "lm_head")]
                        + [f"{f[path] / 1e6:.2f}"])
    return Table(header, rows)


def roofline_table(result: BenchResult) -> Table:
    """Table: per decode path of the roofline model, ms per token, the floor, and the fraction reached."""
    r = result.roofline
    if r is None:
        raise ValueError("this run has no roofline (settings.roofline was False)")
    header = ["path", "decode p50 (ms / token)", "floor (ms / token)", "achieved bandwidth (GB/s)",
              "fraction of measured bandwidth"]
    rows = [[path, f"{t:.2f}", f"{r['floor_ms_per_token']:.2f}",
             f"{r['bytes_per_step'] / (t / 1e3) / 1e9:.2f}", f"{r['fraction'][path]:.2f}"]
            for path, t in r["p50_ms_per_token"].items()]
    return Table(header, rows)


def growth_figure(result: BenchResult):
    """Log-log plot of per-step p50 against total length, with the fitted slopes in the legend."""
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter, NullFormatter

    g = result.growth
    fig, ax = plt.subplots(figsize=(6.6, 4.4))
    labels = {"full_all": "full recompute (all positions)", "dynamic": "cached, dynamic",
              "static": "cached, static"}
    for path, marker in (("full_all", "o"), ("dynamic", "s"), ("static", "^")):
        label = f"{labels[path]}: slope {g['slopes'][path]:.2f}"
        if g["slopes_upper"][path] is not None:
            label += f" (T ≥ {g['upper_from']}: {g['slopes_upper'][path]:.2f})"
        ax.plot(g["lengths"], g["p50_ms"][path], marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(g["lengths"], [str(t) for t in g["lengths"]])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("total length T (positions)")
    ax.set_ylabel("one step, p50 (ms)")
    ax.set_title("Per-step time against length (log-log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


PATH_LABELS = {"prefill": "prefill", "full_all": "full, all positions", "full_last": "full, last position",
               "transformers": "transformers, cached", "dynamic": "kvdoc, dynamic cache",
               "static": "kvdoc, static cache"}
"""Readable names of the timed paths, for tables and figures."""


def timings_figure(result: BenchResult):
    """Bar chart of the G-step p50 per path and prefix length (log scale)."""
    import matplotlib.pyplot as plt

    prefixes = list(result.timings)
    paths = [p for p in ("full_all", "full_last", "transformers", "dynamic", "static")
             if all(p in result.timings[P] for P in prefixes)]
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    width = 0.8 / len(paths)
    for i, path in enumerate(paths):
        xs = [k + (i - (len(paths) - 1) / 2) * width for k in range(len(prefixes))]
        ax.bar(xs, [result.p50(P, path) for P in prefixes], width, label=PATH_LABELS[path])
    ax.set_xticks(range(len(prefixes)), [str(P) for P in prefixes])
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if str(y)[0] in "25" else ""))
    ax.set_xlabel("prefix length P (tokens)")
    ax.set_ylabel(f"{result.settings.new_tokens} steps, p50 (ms)")
    ax.set_title("Consuming G fixed tokens after the prefix")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- CLI


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's options."""
    d = BenchSettings()
    parser.add_argument("--json", metavar="PATH", help="write the full results (raw samples included) here")
    parser.add_argument("--prefix-lens", type=_ints, default=d.prefix_lens, metavar="P,P,...",
                        help=f"prompt lengths (default {','.join(map(str, d.prefix_lens))})")
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens, help=f"G (default {d.new_tokens})")
    parser.add_argument("--samples", type=int, default=d.samples, help=f"timed samples per path (default {d.samples})")
    parser.add_argument("--warmup", type=int, default=d.warmup, help=f"warm-up runs per path (default {d.warmup})")
    parser.add_argument("--threads", type=int, default=d.threads, help=f"torch threads (default {d.threads})")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--growth-lengths", type=_ints, default=d.growth_lengths, metavar="T,T,...")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' GPT-2")
    parser.add_argument("--no-roofline", action="store_true", help="skip the 124M-parameter bandwidth floor")
    parser.add_argument("--roofline-samples", type=int, default=d.roofline_samples)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print the ratios, write ``--json``; returns the exit status."""
    try:
        settings = BenchSettings(
            prefix_lens=args.prefix_lens, new_tokens=args.new_tokens, samples=args.samples,
            warmup=args.warmup, threads=args.threads, seed=args.seed,
            transformers=not args.no_transformers, growth_lengths=args.growth_lengths,
            roofline=not args.no_roofline, roofline_samples=args.roofline_samples)
    except ValueError as err:
        print(f"kvdoc bench: {err}", file=sys.stderr)
        return 2
    result = run_bench(settings, progress=not args.no_progress)
    P = max(result.timings)
    print(f"kvdoc bench: P={P}, G={settings.new_tokens}, {settings.threads} thread(s), FP32, "
          f"{settings.samples} samples per path; {result.environment['cpu']}")
    print(timings_table(result))
    if result.roofline is not None:
        print()
        print(roofline_table(result))
    print()
    print("ratios (higher is better):")
    for key, value in result.ratios.items():
        print(f"  {key:38s} {value:8.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=1)
        print(f"wrote {args.json}")
    bad = [k for k, v in result.ratios.items() if not (math.isfinite(v) and v > 0)]
    return 1 if bad else 0
