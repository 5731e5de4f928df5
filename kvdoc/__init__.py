"""kvdoc: a GPT-2 or Llama-style decoder with per-layer K/V caches, and the tools that prove it.

>>> import kvdoc
>>> kvdoc.Decoder(kvdoc.GPTConfig()).num_parameters()
145280
>>> kvdoc.Decoder(kvdoc.mistral_config()).new_cache(1).window
32
"""

from .core.cache import DynamicCache, KVCache, StaticCache
from .core.config import GPTConfig, llama_config, mistral_config
from .core.mask import offset_causal_mask
from .core.model import Decoder, DecoderOutput, decode_step, generate, prefill
from .core.window import SlidingWindowCache

__version__ = "0.1.0"

__all__ = [
    "GPTConfig",
    "llama_config",
    "mistral_config",
    "Decoder",
    "DecoderOutput",
    "KVCache",
    "DynamicCache",
    "StaticCache",
    "SlidingWindowCache",
    "offset_causal_mask",
    "prefill",
    "decode_step",
    "generate",
]
