"""``python -m kvdoc memory``: K/V cache bytes from explicit sizes or a published model's config.

The command prints ``2 x B x L x T x H_kv x D x s`` (:func:`~kvdoc.measure.kv_bytes.kv_bytes`)
in exact, binary and decimal units, for sizes given on the command line or taken from a
:data:`~kvdoc.measure.presets.PRESETS` entry::

    python -m kvdoc memory --batch 1 --layers 32 --seq-len 4096 --kv-heads 8 --head-dim 128 \\
        --dtype float16
    python -m kvdoc memory --model Llama-3-8B --seq-len 8192
    python -m kvdoc memory --model Llama-3-8B        # T: the model's context, 8,192

Importing this module does not import torch: the command starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys

from .byte_units import binary_size, decimal_size, format_bytes
from .dtypes import dtype_name, element_size
from .kv_bytes import kv_bytes
from .presets import PRESETS, ModelPreset, preset

#: The longest ``--seq-len`` (and ``--window``) the command takes: 2**31 - 1 positions. Attention
#: kernels index a sequence's tokens with 32-bit integers (FlashAttention's ``cu_seqlens`` are
#: int32), so no served sequence is longer; the longest published contexts are millions of
#: tokens, hundreds of times shorter. A length past it is a typo, not a what-if.
MAX_SEQ_LEN = 2**31 - 1


def _positive_arg(text: str) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _length_arg(text: str) -> int:
    value = _positive_arg(text)
    if value > MAX_SEQ_LEN:
        raise argparse.ArgumentTypeError(
            f"{value:,} positions is past any sequence an attention kernel indexes "
            f"(at most 2**31 - 1 = {MAX_SEQ_LEN:,}, 32-bit token indices)")
    return value


def _dtype_arg(text: str) -> str:
    try:
        return dtype_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _model_arg(text: str) -> ModelPreset:
    try:
        return preset(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m kvdoc memory``."""
    parser.description = ("K/V cache bytes = 2 x B x L x T x H_kv x D x s, from explicit sizes "
                          "or a published model's config.")
    parser.add_argument("--model", type=_model_arg, metavar="NAME",
                        help="a published config: " + ", ".join(p.name for p in PRESETS.values()))
    parser.add_argument("--batch", type=_positive_arg, default=1, metavar="B",
                        help="sequences (default 1)")
    parser.add_argument("--layers", type=_positive_arg, metavar="L", help="decoder layers")
    parser.add_argument("--seq-len", type=_length_arg, metavar="T",
                        help="cached positions per sequence (default with --model: the model's "
                             "context; a longer one is computed, with a warning)")
    parser.add_argument("--kv-heads", type=_positive_arg, metavar="H",
                        help="K/V heads per layer (not query heads)")
    parser.add_argument("--head-dim", type=_positive_arg, metavar="D", help="size of one head")
    parser.add_argument("--dtype", type=_dtype_arg, default="float16", metavar="NAME",
                        help="element type: float32, float16, bfloat16, float8_e4m3fn, ... "
                             "(default float16)")
    parser.add_argument("--window", type=_length_arg, metavar="W",
                        help="sliding window: each layer keeps only the last W positions "
                             "(default: the model's own window, if it has one)")
    parser.add_argument("--list-models", action="store_true",
                        help="list the published configs and exit")


def _error(message: str) -> int:
    print(f"python -m kvdoc memory: error: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Print the K/V bytes for the sizes in ``args``; 2 (nothing on stdout) on inconsistent
    options."""
    if getattr(args, "list_models", False):
        for p in PRESETS.values():
            window = f", window {p.sliding_window:,}" if p.sliding_window else ""
            print(f"{p.name:16} {p.attention}  L={p.layers} H={p.heads} H_kv={p.kv_heads} "
                  f"D={p.head_dim} context {p.max_positions:,}{window}  [{p.source}]")
        return 0
    sizes = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    model: ModelPreset | None = args.model
    T = args.seq_len
    if model is not None:
        given = [name for name, value in sizes.items() if value is not None]
        if given:
            return _error(f"--model sets the sizes itself; drop {', '.join(given)}")
        layers, kv_heads, head_dim = model.layers, model.kv_heads, model.head_dim
        window = args.window if args.window is not None else model.sliding_window
        if T is None:
            T = model.max_positions
        elif T > model.max_positions:
            # A warning, not a refusal: the cache's sizes do not change when a context is
            # stretched (RoPE scaling, a long-context fine-tune), so the bytes are still the
            # answer to that what-if; but past the release's context it is one.
            print(f"python -m kvdoc memory: warning: --seq-len {T:,} is past {model.name}'s "
                  f"context of {model.max_positions:,} tokens (the bytes below are for a "
                  "model stretched that far)", file=sys.stderr)
    else:
        if T is None:
            return _error("--seq-len is required without --model")
        missing = [name for name, value in sizes.items() if value is None]
        if missing:
            return _error("give --model NAME or all of --layers, --kv-heads, --head-dim "
                          f"(missing {', '.join(missing)})")
        layers, kv_heads, head_dim = args.layers, args.kv_heads, args.head_dim
        window = args.window
    B, s = args.batch, element_size(args.dtype)
    total = kv_bytes(B, layers, T, kv_heads, head_dim, args.dtype)
    lines = []
    if model is not None:
        lines.append(f"model      {model.name} ({model.attention}, {model.heads} query heads; "
                     f"source: {model.source})")
        if args.seq_len is None:
            lines.append(f"length     T = {T:,}, the model's context (give --seq-len for another)")
    lines += [
        f"formula    2 x B x L x T x H_kv x D x s = 2 x {B:,} x {layers:,} x {T:,} "
        f"x {kv_heads:,} x {head_dim:,} x {s} ({dtype_name(args.dtype)})",
        f"bytes      {total:,} bytes",
        f"binary     {binary_size(total)}",
        f"decimal    {decimal_size(total)}",
        f"per token  {format_bytes(total // (B * T))} (per sequence)",
    ]
    if window is not None:
        held = min(T, window)
        windowed = kv_bytes(B, layers, T, kv_heads, head_dim, args.dtype, window=window)
        lines += [f"window     each layer keeps the last {window:,} positions: "
                  f"holds min(T, W) = {held:,}",
                  f"windowed   {format_bytes(windowed)}"]
    print("\n".join(lines))
    return 0
