"""What a model is, in the words the verification selects models by: its traits. A variant names
the traits it needs, never models, so a model added to the grid is swept by every variant it
can host.

>>> from kvdoc.core.model import llama_config
>>> sorted(traits(llama_config(n_kv_head=2)))
['decoder', 'fused', 'grouped', 'kv', 'rope']
>>> check_traits({"rope", "shiny"})
Traceback (most recent call last):
...
ValueError: unknown trait 'shiny'; the traits are compressed, decoder, deep, deltanet, ...
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

from kvdoc.core.deltanet import DeltaNetConfig
from kvdoc.core.gemma import Gemma3Config
from kvdoc.core.gptoss import GptOssConfig
from kvdoc.core.indexed import IndexedConfig
from kvdoc.core.mamba2 import Mamba2Config
from kvdoc.core.mla import MLAConfig
from kvdoc.core.model import GPTConfig
from kvdoc.core.v4 import CompressedConfig

from .grid import MODELS

TRAITS: dict[str, str] = {
    "decoder": "a kvdoc Decoder of a GPTConfig (GPT-2, Llama, Mistral): its attention, blocks and "
               "positions are the ones the variants subclass",
    "gemma": "a Gemma 3 decoder (q/k norms, two RoPE bases, soft-capped logits)",
    "gptoss": "a gpt-oss decoder (a sink logit per head in every softmax, experts, YaRN)",
    "kv": "caches K and V per head (not a latent)",
    "latent": "caches MLA's latent c_KV and rotary key instead of K and V",
    "indexed": "each query reads the top k keys an indexer scores (DeepSeek-V3.2), indexer keys "
               "cached beside the latent",
    "compressed": "a DeepSeek-V4 decoder: a window of K = V rows, pooled entries of finished "
                  "blocks and the unfinished block's rows, learned sinks",
    "learned": "learned absolute positions (wpe), which Decoder.forward(positions=...) replaces",
    "rope": "rotary positions, turned inside the attention",
    "fused": "a decoder the fused fast step runs (FastDecoder has no q/k norms)",
    "grouped": "1 < H_kv < H: sharing K/V heads by tiling differs from sharing them by group",
    "window": "a sliding window on every layer",
    "hybrid": "window and global layers in one model",
    "global-first": "window and global layers, the first one global: a layout no every-k-th "
                    "pattern gives, so code that treats the layout as a pattern shows",
    "deltanet": "a Qwen3.5-style hybrid: Gated DeltaNet layers beside gated full-attention layers",
    "mamba": "a Mamba-2 hybrid (Bamba's layout): Mamba-2 mixers beside attention layers",
    "state": "layers that cache a fixed-size state (a conv window, a recurrent matrix) folded "
             "over every position, not rows: it cannot be cropped, only restored from a snapshot",
    "deep": "10 or more layers: layer indices of two digits, so an order by name ('10' before "
            "'2') is not the order by number",
}
FAMILIES = ("decoder", "gemma", "gptoss", "latent", "deltanet", "mamba", "compressed")
"""The traits that say which code a model is: a variant subclasses one family's."""


def check_traits(names: Iterable[str]) -> frozenset[str]:
    names = frozenset(names)
    for name in sorted(names):
        if name not in TRAITS:
            raise ValueError(f"unknown trait {name!r}; the traits are {', '.join(sorted(TRAITS))}")
    return names


def traits(config: object) -> frozenset[str]:
    """The traits of a model with ``config``; ``ValueError`` for a config kvdoc does not know."""
    if isinstance(config, MLAConfig):
        return frozenset({"latent", "rope"} | ({"indexed"} if isinstance(config, IndexedConfig)
                                               else set()))
    if isinstance(config, CompressedConfig):
        return frozenset({"compressed", "rope"})
    if isinstance(config, DeltaNetConfig):
        found = {"deltanet", "state", "kv", "rope"}  # K/V in its attention layers
    elif isinstance(config, Mamba2Config):
        found = {"mamba", "state", "rope"} | ({"kv"} if config.attn_layers else set())
    elif isinstance(config, Gemma3Config | GptOssConfig):
        found = {"gemma" if isinstance(config, Gemma3Config) else "gptoss", "kv", "rope"}
        windows = set(config.layer_windows)
        if None in windows and len(windows) > 1:
            found |= {"hybrid"} | ({"global-first"} if config.layer_windows[0] is None else set())
    elif isinstance(config, GPTConfig):
        found = {"decoder", "kv", "learned" if config.position == "learned" else "rope"}
        found |= {"window"} if config.sliding_window is not None else set()
        found |= set() if config.qk_norm else {"fused"}
    else:
        raise ValueError(f"no traits known for a {type(config).__name__}: teach "
                         "kvdoc.proofs.traits.traits it")
    if 1 < config.n_kv_head < config.n_head:
        found.add("grouped")
    if config.n_layer >= 10:
        found.add("deep")
    return frozenset(found)


@cache
def grid_traits(name: str) -> frozenset[str]:
    return traits(MODELS[name].build(0).config)
