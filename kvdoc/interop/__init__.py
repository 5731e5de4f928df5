"""Bridges to other libraries: transformers' GPT-2, Llama and Mistral, both ways (``hf``),
DeepSeek-V3's dense layers (``deepseek``) and Gemma 3's text model (``gemma``).

Built only on :mod:`kvdoc.core`; transformers itself is imported when a function needs it.
"""
