"""The decode paths the benchmark times: one model, one token stream, each path a prepare/run pair.

Per path, an untimed ``prepare`` resets its cache and returns the call to time, and a second
call returns the path's stacked logits, to check that every timed path computes the same
function. :class:`LeanStep` is the fast step's arithmetic and nothing else: the time the fast
step takes beyond it is what its guarantees cost. An :data:`ABLATION` variant undoes one of the
fast step's changes, a :data:`GUARANTEES` variant takes a guarantee away (timed only).

>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig(n_kv_head=2)).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9]])
>>> lean = LeanStep(model, capacity=8)
>>> lean.start(model(ids[:, :4], model.new_cache(1, "static", capacity=8)).cache)
>>> logits = lean(ids[:, 4:])                       # [1, 1, V]: position 4
>>> torch.allclose(logits[:, 0], model(ids).logits[:, 4], atol=1e-5)
True
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from kvdoc.core.cache import KVCache
from kvdoc.core.fast import FastDecoder
from kvdoc.core.model import Decoder, DecoderOutput, GPTConfig

from .dispatch import count_ops
from .timing import Prepare

ABLATION = {"no_pretranspose": {"pretranspose": False}, "matmul_attention": {"attention": "matmul"}}
"""The lean step with one change undone: :class:`LeanStep`'s keywords per variant."""


class UnwatchedFast(FastDecoder):
    """The fast step without its watch on the model's weights: it would serve stale copies."""

    def _stale(self) -> bool:
        return False


class UncheckedFast(FastDecoder):
    """The fast step without its input checks and its hand-over to the model."""

    def __call__(self, idx: torch.Tensor, cache: KVCache, **options: object) -> DecoderOutput:
        if self._stale():
            self.refresh()
        return self._step(idx, cache)


class UnguardedFast(FastDecoder):
    """The fast step with neither guarantee: only its write path separates it from lean."""

    def __call__(self, idx: torch.Tensor, cache: KVCache, **options: object) -> DecoderOutput:
        return self._step(idx, cache)


GUARANTEES: dict[str, type[FastDecoder]] = {"unwatched": UnwatchedFast,
                                             "unchecked": UncheckedFast,
                                             "unguarded": UnguardedFast}
"""The fast step with one guarantee taken away, or both (``unguarded``), per variant."""


class LeanStep:
    """One token per row for a GPT-2-style decoder, nothing around the arithmetic, up to
    ``capacity`` positions; ``pretranspose``: weights stored ``[in, out]`` (else read transposed,
    as ``F.linear`` does); ``attention``: ``"sdpa"`` or ``"matmul"`` (scale, softmax, matmul)."""

    def __init__(self, model: Decoder, capacity: int, *, pretranspose: bool = True,
                 attention: Literal["sdpa", "matmul"] = "sdpa") -> None:
        cfg = model.config
        gpt2 = ("learned", "layernorm", "gelu", None)
        if (cfg.position, cfg.norm, cfg.mlp, cfg.sliding_window) != gpt2:
            raise ValueError("LeanStep runs GPT-2's architecture only (learned positions, "
                             "LayerNorm, GELU, no window)")
        self.config, self.capacity, self.attention = cfg, capacity, attention
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        with torch.no_grad():
            def w(linear: torch.nn.Linear) -> torch.Tensor:  # [in, out], as the step reads it
                weight = linear.weight.detach()
                return weight.t().contiguous() if pretranspose else weight.clone().t()

            def b(linear: torch.nn.Linear) -> torch.Tensor:
                return linear.bias.detach().view(1, -1).clone()

            self.layers = [
                (blk.ln_1.weight.detach(), blk.ln_1.bias.detach(), w(blk.attn.c_attn),
                 b(blk.attn.c_attn), w(blk.attn.c_proj), b(blk.attn.c_proj),
                 blk.ln_2.weight.detach(), blk.ln_2.bias.detach(), w(blk.mlp.c_fc), b(blk.mlp.c_fc),
                 w(blk.mlp.c_proj), b(blk.mlp.c_proj))
                for blk in model.h]
            self.ln_f = (model.ln_f.weight.detach(), model.ln_f.bias.detach())
            self.w_head = w(model.lm_head)  # [d, V]
            self.wte, self.wpe = model.wte.weight.detach(), model.wpe.weight.detach()
        self.pos = 0

    def start(self, cache: KVCache) -> None:
        """Copy ``cache``'s K/V (the prompt) into fresh buffers."""
        cfg, P = self.config, cache.seq_len
        shape = (cache.batch_size, cfg.n_kv_head, self.capacity, cfg.head_dim)
        self.k = [self.wte.new_zeros(shape) for _ in self.layers]
        self.v = [self.wte.new_zeros(shape) for _ in self.layers]
        for i in range(cfg.n_layer):
            k, v = cache.layer(i)
            self.k[i][:, :, :P], self.v[i][:, :, :P] = k, v
        self.pos = P

    def rewind(self, pos: int) -> None:
        """Go back to position ``pos``: the positions after it are written again."""
        self.pos = pos

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, V]`` of the tokens ``idx`` (``[B, 1]``) at position ``self.pos``."""
        cfg = self.config
        B, P, D_h = idx.shape[0], self.pos, cfg.head_dim
        shape, eps = (cfg.n_embd,), cfg.layer_norm_epsilon
        heads, group = (cfg.n_head, cfg.n_kv_head, cfg.n_kv_head), cfg.n_head // cfg.n_kv_head
        x = self.wte.index_select(0, idx.view(B)).add_(self.wpe[P])  # [B, d]
        for i, (ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w_fc, b_fc, w_proj,
                b_proj) in enumerate(self.layers):
            h = torch.layer_norm(x, shape, ln1_w, ln1_b, eps)
            q, k, v = torch.addmm(b_qkv, h, w_qkv).view(B, -1, 1, D_h).split_with_sizes(heads, 1)
            K, V = self.k[i], self.v[i]
            K.narrow(2, P, 1).copy_(k)
            V.narrow(2, P, 1).copy_(v)
            k, v = K.narrow(2, 0, P + 1), V.narrow(2, 0, P + 1)  # [B, H_kv, P + 1, D_h]
            if group > 1:  # a K/V head's query heads as rows: [B, H_kv, group, D_h]
                q = q.view(B, -1, group, D_h)
            if self.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v)
            else:
                s = torch.matmul(q, k.transpose(2, 3)).mul_(self.scale)  # [B, H_kv, group, P + 1]
                y = torch.matmul(s.softmax(-1), v)
            x = torch.addmm(x, y.view(B, -1), w_o).add_(b_o)
            h = torch.layer_norm(x, shape, ln2_w, ln2_b, eps)
            u = F.gelu(torch.addmm(b_fc, h, w_fc), approximate="tanh")
            x = torch.addmm(x, u, w_proj).add_(b_proj)
        self.pos = P + 1
        h = torch.layer_norm(x, shape, *self.ln_f, eps)
        return torch.mm(h, self.w_head).view(B, 1, -1)


def token_stream(config: GPTConfig, length: int, seed: int) -> torch.Tensor:
    """A seeded ``[1, length]`` stream of token ids."""
    return torch.randint(0, config.vocab_size, (1, length),
                         generator=torch.Generator().manual_seed(seed))


def build_models(config: GPTConfig, seed: int, transformers: bool,
                 tie: bool = False) -> tuple[Decoder, Any]:
    """A kvdoc decoder and, if asked, transformers' GPT-2 (built on the meta device) with the
    same random weights (``tie``: head and ``wte`` shared); a RuntimeError if they disagree."""
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
    """A timed path (``prepare``: ``reset`` untimed, returning ``run``) and one run of it."""
    def prepare() -> Callable[[], Any]:
        reset()
        return run
    return prepare, lambda: prepare()()


def prompt_cache(model: Decoder, ids: torch.Tensor, prefix_len: int, steps: int,
                 kind: str = "static") -> KVCache:
    """A cache of ``kind`` holding ``ids[:, :prefix_len]``, room for ``steps`` more."""
    return model(ids[:, :prefix_len], model.new_cache(ids.shape[0], kind,
                                                      capacity=prefix_len + steps))[1]


def cached_decode(step: Callable[..., Any], cache: KVCache, ids: torch.Tensor, prefix_len: int,
                  steps: int) -> tuple[Prepare, Callable[[], torch.Tensor]]:
    """``steps`` single-token calls of ``step`` after ``cache``, cropped back before each run."""
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
    """:func:`cached_decode` of ``step``, a ``torch.compile`` of the model, run once untimed: its
    ``first_run_s`` and dynamo's ``graphs``, or, failing to compile, an ``error`` and no path."""
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
    """``steps`` calls of a :class:`LeanStep` after the prompt's K/V, rewound before each run."""
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
    """The :data:`ABLATION` and :data:`GUARANTEES` variants' paths, as :func:`decode_paths`'."""
    capacity = prefix_len + steps
    pairs = {name: lean_decode(LeanStep(model, capacity, **kw), model, ids, prefix_len, steps)
             for name, kw in ABLATION.items()}
    pairs.update({name: cached_decode(cls(model), prompt_cache(model, ids, prefix_len, steps),
                                      ids, prefix_len, steps)
                  for name, cls in GUARANTEES.items()})
    return {k: p for k, (p, _) in pairs.items()}, {k: r for k, (_, r) in pairs.items()}


def ops_per_step(model: Decoder, fast: FastDecoder, hf: Any, ids: torch.Tensor) -> dict[str, int]:
    """ATen operators of one decode step of ``ids``' last token, per path."""
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
