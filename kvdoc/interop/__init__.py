"""Bridges to other libraries: transformers' GPT-2, Llama and Mistral, both ways (configurations
in ``hf_config``, weights in ``hf_weights``, FP64 comparisons in ``hf_float64``), DeepSeek-V3's
dense layers (``hf_deepseek``), Gemma 3's text model (``hf_gemma``) and the transformers names
the site shows (``hf_names``).

Built only on :mod:`kvdoc.core`; transformers itself is imported when a function needs it.
"""
