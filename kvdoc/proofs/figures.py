"""Measurements counted: the figures :mod:`kvdoc.measure` gives the pages against the tensors of
a filled cache, and FLOPs against a count of the operations that ran.

The ``counted`` scenario fills a cache of the case's kind at batch ``B`` and 1 and compares, in
integers (exact on every machine), the byte figures per layer, token, sequence and batch against
the tensors held, and :func:`~kvdoc.measure.costs.step_flops` against ``2 x rows x in x out``
over every ``nn.Linear`` call and ``4 B H C T D_h`` over every attention's ``(q, k)``. A broken
variant replaces a function of :data:`MEASURES` through ``case.caches``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from kvdoc.core.model import Decoder, GPTConfig
from kvdoc.measure.costs import kv_per_sequence, step_flops, step_traffic
from kvdoc.measure.kv_bytes import kv_bytes_for_config
from kvdoc.measure.model_caches import config_cache

from .cache_invariants import held_tensors, tensor_bytes
from .case import Case, scenario
from .compare import held_rows

MEASURES = {"config_cache": config_cache, "step_traffic": step_traffic}
# kinds whose tensors hold exactly their positions (a static cache's capacity and a pool's
# blocks are the ``bytes`` check's)
KINDS = ("dynamic", "window", "hybrid")
RINGS = ("window", "hybrid")


def byte_problems(case: Case) -> list[str]:
    """What disagrees between the byte figures and the filled caches' tensors."""
    cfg, dtype = case.model.config, case.dtype
    measure = {**MEASURES, **{k: v for k, v in case.caches.items() if k in MEASURES}}
    T, B = case.ids.shape[1], case.ids.shape[0]
    model = measure["config_cache"](cfg, windows=case.kind in RINGS)
    problems = []
    for batch in sorted({1, B}):
        cache = case.feed(case.ids[:batch], case.chunks[-1]).cache
        real = tensor_bytes(held_tensors(cache))
        layers = [tensor_bytes(list(held_rows(cache, i))) for i in range(cache.n_layer)]
        if sum(layers) != real:
            problems.append(f"batch {batch}: layers hold {sum(layers)} bytes, the cache {real}")
        s = torch.empty((), dtype=dtype).element_size()
        for i, (layer, got) in enumerate(zip(model.layers, layers, strict=True)):
            want = batch * s * layer.per_token * (T if layer.window is None
                                                  else min(T, layer.window))
            if got != want:
                problems.append(f"batch {batch}, layer {i}: {got} bytes held, formula {want}")
        figures = {"kv_bytes(T, B)": model.kv_bytes(T, batch, dtype),
                   "B x kv_bytes(T, 1)": batch * model.kv_bytes(T, 1, dtype)}
        if case.kind == "dynamic":
            figures["B x T x bytes_per_token"] = batch * T * model.bytes_per_token(dtype)
            if isinstance(cfg, GPTConfig):
                figures["kv_bytes_for_config"] = kv_bytes_for_config(cfg, batch, T, dtype)
            if isinstance(cfg, GPTConfig) and cfg.sliding_window is None:
                # a decode step at context T - 1 reads the T positions this cache holds
                figures["step_traffic.kv_bytes"] = measure["step_traffic"](
                    case.model, batch, T - 1).kv_bytes
                figures["B x kv_per_sequence"] = batch * kv_per_sequence(cfg, T - 1, s)
        problems += [f"batch {batch}: {name} {want}, the tensors hold {real}"
                     for name, want in figures.items() if want != real]
    return problems


def _counting(model: Decoder) -> tuple[Decoder, list[tuple[torch.Size, torch.Size]], list[int]]:
    """A copy of ``model`` recording its attentions' ``(q, k)`` shapes and its linear FLOPs."""
    clone, seen, linear = copy.deepcopy(model), [], []
    for block in clone.h:
        attend = block.attn.attend

        def record(q, k, v, *args, attend=attend, **kwargs):
            seen.append((q.shape, k.shape))
            return attend(q, k, v, *args, **kwargs)
        block.attn.attend = record
    for module in clone.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, args, y: linear.append(
                2 * (y.numel() // m.out_features) * m.in_features * m.out_features))
    return clone, seen, linear


def flop_problems(case: Case) -> list[str]:
    """What disagrees between :func:`step_flops` and a count of a forward of 13 tokens, then 5."""
    past, new = 13, 5
    model, seen, linear = _counting(case.model)
    ids, problems, B = case.ids, [], case.ids.shape[0]
    _, cache = model(ids[:, :past], case.new_cache())
    for before, C, cached in ((0, past, None), (past, new, cache)):
        seen.clear()
        linear.clear()
        model(ids[:, before:before + C], cached)
        want = step_flops(model.config, before, C)
        attention = sum(4 * q[0] * q[1] * q[2] * k[2] * q[3] for q, k in seen)
        for name, got, formula in (("linear + lm_head", sum(linear),
                                    B * (want["linear"] + want["lm_head"])),
                                   ("attention", attention, B * want["attention"])):
            if got != formula:
                problems.append(f"{C} tokens after {before}: {name} counted {got}, "
                                f"step_flops x B gives {formula:.0f}")
    return problems


@scenario("counted", {"counted": "byte figures (per layer incl. MLA's latent and rotary key, per "
                                 "token, sequence, batch B) vs a filled cache's tensors; "
                                 "step_flops vs counted operations"})
def _scenario(case: Case, out: list) -> None:
    if case.impl != "model" or case.kind not in KINDS:
        out.append(case.result("counted", None, 0.0, "counted on the model's dynamic, window "
                               "and hybrid caches, whose tensors hold exactly their positions"))
        return
    problems = byte_problems(case)
    flops = isinstance(case.model.config, GPTConfig) and case.kind == "dynamic"
    if flops:
        problems += flop_problems(case)
    detail = problems[0] if problems else (
        f"bytes per layer, token, sequence and batch {case.ids.shape[0]} vs the tensors of "
        f"{case.ids.shape[1]} positions" + ("; step_flops vs a count" if flops else ""))
    out.append(case.result("counted", not problems, 0.0 if not problems else float("inf"),
                           detail))
