"""Bridges to other libraries: transformers' GPT-2, Llama and Mistral, both ways (``hf``).

Built only on :mod:`kvdoc.core`; transformers itself is imported when a function needs it.
"""
