"""The cost model of a decode: positions counted on real tensors, modelled FLOPs, bytes read:
facts about the computation, not the machine (the savings page asserts them).

At batch ``B`` a step reads every weight once and every sequence's K/V, ``bytes(B) = W + B *
kv(T)``, for ``B * flops(1)`` of work: the arithmetic intensity rises with ``B`` until the
caches outweigh the weights. Under tensor parallelism of degree ``t`` each device holds ``H_kv /
t`` K/V heads, or, when ``t > H_kv``, one head that ``t / H_kv`` devices hold alike (as vLLM's
``QKVParallelLinear`` replicates them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvdoc.core.cache import check_int
from kvdoc.core.fast import FastDecoder
from kvdoc.core.mla import MLAConfig
from kvdoc.core.model import Decoder, GPTConfig

from .decode_paths import cached_decode
from .kv_bytes import element_size
from .model_caches import ModelCache
from .timing import Prepare, percentile, time_paths


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


def step_flops(config: GPTConfig, past: int, new: int, last_only: bool = False,
               causal: bool = False) -> dict[str, float]:
    """Multiply-add FLOPs (2 per MAC) of one forward, ``new`` tokens after ``past`` cached ones:
    ``linear`` (every layer's projections and MLP), ``attention`` (``Q K^T`` and ``P V``, every
    query against every key, masked ones included, as an explicit mask computes; ``causal``:
    only the keys each query reads) and ``lm_head``; norms and softmax left out.

    >>> step_flops(GPTConfig(), 0, 4, causal=True)["attention"] * 2 == (
    ...     step_flops(GPTConfig(), 0, 4)["attention"] * (1 + 2 + 3 + 4) * 2 // 16)
    True

    >>> f = step_flops(GPTConfig(), past=0, new=1)
    >>> f["attention"] == 2 * 2 * 1 * 1 * 64 * 2       # 2 layers, QK^T and PV, 1 query, 1 key
    True
    >>> from kvdoc.core.model import llama_config
    >>> c = llama_config()
    >>> step_flops(c, 0, 1)["linear"] == 2 * 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
    True
    """
    d, t = config.n_embd, past + new
    q = config.n_head * config.head_dim  # all query heads: d unless head_size is set (Qwen3)
    mlp_matrices = 3 if config.mlp == "swiglu" else 2
    per_token_linear = d * (q + 2 * config.kv_dim) + q * d + mlp_matrices * d * config.n_inner
    linear = 2.0 * config.n_layer * new * per_token_linear
    keys = new * past + new * (new + 1) // 2 if causal else new * t  # score-value pairs
    attention = 2.0 * config.n_layer * 2 * keys * q  # H heads x D_h, for QK^T and for PV
    lm_head = 2.0 * (1 if last_only else new) * d * config.vocab_size
    return {"linear": linear, "attention": attention, "lm_head": lm_head,
            "total": linear + attention + lm_head}


def run_flops(config: GPTConfig, prefix_len: int, new_tokens: int,
              causal: bool = False) -> dict[str, float]:
    """FLOPs of the ``G`` decode steps after a ``P``-token prompt, by path and part."""
    steps = range(1, new_tokens + 1)
    runs = {"full_all": [step_flops(config, 0, prefix_len + j, causal=causal) for j in steps],
            "full_last": [step_flops(config, 0, prefix_len + j, True, causal) for j in steps],
            "cached": [step_flops(config, prefix_len + j - 1, 1, causal=causal) for j in steps]}
    return {name if part == "total" else f"{name}_{part}": sum(p[part] for p in parts)
            for name, parts in runs.items() for part in ("linear", "attention", "lm_head", "total")}


def kv_per_sequence(config: GPTConfig, context: int, size: int) -> int:
    """K/V bytes one sequence adds to a step that attends over ``context + 1`` positions.

    >>> kv_per_sequence(GPTConfig(), 9, 4)  # 2 (K, V) x 2 layers x 10 positions x 64 x 4 bytes
    10240
    """
    return 2 * config.n_layer * (context + 1) * config.kv_dim * size


def step_bytes(model: Decoder, context: int) -> int:
    """Bytes one decode step reads at ``context`` cached positions: every weight (one row of
    each embedding table) and K and V of every layer over ``context + 1`` positions.

    >>> from kvdoc.core.model import llama_config
    >>> step_bytes(Decoder(llama_config()), 0) > 0    # no wpe: positions turn inside attention
    True
    """
    cfg, size = model.config, model.wte.weight.element_size()
    params = {id(p): p for p in model.parameters()}
    tables = [t.weight for t in (model.wte, model.wpe) if t is not None]
    embeddings = {id(t) for t in tables}
    weights = sum(p.numel() for i, p in params.items() if i not in embeddings)
    if model.lm_head.weight is model.wte.weight:  # tied: the head reads the whole table
        weights += model.wte.weight.numel()
    weights += len(tables) * cfg.n_embd  # one embedding row each
    return weights * size + kv_per_sequence(cfg, context, size)


def attention_macs_per_key(config: MLAConfig, absorbed: bool) -> int:
    """Multiply-adds a decode step spends per cached position and layer, all heads: plain,
    up-projecting the latent first; absorbed, over the latent itself (``W_UK``, ``W_UV`` cost
    per query, not per key).

    >>> from kvdoc.core.mla import MLAConfig
    >>> cfg = MLAConfig()
    >>> attention_macs_per_key(cfg, absorbed=False), attention_macs_per_key(cfg, absorbed=True)
    (4256, 288)
    """
    c = config
    if absorbed:
        return c.n_head * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
    up = c.kv_lora_rank * c.n_head * (c.qk_nope_head_dim + c.v_head_dim)
    return up + c.n_head * (c.qk_head_dim + c.v_head_dim)


# --- decode at batch B, and published models on an accelerator ------------------------------

@dataclass(frozen=True)
class Accelerator:
    """A device's memory and bandwidth, as its maker states them (parameters, not measurements)."""

    name: str
    memory_bytes: int
    bandwidth: float
    """Peak memory bandwidth, bytes per second."""
    source: str


H100_SXM = Accelerator("H100 SXM", 80 * 10**9, 3.35e12,
                       "NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s")
"""The accelerator the pages use for worked figures."""


@dataclass(frozen=True)
class StepTraffic:
    """Bytes and FLOPs of one decode step of ``batch`` sequences at ``context`` cached positions."""

    batch: int
    context: int
    weight_bytes: int
    kv_bytes: int
    flops: float

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte read."""
        return self.flops / self.bytes


def step_traffic(model: Decoder, batch: int, context: int) -> StepTraffic:
    """What a decode step of ``batch`` sequences must read and compute.

    >>> from kvdoc.core.model import GPTConfig
    >>> small = step_traffic(Decoder(GPTConfig()), 1, 15)
    >>> big = step_traffic(Decoder(GPTConfig()), 8, 15)
    >>> big.weight_bytes == small.weight_bytes, big.kv_bytes == 8 * small.kv_bytes
    (True, True)
    """
    check_int("batch", batch)
    check_int("context", context, minimum=0)
    size = model.wte.weight.element_size()
    kv = kv_per_sequence(model.config, context, size)
    weights = step_bytes(model, context) - kv  # the cost model's bytes for one sequence
    flops = batch * step_flops(model.config, context, 1, last_only=True)["total"]
    return StepTraffic(batch, context, weights, batch * kv, flops)


def time_batches(model: Decoder, context: int, batches: tuple[int, ...], steps: int,
                 samples: int, seed: int = 0) -> dict[int, list[float]]:
    """Milliseconds per fast decode step, per batch size, at ``context`` zero-filled positions."""
    fast = FastDecoder(model)
    g = torch.Generator().manual_seed(seed)
    weight = model.wte.weight
    paths: dict[str, Prepare] = {}
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, context + steps), generator=g)
        cache = model.new_cache(batch, "static", context + steps)
        rows = torch.zeros(batch, model.config.n_kv_head, context, model.config.head_dim,
                           dtype=weight.dtype, device=weight.device)
        for layer in range(model.config.n_layer):
            cache.update(layer, rows, rows, 0)
        cache.finish(context)
        paths[str(batch)] = cached_decode(fast, cache, ids, context, steps)[0]
    times = time_paths(paths, samples=samples, warmup=1)
    return {int(b): [t / steps for t in ts] for b, ts in times.items()}


def weight_bytes(preset: ModelCache, dtype: str = "bfloat16") -> tuple[int, int]:
    """``(read per step, resident)`` weight bytes of a Llama-family preset
    (:attr:`~kvdoc.measure.layer_caches.ModelCache.parameters`): a lookup reads one row of the
    (untied) embedding table, not all of it.

    >>> from kvdoc.measure.model_caches import model_cache
    >>> weight_bytes(model_cache("Llama-3.1-8B"))      # 128,256 x 4,096 of 8.03 B not read
    (15009849344, 16060522496)
    """
    if preset.parameters is None:
        raise ValueError(f"{preset.name} does not give hidden, intermediate and vocab sizes")
    size = element_size(dtype)
    return (preset.parameters - preset.vocab * preset.hidden) * size, preset.parameters * size


def largest_batch(device: Accelerator, resident_weights: int, kv_sequence: int,
                  usable: float = 0.9) -> int:
    """Sequences whose caches fit beside the weights in ``usable`` of the device's memory (vLLM's
    default ``gpu_memory_utilization``): an upper bound, activations also take memory.

    >>> largest_batch(Accelerator("toy", 100, 1.0, ""), 50, 10, usable=1.0)
    5
    """
    free = int(device.memory_bytes * usable) - resident_weights
    return max(0, free // kv_sequence)


def bandwidth_bound_ms(device: Accelerator, bytes_per_step: int) -> float:
    """The least time a step can take if it is bound by reading ``bytes_per_step`` from memory."""
    return bytes_per_step / device.bandwidth * 1e3


def kv_heads_per_device(kv_heads: int, degree: int) -> tuple[int, int]:
    """``(K/V heads each device holds, devices that hold each head)`` under tensor parallelism;
    a ValueError where neither of ``degree`` and ``kv_heads`` divides the other.

    >>> kv_heads_per_device(8, 2), kv_heads_per_device(8, 16), kv_heads_per_device(1, 4)
    ((4, 1), (1, 2), (1, 4))
    """
    check_int("kv_heads", kv_heads)
    check_int("degree", degree)
    if degree <= kv_heads:
        if kv_heads % degree:
            raise ValueError(f"{kv_heads} K/V heads cannot be split evenly over {degree} devices")
        return kv_heads // degree, 1
    if degree % kv_heads:
        raise ValueError(f"{degree} devices cannot each hold one of {kv_heads} K/V heads "
                         "replicated evenly")
    return 1, degree // kv_heads


def preset_kv_per_sequence(preset: ModelCache, context: int, dtype: str = "bfloat16",
                           degree: int = 1) -> int:
    """K/V bytes one sequence at ``context`` positions puts on each of ``degree`` devices.

    >>> from kvdoc.measure.model_caches import model_cache
    >>> llama = model_cache("Llama-3-8B")
    >>> preset_kv_per_sequence(llama, 1000, degree=2) * 2 == preset_kv_per_sequence(llama, 1000)
    True
    """
    heads, _ = kv_heads_per_device(preset.kv_heads, degree)
    return preset.kv_bytes(context, 1, dtype) * heads // preset.kv_heads  # the device's share


def crossover_batch(weights: int, kv_sequence: int) -> int:
    """The smallest batch whose caches outweigh the weights a step reads.

    >>> crossover_batch(100, 30)
    4
    """
    return math.floor(weights / kv_sequence) + 1


def batch_figure(times: dict[int, list[float]]):
    """Median milliseconds per step and per token against batch size (log-log)."""
    import matplotlib.pyplot as plt

    from .tables import log_log

    batches = sorted(times)
    step = [percentile(times[b], 50) for b in batches]
    fig, ax = plt.subplots(figsize=(6.6, 4.2))
    ax.plot(batches, step, marker="o", label="one step (all B sequences)")
    ax.plot(batches, [s / b for s, b in zip(step, batches, strict=True)], marker="s",
            label="per token (step / B)")
    log_log(ax, batches, "batch size B (sequences decoded together)", "time, median (ms)",
            "Decode step time against batch size (log-log)")
    fig.tight_layout()
    return fig
