"""Bridges to transformers, both ways: GPT-2, Llama and Mistral (configurations in ``hf_config``,
weights in ``hf_weights``), DeepSeek-V3's dense layers (``hf_deepseek``), Gemma 3's text model
(``hf_gemma``), FP64 comparisons (``hf_float64``) and the transformers names the site shows
(``hf_names``). Built only on :mod:`kvdoc.core`; transformers is imported when a function needs it.
"""
