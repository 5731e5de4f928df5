"""``python -m kvdoc memory``: K/V cache bytes from explicit sizes or a published model's config.

For sizes given on the command line (L alike layers), a published model
(:data:`~kvdoc.measure.model_caches.MODELS`) or a ``config.json``, it prints the formula with
every factor, so its product can be redone by hand, the bytes in exact, binary and decimal
units, and past a plain model each term apart and the same layers all full attention::

    python -m kvdoc memory --batch 1 --layers 32 --seq-len 4096 --kv-heads 8 --head-dim 128 \\
        --dtype float16
    python -m kvdoc memory --model Llama-3-8B --seq-len 8192
    python -m kvdoc memory --model Llama-3-8B        # T: the model's context, 8,192
    python -m kvdoc memory --config path/to/config.json --seq-len 32768 --dtype bfloat16
    python -m kvdoc memory --config path/to/model-folder      # its config.json
    python -m kvdoc memory --model Llama-3.1-8B --memory 80   # sequences that fit, after weights
    python -m kvdoc memory --model Llama-3-8B --dtype fp8 --fp8-scales per-head

The docs' calculator (:func:`calculator_data`) shows what it prints, from the same functions.
The module imports no torch: the command starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from .kv_bytes import (
    ELEMENT_BYTES,
    FP8_SCALE_GRANULARITIES,
    binary_size,
    decimal_size,
    dtype_name,
    element_size,
    format_bytes,
)
from .model_caches import MODELS, LayerCache, ModelCache, attention_layer, model_cache, read_config

#: The longest ``--seq-len`` (and ``--window``): attention kernels index a sequence's tokens
#: with 32-bit integers (FlashAttention's ``cu_seqlens``), so a longer one is a typo.
MAX_SEQ_LEN = 2**31 - 1


def positive_arg(text: str) -> int:
    """An argparse type: a positive integer, commas and underscores allowed (``1,024``)."""
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _length_arg(text: str) -> int:
    value = positive_arg(text)
    if value > MAX_SEQ_LEN:
        raise argparse.ArgumentTypeError(
            f"{value:,} positions is past any sequence an attention kernel indexes "
            f"(at most 2**31 - 1 = {MAX_SEQ_LEN:,}, 32-bit token indices)")
    return value


def _gib_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not 0 < value < 2**40:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return value


def _refusing(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` as an argparse type: its ValueError's message is the option's error."""
    def arg(text: str) -> object:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m kvdoc memory``."""
    parser.description = ("K/V cache bytes = 2 x B x L x T x H_kv x D x s, from explicit sizes; "
                          "for a published model (--model) or a transformers config.json "
                          "(--config), the sum of what each layer keeps: all T positions, a "
                          "window of them, an MLA latent (and indexer keys), a linear-attention "
                          "or Mamba-2 state, or DeepSeek-V4's compressed entries; each term "
                          "apart, beside the same layers all full attention.")
    parser.add_argument("--model", type=_refusing(model_cache), metavar="NAME",
                        help=f"a published config, as its model card names it: one of "
                             f"{len(MODELS)}, e.g. Llama-3.1-8B, Gemma-3-27B, DeepSeek-V3, "
                             "gpt-oss-20b, Qwen3-Next-80B-A3B (--list-models shows them all)")
    parser.add_argument("--config", type=_refusing(read_config), metavar="PATH",
                        help="a transformers config.json or its folder (GQA, MLA, "
                             "sliding-window, Gated DeltaNet, Mamba-2 and DeepSeek-V3.2 / V4 "
                             "layers)")
    parser.add_argument("--batch", type=positive_arg, default=1, metavar="B",
                        help="sequences (default 1)")
    parser.add_argument("--layers", type=positive_arg, metavar="L", help="decoder layers")
    parser.add_argument("--seq-len", type=_length_arg, metavar="T",
                        help="cached positions per sequence (default with --model or --config: "
                             "the model's context; a longer one is computed, with a warning)")
    parser.add_argument("--kv-heads", type=positive_arg, metavar="H",
                        help="K/V heads per layer (not query heads)")
    parser.add_argument("--head-dim", type=positive_arg, metavar="D", help="size of one head")
    parser.add_argument("--dtype", type=_refusing(dtype_name), default="float16", metavar="NAME",
                        help="element type: float32, float16, bfloat16, float8_e4m3fn, ... "
                             "(default float16)")
    parser.add_argument("--window", type=_length_arg, metavar="W",
                        help="sliding window: each layer keeps only the last W positions "
                             "(with --model or --config: caps the model's own windows)")
    parser.add_argument("--memory", type=_gib_arg, metavar="GIB",
                        help="also print how many sequences of T fit in GIB GiB of device "
                             "memory, after the weights")
    parser.add_argument("--weights", type=_gib_arg, metavar="GIB",
                        help="with --memory: GiB the weights take (default: the model's "
                             "parameter count in bfloat16 where listed, else none counted)")
    parser.add_argument("--fp8-scales", choices=FP8_SCALE_GRANULARITIES, metavar="KIND",
                        help="with an FP8 --dtype: also count the FP32 scales kept beside the "
                             "elements, one a tensor (per-tensor) or one a K/V head (per-head), "
                             "for K and V of every layer")
    parser.add_argument("--list-models", action="store_true",
                        help="list the published configs and exit")


def _error(message: str) -> int:
    print(f"python -m kvdoc memory: error: {message}", file=sys.stderr)
    return 2


def _describe(layer: LayerCache, count: int) -> str:
    if not layer.per_token:
        if not (layer.state or layer.state32):
            return f"{count} x state layer: not counted"
        fp32 = f" + {layer.state32:,} in FP32" if layer.state32 else ""
        return (f"{count} x state layer: nothing a position, a fixed state of {layer.state:,} "
                f"elements{fp32}")
    reach = f"the last {layer.window:,} positions" if layer.window else "every position"
    if layer.shared_kv:
        text = (f"{count} x K = V window: {layer.per_token:,} elements a position (one head, "
                f"K and V alike), {reach}")
        if layer.rate:
            index = f" + {layer.indexer:,} indexer keys" if layer.indexer else ""
            text += (f"; an entry of {layer.entry:,}{index} every {layer.rate} positions, "
                     f"{layer.buffer:,} a position of the unfinished block"
                     + (f" + {layer.overlap:,} carried" if layer.overlap else ""))
        return text
    mla = not layer.kv_heads
    what = ("a latent: kv_lora_rank + qk_rope_head_dim" if mla else
            f"2 x H_kv x D = 2 x {layer.kv_heads} x {layer.head_dim}")
    index = f", and {layer.indexer:,} indexer keys" if layer.indexer else ""
    return (f"{count} x {'MLA' if mla else 'attention'}: {layer.per_token:,} elements a "
            f"position ({what}){index}, {reach}")


def _terms(layer: LayerCache, n: int, T: int) -> list[tuple[str, str]]:
    """The cache-dtype terms of ``n`` layers like ``layer``, in symbols and in numbers."""
    reach = ("T", T) if layer.window is None else ("min(T, W)", min(T, layer.window))
    terms = []
    if layer.kv_heads:
        terms.append((f"L x 2 x H_kv x D x {reach[0]}",
                      f"{n} x 2 x {layer.kv_heads} x {layer.head_dim} x {reach[1]:,}"))
    elif layer.per_token and layer.indexer and not layer.rate:
        terms.append((f"L x (latent + indexer) x {reach[0]}",
                      f"{n} x ({layer.per_token} + {layer.indexer}) x {reach[1]:,}"))
    elif layer.per_token:
        name = "D" if layer.shared_kv else "latent"
        terms.append((f"L x {name} x {reach[0]}", f"{n} x {layer.per_token} x {reach[1]:,}"))
    if layer.rate:
        r = layer.rate
        terms.append(("L x (entry + indexer) x floor(T / r)",
                      f"{n} x ({layer.entry} + {layer.indexer}) x {T // r:,}"))
        terms.append(("L x (buffer x (T mod r) + overlap x [T >= r])",
                      f"{n} x ({layer.buffer} x {T % r} + {layer.overlap} x {int(T >= r)})"))
    if layer.state:
        terms.append(("L x state", f"{n} x {layer.state:,}"))
    return terms


def _formula(model: ModelCache, T: int) -> tuple[str, str, str, str]:
    """What one sequence keeps, in symbols and numbers: cache-dtype terms, then FP32 ones."""
    terms = [t for layer, n in model.groups() for t in _terms(layer, n, T)]
    fp32 = [("L x recurrent state", f"{n} x {layer.state32:,}")
            for layer, n in model.groups() if layer.state32]

    def joined(pairs: list[tuple[str, str]], i: int) -> str:
        return pairs[0][i] if len(pairs) == 1 else f"({' + '.join(p[i] for p in pairs)})"
    return (joined(terms, 0), joined(terms, 1), joined(fp32, 0) if fp32 else "",
            joined(fp32, 1) if fp32 else "")


def _part_lines(model: ModelCache, T: int, B: int, dtype: str) -> list[str]:
    """Each term's bytes, the all-attention model's, and a sequence's at 4k, 32k, 128k."""
    if model.kind == "plain":  # K/V alone: the bytes line says it
        return []
    lines = [f"part       {name}: {format_bytes(n)}"
             + (" (constant in T)" if name.startswith("state") else "")
             for name, n in model.parts(T, B, dtype).items()]
    full = model.all_attention()
    lines.append(f"all attn   {format_bytes(full.kv_bytes(T, B, dtype))} (the same "
                 f"{len(model.layers)} layers, each full attention of the model's own sizes)")
    for t in (4096, 32768, 131072):
        fixed = model.fixed_bytes(dtype)
        lines.append(f"at T       {t:>7,}: {binary_size(model.kv_bytes(t, 1, dtype))} a "
                     f"sequence (state {binary_size(fixed)}, the rest "
                     f"{binary_size(model.kv_bytes(t, 1, dtype) - fixed)}); all attention "
                     f"{binary_size(full.kv_bytes(t, 1, dtype))}")
    return lines


def _weight_bytes(model: ModelCache) -> int | None:
    """The weights' bytes in bfloat16, for a model whose parameters are known."""
    return None if model.parameters is None else model.parameters * ELEMENT_BYTES["bfloat16"]


def _fit_line(model: ModelCache, T: int, dtype: str, memory_gib: float,
              weights_gib: float | None) -> str:
    memory = int(memory_gib * 2**30)
    weights = _weight_bytes(model) if weights_gib is None else int(weights_gib * 2**30)
    if weights_gib is not None:
        given = "--weights"
    elif weights is not None:
        given = f"{model.parameters:,} parameters in bfloat16"
    else:
        given = "weights not counted: give --weights"
    if weights is not None and weights >= memory:
        raise ValueError(f"the weights, {binary_size(weights)} ({given}), leave nothing of "
                         f"--memory {memory_gib:g} GiB")
    fit = model.sequences_that_fit(memory - (weights or 0), T, dtype)
    after = f", after {binary_size(weights)} of weights" if weights is not None else ""
    return f"fits       {fit:,} sequences of {T:,} positions in {memory_gib:g} GiB{after} ({given})"


def _model_lines(model: ModelCache, kind: str, T: int, B: int, dtype: str, default_T: bool,
                 memory_gib: float | None = None, scales: str | None = None,
                 weights_gib: float | None = None) -> list[str]:
    total = model.kv_bytes(T, B, dtype)
    lines = [f"model      {model.name} ({kind}; source: {model.source})"]
    if model.note:
        lines.append(f"note       {model.note}")
    lines += [f"layers     {_describe(layer, n)}" for layer, n in model.groups()]
    if default_T:
        lines.append(f"length     T = {T:,}, the model's context (give --seq-len for another)")
    windows = [layer.window for layer in model.layers if layer.window is not None]
    growth = "one more position inside every window" if windows else "one more position"
    symbols, numbers, symbols32, numbers32 = _formula(model, T)
    more = (f" + B x 4 x {symbols32}", f" + {B:,} x 4 x {numbers32}") if symbols32 else ("", "")
    lines += [
        f"formula    B x s x {symbols}{more[0]}",
        f"           = {B:,} x {element_size(dtype)} ({dtype}) x {numbers}{more[1]}",
        f"bytes      {total:,} bytes",
        f"binary     {binary_size(total)}",
        f"decimal    {decimal_size(total)}",
    ]
    lines += _part_lines(model, T, B, dtype)
    if B > 1:
        lines.append(f"sequence   {format_bytes(model.kv_bytes(T, 1, dtype))}")
    lines.append(f"per token  {format_bytes(model.bytes_per_token(dtype))} ({growth}, per "
                 "sequence)")
    if windows:
        full = sum(1 for layer in model.layers if layer.window is None and layer.per_token)
        past = model.bytes_per_token(dtype, past_windows=True)
        grow = f"only the {full} full layers grow" if full else "no layer grows"
        if any(layer.rate for layer in model.layers):
            grow += "; the compressed entries add one a block"
        lines.append(f"past W     {format_bytes(past) if past else '0 bytes'} (one more position "
                     f"past every window, T > {max(windows):,}: {grow})")
    if scales is not None:
        n = model.fp8_scale_bytes(scales)
        lines += [f"scales     {n:,} bytes of FP32 scales ({scales}, K and V of every K/V "
                  "layer; shared by the batch, whatever T)",
                  f"with them  {format_bytes(total + n)}"]
    if model.fixed_bytes(dtype):
        lines.append(f"fixed      {format_bytes(model.fixed_bytes(dtype))} per sequence, "
                     "whatever T")
    if windows:
        lines.append(f"all full   {format_bytes(model.kv_bytes(T, B, dtype, windows=False))} "
                     "(were every layer to keep all T)")
    if memory_gib is not None:
        lines.append(_fit_line(model, T, dtype, memory_gib, weights_gib))
    return lines


def main(args: argparse.Namespace) -> int:
    """Print the K/V bytes for ``args``; 2 (nothing on stdout) on inconsistent options."""
    if args.list_models:
        for m in MODELS.values():
            print(f"{m.name:20} {m.kind:13} {len(m.layers):3} layers, "
                  f"{m.bytes_per_token('float16'):,} bytes a token in float16, context "
                  f"{m.max_positions:,}  [{m.source}]")
        return 0
    sizes = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    if args.model is not None and args.config is not None:
        return _error("give --model or --config, not both")
    model: ModelCache | None = args.model if args.model is not None else args.config
    T, scales = args.seq_len, args.fp8_scales
    if scales is not None and not dtype_name(args.dtype).startswith("float8"):
        return _error(f"--fp8-scales counts an FP8 cache's scales: give --dtype float8_e4m3fn "
                      f"(fp8) or float8_e5m2, not {dtype_name(args.dtype)}")
    if scales is not None and model is not None and model.kind in ("MLA", "compressed"):
        return _error(f"--fp8-scales counts K/V scales; {model.name} caches no K/V heads "
                      f"({model.kind})")
    if args.weights is not None and args.memory is None:
        return _error("--weights is subtracted from --memory: give --memory too")
    kind = model.kind if model is not None else ""  # the release's, also under a --window
    if model is None:  # typed sizes: a model of L alike layers, through the same lines
        missing = [name for name, value in sizes.items() if value is None]
        if T is None or missing:
            missing = ", ".join(missing + ["--seq-len"] * (T is None))
            return _error("give --model NAME, --config PATH or all of --layers, --kv-heads, "
                          f"--head-dim, --seq-len (missing {missing})")
        layer = attention_layer(args.kv_heads, args.head_dim, args.window)
        model = ModelCache("typed sizes", (layer,) * args.layers, MAX_SEQ_LEN,
                           "the command line")
        kind = model.kind
    elif any(value is not None for value in sizes.values()):
        given = [name for name, value in sizes.items() if value is not None]
        return _error(f"--model and --config set the sizes themselves; drop {', '.join(given)}")
    elif args.window is not None:  # a what-if: every layer keeps at most W
        W = args.window
        model = dataclasses.replace(model, layers=tuple(
            layer._replace(window=W if layer.window is None else min(layer.window, W))
            for layer in model.layers))
    if T is None:
        T = model.max_positions
    elif T > model.max_positions:
        # A warning, not a refusal: the cache's sizes do not change when a context is
        # stretched (RoPE scaling, a long-context fine-tune), so the bytes are still the
        # answer to that what-if; but past the release's context it is one.
        print(f"python -m kvdoc memory: warning: --seq-len {T:,} is past {model.name}'s "
              f"context of {model.max_positions:,} tokens (the bytes below are for a "
              "model stretched that far)", file=sys.stderr)
    try:
        lines = _model_lines(model, kind, T, args.batch, dtype_name(args.dtype),
                             args.seq_len is None, args.memory, scales, args.weights)
    except ValueError as err:  # weights that fill the memory
        return _error(str(err))
    print("\n".join(lines))
    return 0


def _groups(model: ModelCache) -> list[list[object]]:
    return [[g.per_token, g.window, g.state, n, g.state32, g.indexer, g.rate, g.entry, g.buffer,
             g.overlap, g.what] for g, n in model.groups()]


def calculator_data(initial: str = "Llama-3.1-8B") -> dict[str, object]:
    """The calculator page's JSON (``docs/_static/kvdoc-calculator.js`` computes from it):
    element sizes, and for each of :data:`MODELS` what this command prints of it, the boxes'
    ``sizes`` ``[L, H_kv, D, W]`` and the layer ``groups``, each ``[per_token, window, state,
    count, state32, indexer, rate, entry, buffer, overlap, what]``.

    >>> data = calculator_data()
    >>> data["initial"], data["presets"][0]["sizes"], data["presets"][0]["groups"]
    ('Llama-3.1-8B', [12, 12, 64, None], [[1536, None, 0, 12, 0, 0, 0, 0, 0, 0, 'K/V']])
    """
    presets = []
    for m in MODELS.values():
        kv = m.kind not in ("MLA", "compressed")  # a latent or a K = V head: no K/V heads
        presets.append({
            "name": m.name, "kind": m.kind, "context": m.max_positions, "source": m.source,
            "note": m.note, "layers": [_describe(g, n) for g, n in m.groups()],
            "parameters": m.parameters, "weights": _weight_bytes(m),
            "sizes": [len(m.layers), m.kv_heads if kv else None, m.head_dim if kv else None,
                      m.sliding_window],
            "groups": _groups(m),
            "all_attention": None if m.kind == "plain" else _groups(m.all_attention())})
    return {"presets": presets, "element_bytes": ELEMENT_BYTES,
            "initial": model_cache(initial).name}
