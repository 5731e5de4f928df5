"""kvdoc: a GPT-2 or Llama-style decoder with per-layer K/V caches, and the tools that prove it.

>>> import kvdoc
>>> kvdoc.Decoder(kvdoc.GPTConfig()).num_parameters()
145280
>>> [layer.window for layer in kvdoc.Decoder(kvdoc.mistral_config()).new_cache(1).layers]
[32, 32]
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

# The names below are imported on first use (PEP 562), not with the package: they need torch,
# which takes seconds to load, and ``python -m kvdoc memory`` or ``--help`` need none of it.
_LAZY = {
    "DynamicCache": "core.cache", "KVCache": "core.cache", "StaticCache": "core.cache",
    "GPTConfig": "core.model", "llama_config": "core.model", "mistral_config": "core.model",
    "offset_causal_mask": "core.model",
    "Decoder": "core.model", "DecoderOutput": "core.model", "decode_step": "core.model",
    "generate": "core.model", "prefill": "core.model",
    "window_cache": "core.window",
    "parallel_generate": "parallel.decode",
    "batch_invariant": "core.invariant",
}

try:  # one version, pyproject.toml's, as installed
    __version__ = version("kvdoc")
except PackageNotFoundError:  # a source tree on sys.path that pip never installed
    __version__ = "0+unknown"

__all__ = [
    "GPTConfig",
    "llama_config",
    "mistral_config",
    "Decoder",
    "DecoderOutput",
    "KVCache",
    "DynamicCache",
    "StaticCache",
    "window_cache",
    "offset_causal_mask",
    "prefill",
    "decode_step",
    "generate",
    "parallel_generate",
    "batch_invariant",
]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # found once; later lookups do not come here
        return value
    try:  # a layer (kvdoc.core, kvdoc.measure, ...), as an eager import would have bound it
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
