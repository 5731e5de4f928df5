"""kvdoc: a GPT-2 decoder with a per-layer K/V cache, and the tools that prove it correct.

>>> import kvdoc
>>> kvdoc.Decoder(kvdoc.GPTConfig()).num_parameters()
145280
"""

from .cache import DynamicCache, KVCache, StaticCache
from .config import GPTConfig
from .mask import offset_causal_mask, top_left_causal_mask
from .model import Decoder, DecoderOutput, decode_step, generate, prefill

__version__ = "0.1.0"

__all__ = [
    "GPTConfig",
    "Decoder",
    "DecoderOutput",
    "KVCache",
    "DynamicCache",
    "StaticCache",
    "offset_causal_mask",
    "top_left_causal_mask",
    "prefill",
    "decode_step",
    "generate",
]
