"""The decode paths the benchmark times: one model, one token stream, each path a prepare/run pair.

Per path, an untimed ``prepare`` resets its cache and returns the call to time (for
:func:`kvdoc.measure.timing.time_paths`), and a second call returns the path's stacked logits,
to check that every timed path computes the same function.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kvdoc.core.cache import KVCache
from kvdoc.core.fast import FastDecoder
from kvdoc.core.model import Decoder, GPTConfig

from .ablation import ABLATION, GUARANTEES, LeanStep
from .dispatch import count_ops
from .timing import Prepare


def token_stream(config: GPTConfig, length: int, seed: int) -> torch.Tensor:
    """A seeded ``[1, length]`` stream of token ids."""
    return torch.randint(0, config.vocab_size, (1, length),
                         generator=torch.Generator().manual_seed(seed))


def build_models(config: GPTConfig, seed: int, transformers: bool,
                 tie: bool = False) -> tuple[Decoder, Any]:
    """A kvdoc decoder and, if asked, transformers' GPT-2 with the same random weights (both eval;
    ``tie``: the LM head shares ``wte``'s weight, as in GPT-2's checkpoints).

    transformers' model is built on the meta device and receives the decoder's weights: a
    second random initialisation would cost seconds at GPT-2 small's size. A ``RuntimeError``
    if the two models' logits disagree on a short input.
    """
    torch.manual_seed(seed)
    with torch.inference_mode(False):  # parameters with version counters, which FastDecoder watches
        model = Decoder(config).eval()
    if tie:
        model.lm_head.weight = model.wte.weight
    if not transformers:
        return model, None
    with warnings.catch_warnings():  # transformers imports tqdm.auto, which warns inside a notebook
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import GPT2LMHeadModel

    from kvdoc.interop.hf_config import gpt2_config
    from kvdoc.interop.hf_weights import CONV1D_WEIGHTS

    hf_config = gpt2_config(config)
    hf_config.tie_word_embeddings = tie
    with torch.device("meta"):
        hf = GPT2LMHeadModel(hf_config)
    with torch.inference_mode(False):
        hf = hf.to_empty(device="cpu")
    ours = model.state_dict()
    state = {}
    for key in hf.state_dict():
        name = key.removeprefix("transformer.")
        state[key] = ours[name].t() if name.endswith(CONV1D_WEIGHTS) else ours[name]
    with torch.inference_mode(False):
        hf.load_state_dict(state)
    if tie:
        hf.tie_weights()
    hf.eval()
    with torch.inference_mode():
        ids = token_stream(config, 5, seed)
        ours_logits = model(ids).logits
        diff = float((hf(ids).logits - ours_logits).abs().max())
    # A weight copied wrongly changes the logits by their own size; FP32 rounding over 12 layers
    # of width 768 moves them by far less than a thousandth of it, on any CPU.
    if not diff <= 1e-3 * max(1.0, float(ours_logits.abs().max())):
        raise RuntimeError("transformers' GPT-2 and kvdoc disagree after copying weights: "
                           f"{diff:.3e}")
    return model, hf


def rewound(reset: Callable[[], object],
            run: Callable[[], Any]) -> tuple[Prepare, Callable[[], Any]]:
    """A timed path: ``prepare`` calls ``reset`` (untimed: back to the prompt) and returns
    ``run``; the second call runs it once, for its logits."""
    def prepare() -> Callable[[], Any]:
        reset()
        return run
    return prepare, lambda: prepare()()


def prompt_cache(model: Decoder, ids: torch.Tensor, prefix_len: int, steps: int,
                 kind: str = "static") -> KVCache:
    """A cache of ``kind`` holding the first ``prefix_len`` tokens of ``ids``, room for
    ``steps`` more."""
    return model(ids[:, :prefix_len], model.new_cache(ids.shape[0], kind,
                                                      capacity=prefix_len + steps))[1]


def cached_decode(step: Callable[..., Any], cache: KVCache, ids: torch.Tensor, prefix_len: int,
                  steps: int) -> tuple[Prepare, Callable[[], torch.Tensor]]:
    """``steps`` single-token calls of ``step`` (the model or a fast step) after ``cache``,
    which holds the first ``prefix_len`` tokens of ``ids`` and is cropped back to them before
    each run (untimed; a dynamic cache, which no call changes, already holds just them)."""
    P, G = prefix_len, steps

    def run() -> torch.Tensor:
        work, out = cache, []
        for j in range(G):
            logits, work = step(ids[:, P + j:P + j + 1], work)
            out.append(logits)
        return torch.cat(out, 1)
    return rewound(lambda: cache.crop(P), run)


def compiled_decode(step: Callable[..., Any], model: Decoder, ids: torch.Tensor,
                    prefix_len: int, steps: int
                    ) -> tuple[Prepare | None, Callable[[], torch.Tensor] | None, dict[str, Any]]:
    """:func:`cached_decode` of ``step``, a ``torch.compile`` of the model, run once untimed
    here so that its compilation stays out of the timed samples.

    This is gpt-fast's fast step (``torch.compile`` over one forward and a static cache) over
    kvdoc's forward, without ``fullgraph``: the model's checks raise their own ``ValueError``.
    The first run's seconds (``first_run_s``) are the compile time; ``graphs`` counts what
    dynamo compiled. A failure to compile is returned as ``error`` with no path, so that the
    benchmark says so instead of stopping.
    """
    cache = prompt_cache(model, ids, prefix_len, steps)
    prepare, run = cached_decode(step, cache, ids, prefix_len, steps)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    try:
        run()
    except Exception as err:  # any failure of the compiler is the row's answer
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return None, None, {"error": f"{type(err).__name__}: {first}"}
    info = {"first_run_s": time.perf_counter() - start,
            "graphs": counters["stats"]["unique_graphs"] - graphs}
    return prepare, run, info


def lean_decode(lean: LeanStep, model: Decoder, ids: torch.Tensor, prefix_len: int,
                steps: int) -> tuple[Prepare, Callable[[], torch.Tensor]]:
    """``steps`` calls of a :class:`~kvdoc.measure.ablation.LeanStep` after the prompt's K/V,
    rewound to position ``P`` before each run as :func:`cached_decode` crops its cache."""
    P, G = prefix_len, steps
    lean.start(prompt_cache(model, ids, P, 0))

    def run() -> torch.Tensor:
        return torch.cat([lean(ids[:, P + j:P + j + 1]) for j in range(G)], 1)
    return rewound(lambda: lean.rewind(P), run)


def decode_paths(model: Decoder, hf: Any, ids: torch.Tensor, prefix_len: int, steps: int,
                 full: bool, fast: FastDecoder | None, compiled: Callable[..., Any] | None = None
                 ) -> tuple[dict[str, Prepare], dict[str, Callable[[], torch.Tensor]],
                            dict[str, Any] | None]:
    """The timed paths for one prefix, a call returning each one's stacked logits, and what
    compiling cost (:func:`compiled_decode`; None without ``compiled``).

    Each decode path consumes the last ``G`` tokens of ``ids`` one at a time after a cache
    holding the first ``P``. ``full`` adds prefill and the two full-recompute paths, ``hf``
    transformers' GPT-2, ``fast`` the fast step and the lean step, ``compiled`` its own path.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig()).eval()
    >>> ids = token_stream(model.config, 6, seed=0)
    >>> prepare, runs, _ = decode_paths(model, None, ids, 4, 2, True, FastDecoder(model))
    >>> sorted(prepare)
    ['dynamic', 'fast', 'full_all', 'full_last', 'lean', 'prefill', 'static']
    >>> runs["fast"]().shape  # [1, G, V]
    torch.Size([1, 2, 97])
    """
    P, G = prefix_len, steps
    prompt = ids[:, :P]
    prepare: dict[str, Prepare] = {}
    runs: dict[str, Callable[[], torch.Tensor]] = {}
    if full:
        def full_run(last_only: bool) -> Callable[[], torch.Tensor]:
            return lambda: torch.cat([model(ids[:, :P + j], last_only=last_only).logits[:, -1:]
                                      for j in range(1, G + 1)], 1)

        def prefill_prepare() -> Callable[[], Any]:
            cache = model.new_cache(1, "dynamic")
            return lambda: model(prompt, cache, last_only=True)
        prepare["prefill"] = prefill_prepare
        for name, last_only in (("full_all", False), ("full_last", True)):
            runs[name] = full_run(last_only)
            prepare[name] = lambda run=runs[name]: run
    for name, step, kind in (("dynamic", model, "dynamic"), ("static", model, "static"),
                             ("fast", fast, "static")):
        if step is not None:
            cache = prompt_cache(model, ids, P, G, kind)
            prepare[name], runs[name] = cached_decode(step, cache, ids, P, G)
    if fast is not None:
        lean = LeanStep(model, capacity=P + G)
        prepare["lean"], runs["lean"] = lean_decode(lean, model, ids, P, G)
    compile_info = None
    if compiled is not None:
        compiled_prepare, compiled_run, compile_info = compiled_decode(compiled, model, ids, P, G)
        if compiled_prepare is not None:
            prepare["compiled"], runs["compiled"] = compiled_prepare, compiled_run
    if hf is not None:
        hf_cache = hf(prompt, use_cache=True).cache

        def hf_run() -> torch.Tensor:
            out = []
            for j in range(G):
                out.append(hf(ids[:, P + j:P + j + 1], cache=hf_cache, use_cache=True).logits)
            return torch.cat(out, 1)

        # transformers' cache grows in place; crop takes the (negative) number of positions
        # to drop
        prepare["transformers"], runs["transformers"] = rewound(
            lambda: hf_cache.crop(P - hf_cache.get_seq_length()), hf_run)
    return prepare, runs, compile_info


def ablation_paths(model: Decoder, ids: torch.Tensor, prefix_len: int,
                   steps: int) -> tuple[dict[str, Prepare], dict[str, Callable[[], torch.Tensor]]]:
    """Per :data:`~kvdoc.measure.ablation.ABLATION` variant, the lean step with that change
    undone, and per :data:`~kvdoc.measure.ablation.GUARANTEES` variant, the fast step with that
    guarantee taken away, as in :func:`decode_paths`."""
    capacity = prefix_len + steps
    pairs = {name: lean_decode(LeanStep(model, capacity, **kw), model, ids, prefix_len, steps)
             for name, kw in ABLATION.items()}
    pairs.update({name: cached_decode(cls(model), prompt_cache(model, ids, prefix_len, steps),
                                      ids, prefix_len, steps)
                  for name, cls in GUARANTEES.items()})
    return {k: p for k, (p, _) in pairs.items()}, {k: r for k, (_, r) in pairs.items()}


def ops_per_step(model: Decoder, fast: FastDecoder, hf: Any, ids: torch.Tensor) -> dict[str, int]:
    """ATen operators of one decode step of the last token of ``ids`` ([1, P + 1]), per path
    (``full_all``: one full recompute of all ``P + 1`` positions)."""
    prompt, token = ids[:, :-1], ids[:, -1:]
    out = {"full_all": sum(count_ops(lambda: model(ids)).values())}
    for name, kind, step in (("dynamic", "dynamic", model), ("static", "static", model),
                             ("fast", "static", fast)):
        cache = prompt_cache(model, ids, prompt.shape[1], 1, kind)
        out[name] = sum(count_ops(lambda step=step, cache=cache: step(token, cache)).values())
    lean = LeanStep(model, capacity=ids.shape[1])
    lean.start(prompt_cache(model, ids, prompt.shape[1], 1))
    out["lean"] = sum(count_ops(lambda: lean(token)).values())
    if hf is not None:
        hf_cache = hf(prompt, use_cache=True).cache
        out["transformers"] = sum(
            count_ops(lambda: hf(token, cache=hf_cache, use_cache=True)).values())
    return out
