"""Decode at batch B: the cost model's bytes and FLOPs, fitting on a device, K/V heads under TP."""

from __future__ import annotations

import pytest
import torch

from kvdoc import Decoder, GPTConfig, StaticCache
from kvdoc.measure.costs import (
    H100_SXM,
    Accelerator,
    crossover_batch,
    kv_heads_per_device,
    kv_per_sequence,
    largest_batch,
    preset_kv_per_sequence,
    step_traffic,
    time_batches,
    weight_bytes,
)
from kvdoc.measure.model_caches import MODELS


def test_presets_without_sizes_are_refused():
    with pytest.raises(ValueError, match="does not give hidden"):
        weight_bytes(MODELS["falcon-7b"])


@pytest.mark.parametrize("config", [GPTConfig(), GPTConfig(n_kv_head=1)])
def test_kv_per_sequence_is_what_a_cache_holds(config):
    context = 11
    cache = StaticCache(config, batch_size=1, capacity=context + 1)
    assert kv_per_sequence(config, context, 4) == cache.nbytes()


def test_weights_once_cache_per_sequence():
    model = Decoder(GPTConfig())
    one, many = step_traffic(model, 1, 20), step_traffic(model, 6, 20)
    assert many.weight_bytes == one.weight_bytes
    assert many.kv_bytes == 6 * one.kv_bytes
    assert many.flops == 6 * one.flops
    assert one.intensity < many.intensity  # the same weights serve more tokens


def test_crossover_is_where_the_caches_outweigh_the_weights():
    model = Decoder(GPTConfig())
    per_seq = step_traffic(model, 1, 40).kv_bytes
    b = crossover_batch(step_traffic(model, 1, 40).weight_bytes, per_seq)
    assert step_traffic(model, b, 40).kv_bytes > step_traffic(model, b, 40).weight_bytes
    assert step_traffic(model, b - 1, 40).kv_bytes <= step_traffic(model, b - 1, 40).weight_bytes


def test_largest_batch_fits_and_one_more_does_not():
    llama = MODELS["llama-3-8b"]
    _, resident = weight_bytes(llama)
    per_seq = preset_kv_per_sequence(llama, 8192)
    b = largest_batch(H100_SXM, resident, per_seq)
    budget = int(H100_SXM.memory_bytes * 0.9)
    assert resident + b * per_seq <= budget < resident + (b + 1) * per_seq
    assert largest_batch(Accelerator("small", 10**9, 1.0, ""), resident, per_seq) == 0


@pytest.mark.parametrize("kv_heads, degree, expected", [
    (8, 1, (8, 1)), (8, 4, (2, 1)), (8, 8, (1, 1)), (8, 16, (1, 2)), (1, 8, (1, 8))])
def test_kv_heads_under_tensor_parallelism(kv_heads, degree, expected):
    held, replicas = kv_heads_per_device(kv_heads, degree)
    assert (held, replicas) == expected
    assert held * degree == max(kv_heads, degree)  # every head is held, some more than once


@pytest.mark.parametrize("kv_heads, degree", [(8, 3), (2, 3)])
def test_uneven_sharding_is_refused(kv_heads, degree):
    with pytest.raises(ValueError, match="evenly"):
        kv_heads_per_device(kv_heads, degree)


def test_a_window_caps_the_cache_per_sequence():
    mistral = MODELS["mistral-7b-v0.1"]
    assert preset_kv_per_sequence(mistral, 32768) == preset_kv_per_sequence(mistral, 4096)
    assert preset_kv_per_sequence(mistral, 100) < preset_kv_per_sequence(mistral, 4096)


def test_time_batches_reports_every_batch():
    torch.manual_seed(0)
    times = time_batches(Decoder(GPTConfig()).eval(), context=6, batches=(1, 3), steps=2,
                         samples=3)
    assert sorted(times) == [1, 3]
    assert all(len(v) == 3 and min(v) > 0 for v in times.values())
