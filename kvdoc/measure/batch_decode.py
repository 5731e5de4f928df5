"""Decode at batch ``B``: what one step reads, how its time grows with ``B``, what fits on a device.

One decode step of ``B`` sequences reads every weight once and the K/V of every sequence:
``bytes(B) = W + B * kv(T)``, while its work is ``B * flops(1)``. So the arithmetic intensity
rises with ``B`` while the weights dominate the bytes and levels off once the caches do, past
the batch where ``B * kv(T) = W``. Under tensor parallelism of degree ``t`` each device holds
``H_kv / t`` K/V heads, or, when ``t > H_kv``, one head that ``t / H_kv`` devices hold alike
(vLLM's ``QKVParallelLinear`` replicates them so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvdoc.core.cache import check_int
from kvdoc.core.fast import FastDecoder
from kvdoc.core.model import Decoder

from .costs import kv_per_sequence, step_bytes, step_flops
from .decode_paths import cached_decode
from .kv_bytes import element_size
from .model_caches import ModelCache
from .timing import Prepare, percentile, time_paths


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


# --- published models on an accelerator ---------------------------------------------------------

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

    from .bench import log_log

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
